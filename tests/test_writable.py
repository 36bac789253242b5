"""Every output path is checked before work starts: an unwritable one (under /proc, which refuses a
new folder even to root, or a path through a file) is one line naming the key or flag and the
path, exit status 2, and nothing is created, for each entry point that writes."""

from __future__ import annotations

import os

import pytest

from configs import ConfigError, dump_config, load_config
from configs.writable import check_writable
from conftest import stdlib_glob
from data.examples import main as examples_main
from data.prepare import main as prepare_main
from eval import main as eval_main
from hf import main as hf_main
from plan import main as plan_main
from train import main as train_main


def _run_dir_with_a_checkpoint(path) -> str:
    """A run directory as eval.py and hf.py export find one (config.yaml, a step folder): they
    check their outputs before they read the checkpoint."""
    os.makedirs(path / "checkpoints" / "4")
    (path / "config.yaml").write_text(dump_config(load_config("tiny", [f"run.dir={path}"])))
    return str(path)


# (test id, the key or flag named, the entry point, its arguments for tmp_path)
CASES = [
    ("train run.dir", "run.dir", train_main, lambda tmp: ["--config", "tiny", "run.dir=/proc/meshlm-run"]),
    ("train checkpoint.local_dir", "checkpoint.local_dir", train_main,
     lambda tmp: ["--config", "tiny", f"run.dir={tmp / 'run'}", "checkpoint.local_dir=/proc/meshlm-local",
                  "checkpoint.local_every=2"]),
    ("train run.compile_cache", "run.compile_cache", train_main,
     lambda tmp: ["--config", "tiny", f"run.dir={tmp / 'run'}", "run.compile_cache=/proc/meshlm-cache"]),
    ("plan --out", "--out", plan_main, lambda tmp: ["--config", "tiny", "--devices", "8", "--out", "/proc/meshlm.json"]),
    ("plan --dump-hlo", "--dump-hlo", plan_main,
     lambda tmp: ["--config", "tiny", "--devices", "8", "--dump-hlo", "/proc/meshlm-hlo"]),
    ("hf export --out", "--out", hf_main,
     lambda tmp: ["export", "--run-dir", _run_dir_with_a_checkpoint(tmp / "ckpt"), "--out", "/proc/meshlm-export"]),
    ("data.prepare --output", "--output", prepare_main,
     lambda tmp: ["--input", stdlib_glob("json"), "--output", "/proc/meshlm-corpus"]),
    ("data.examples --output", "--output", examples_main, lambda tmp: ["--output", "/proc/meshlm-examples"]),
    ("eval --output", "--output", eval_main,
     lambda tmp: ["--run-dir", _run_dir_with_a_checkpoint(tmp / "ckpt"), "--tasks", "stdlib_words", "--output",
                  "/proc/meshlm-scores.json"]),
]


@pytest.mark.parametrize("key, main, arguments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_an_unwritable_output_is_one_line_and_exit_2(key, main, arguments, tmp_path, capsys):
    argv = arguments(tmp_path)
    before = sorted(os.listdir(tmp_path))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    path = argv[argv.index(key) + 1] if key.startswith("--") else next(a.split("=", 1)[1] for a in argv
                                                                       if a.startswith(key + "="))
    assert err.startswith(f"error: {key}={path}: /proc is not a writable directory (making a folder there: "), err
    assert "\n" not in err and not os.path.exists(path) and sorted(os.listdir(tmp_path)) == before


def test_a_path_through_a_file_and_a_file_where_a_folder_goes(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=f"run.dir={blocker / 'run'}: {blocker} is not a writable directory"):
        check_writable(str(blocker / "run"), "run.dir")
    with pytest.raises(ConfigError, match=f"run.dir={blocker}: exists and is not a directory"):
        check_writable(str(blocker), "run.dir")
    with pytest.raises(ConfigError, match=f"--out={tmp_path}: is a directory, not a file"):
        check_writable(str(tmp_path), "--out", file=True)
    check_writable(str(tmp_path / "new" / "deeper"), "run.dir")  # created later, by the run
    check_writable(str(blocker), "--out", file=True)  # a file to replace
    check_writable("gs://bucket/run", "run.dir")  # the storage layer checks buckets
    assert sorted(os.listdir(tmp_path)) == ["a-file"]
