"""The checks of a run against what is on disk, before anything is compiled or written: run.dir
(its bucket, when on an object store; a resume must keep the keys its checkpoints fix), the local checkpoint tier's directory, a
Hugging Face checkpoint to start from, the trackers' packages and the eval tasks' files. Each
failure is one `ConfigError` line naming the key.
"""

from __future__ import annotations

from typing import Any

import storage
from configs import Config, ConfigError, check_output
from model import hf
from ops.trackers import check_trackers
from trainer.checkpoint import RunDir, check_resumable
from trainer.tiers import check_local_dir


def check_storage(cfg: Config) -> None:
    """run.dir can be written, before anything reads it: a local directory (or one that can be
    made), or on an object store a bucket that exists and answers (configs.check_output: one line
    naming run.dir otherwise), of which nothing is asked that only a local directory can hold."""
    check_output(cfg.run.dir, "run.dir")
    if storage.is_remote(cfg.run.dir) and cfg.profile.steps:
        raise ConfigError(f"profile.steps: jax.profiler writes its trace to a local directory, not run.dir={cfg.run.dir}; "
                          "trace with a local run.dir")


def check_files(cfg: Config, found: RunDir) -> None:
    """What `cfg` names on disk, `found` being run.dir as read once (trainer.checkpoint)."""
    check_resumable(cfg, found)
    check_local_dir(cfg)
    check_trackers(cfg)
    # Once the run has checkpoints (of either tier) it resumes from them; a LoRA run's hold no
    # base, read from init.from_hf again.
    if cfg.init.from_hf and (not found.resumes or cfg.model.lora.enabled):
        hf.check_compatible(cfg.model, cfg.init.from_hf)


def check_tasks(cfg: Config) -> Any:
    """eval.tasks found, with their data files (evaluation.tasks.Tasks), or None without any.
    Raises ConfigError; lm-evaluation-harness is imported only for a run that names tasks."""
    if not cfg.eval.tasks:
        return None
    try:
        from evaluation.tasks import resolve_tasks
    except ImportError as e:
        raise ConfigError(f"eval.tasks: needs lm-evaluation-harness ({e}): pip install 'meshlm[eval]'") from None
    return resolve_tasks(cfg.eval.tasks, cfg.eval.tasks_dir)
