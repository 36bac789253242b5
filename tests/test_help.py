"""`--help` of every entry point answers at once: each imports JAX, the model, the trainer and the
harness only after its arguments are parsed. Real processes, timed, and their imports read
(`python -X importtime`), so the check does not hang on the machine's load alone."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from conftest import ROOT

ENTRY_POINTS = (["train.py"], ["plan.py"], ["hf.py"], ["hf.py", "export"], ["generate.py"], ["eval.py"],
                ["sweep.py"], ["-m", "data.prepare"])
HEAVY = ("jax", "flax", "orbax", "grain", "lm_eval", "transformers", "torch")
HELP_WITHIN_S = 2.0


@pytest.mark.parametrize("command", ENTRY_POINTS, ids=" ".join)
def test_help_answers_before_the_heavy_imports(command):
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-X", "importtime", *command, "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    seconds = time.perf_counter() - t0
    assert done.returncode == 0 and done.stdout.startswith("usage: "), done.stdout + done.stderr[-2000:]
    imported = {line.rpartition("|")[2].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert not {m for m in imported if m.split(".")[0] in HEAVY}, f"{command} --help imported {sorted(imported)}"
    assert seconds < HELP_WITHIN_S, f"{' '.join(command)} --help took {seconds:.2f} s"
