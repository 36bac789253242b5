"""`train.objective=sft`: supervised fine-tuning, the next-token loss on the tokens a corpus
marks as trained (an assistant's turns: `data.prepare --objective sft`, data/chat.py), the
conversations packed apart (document packing). The loss is the LM's (trainer/objectives/lm.py)
with the corpus's loss mask; the step also reports how many tokens it trained on.
"""

from __future__ import annotations

from typing import Any

import jax

from configs import Config, ConfigError
from trainer.objectives.lm import LM, terms_console
from trainer.objectives.registry import register

Array = jax.Array


def require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


def check_prepared(cfg: Config) -> None:
    """A post-training objective reads one corpus `data.prepare --objective NAME` wrote."""
    name, d = cfg.train.objective, cfg.data
    require(d.source == "prepared", "train.objective", f"{name} reads a corpus that `python -m data.prepare "
            f"--objective {name}` wrote; set data.source=prepared and data.path")
    require(not d.mixture, "train.objective", f"{name} reads one prepared corpus (data.path), not data.mixture")


@register
class SFT(LM):
    name = "sft"
    data_format = "sft"

    @classmethod
    def check(cls, cfg: Config) -> None:
        check_prepared(cfg)
        require(cfg.data.packing == "document", "data.packing", "train.objective=sft needs document packing, which "
                "keeps conversations apart")

    def step_metrics(self, aux: Any) -> dict[str, Array]:
        return {"trained_tokens": jax.tree.leaves(aux)[0], **super().step_metrics(aux)}

    def console(self, record: dict[str, float]) -> list[str]:
        return terms_console(self.cfg, record, [f"trained {record['trained_tokens']:,.0f} tok"])
