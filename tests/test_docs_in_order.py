"""The README's and docs/'s examples run in the order they are written, on a fresh clone: no
example trains into a run directory an earlier one already finished at as many steps or more
(that run only prints `nothing to do`), and every input an example names (a `--run-dir`, a
`--hf-dir`, `data.path`, a prepared corpus, `init.from_hf`) is made by an earlier example of the
same page (or of the README, which every page follows), shipped in the repository, or one of the
reader's own locations the prose asks them to bring. Static: the commands are read with
tests/test_readme.py's parser and the configs with the real loader; nothing trains."""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
from dataclasses import dataclass, field

import pytest

from configs import load_config
from conftest import ROOT
from test_readme import PLACEHOLDERS, _argv, _read, command_lines, command_lines_at, doc_files, synopsis

# The reader's own data and machines, which the prose asks them to bring: their buckets, their
# Hugging Face checkpoints and raw corpora. Anything else an example reads must be made first.
READERS_OWN = ("gs://my-bucket/", "s3://my-bucket/", "/data/", "/models/llama3-8b", "/shared/", "/local/",
               "corpus/", "books/", "shards/", "path/to/")
# Where the examples write: an input under one of these is made by an earlier example, never shipped.
MADE_BY_EXAMPLES = ("runs/", "prepared/", "exported/")
# Commands that only write: `--output` of the example makers, `--out` of an export.
OUTPUT_FLAGS = ("--output", "--out")


@functools.cache
def _shipped() -> frozenset[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    files = out.stdout.split()
    return frozenset(files) | {os.path.dirname(f) for f in files}


def inline_command_spans(doc: str) -> list[tuple[int, str]]:
    """(offset, text) of each code span in prose that is a whole `make train ...` or `python X ...`
    command: prose asks the reader to run these too, in its order."""
    text = _read(doc)
    fenced = [m.span() for m in re.finditer(r"^```.*?^```", text, re.S | re.M)]
    spans = []
    for m in re.finditer(r"(?<!`)`([^`\n]+)`(?!`)", text):
        if any(a <= m.start() < b for a, b in fenced):
            continue
        if re.match(r"(make train|python (train|hf|generate|eval)\.py|python -m data\.) ", m.group(1)):
            spans.append((m.start(), m.group(1)))
    return spans


def ordered_lines(doc: str) -> list[str]:
    """Every command of `doc` in reading order: the fenced blocks' lines (test_readme's parser)
    and the commands written inline in prose (a block's lines keep their order: sorting is stable)."""
    return [line for _, line in sorted(command_lines_at(doc) + inline_command_spans(doc), key=lambda p: p[0])]


@dataclass
class Tree:
    """What the examples so far have made: run directories (with the config an import gave them
    and the steps trained) and other paths."""
    runs: dict[str, tuple[str | None, list[str], int]] = field(default_factory=dict)
    made: set[str] = field(default_factory=set)

    def copy(self) -> Tree:
        return Tree(dict(self.runs), set(self.made))

    def has(self, path: str) -> bool:
        path = path.rstrip("/")
        return any(path == m or path.startswith(m + "/") for m in self.made | set(self.runs))


def _argv_of(line: str) -> list[str]:
    # Placeholders (`model.vocab_size=...`, `$JOB_COMPLETION_INDEX`) are the reader's to fill in.
    argv = [w for w in _argv(line) if w not in PLACEHOLDERS and "$" not in w and "..." not in w]
    if argv[:2] == ["make", "train"]:  # `make train ARGS="..."` runs `python train.py ...`
        args = [w.split("=", 1)[1] for w in argv[2:] if w.startswith("ARGS=")]
        return ["python", "train.py", *(shlex.split(args[0]) if args else [])]
    return argv


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def missing_input(path: str, tree: Tree) -> str | None:
    """Why `path` is not there for the example reading it, or None."""
    if not path or path.startswith(READERS_OWN) or re.fullmatch(r"[A-Z_]+", path) or tree.has(path):
        return None
    if not path.startswith(MADE_BY_EXAMPLES) and path.rstrip("/") in _shipped():
        return None
    return f"reads {path}, which no earlier example makes and the repository does not ship"


def _train(argv: list[str], tree: Tree) -> list[str]:
    """A `python train.py` example: its inputs, then its run directory's steps."""
    words = [w for w in argv[2:] if not w.startswith("--")]
    config = _flag(argv, "--config")
    overrides = [w for w in words if "=" in w and w != config]
    imported = config and re.fullmatch(r"(runs/[^/]+)/config\.yaml", config)
    if imported:  # written by `hf.py import`: that run's config, its run.dir, then these overrides
        if imported.group(1) not in tree.runs:
            return [f"reads {config}, which no earlier `hf.py import` writes"]
        base, base_overrides, _ = tree.runs[imported.group(1)]
        cfg = load_config(base, [*base_overrides, f"run.dir={imported.group(1)}", *overrides])
    else:
        cfg = load_config(config, overrides)
    inputs = [cfg.init.from_hf] + ([cfg.data.path] if cfg.data.source == "prepared" else [])
    inputs += [part.rsplit(":", 1)[0] for part in cfg.data.mixture.split(",") if part]
    wrong = [why for path in inputs if (why := missing_input(path, tree))]
    run_dir, steps = cfg.run.dir.rstrip("/"), cfg.train.steps
    if run_dir in tree.runs and tree.runs[run_dir][2] >= steps:
        wrong.append(f"trains {run_dir} to step {steps}, which an earlier example finished at step "
                     f"{tree.runs[run_dir][2]}: it prints only `nothing to do` (give it a fresh run.dir)")
    base = tree.runs.get(run_dir, (config, overrides, 0))
    tree.runs[run_dir] = (base[0], base[1], max(steps, base[2]))
    return wrong


def follow(line: str, tree: Tree) -> list[str]:
    """Run one example against `tree` (updating it); what is wrong with it, if anything."""
    argv = _argv_of(line)
    if len(argv) < 2 or synopsis(_argv(line)) or argv[0] != "python":
        return []
    if argv[1] == "train.py":
        if any(w in argv for w in ("--sweep", "--help-config")):
            return []
        return _train(argv, tree)
    wrong = []
    for flag in ("--run-dir", "--hf-dir", "--input"):
        path = _flag(argv, flag)
        if path and not (flag == "--run-dir" and argv[1:3] == ["hf.py", "import"]):
            if flag != "--input" or path.startswith(MADE_BY_EXAMPLES):  # raw corpora are the reader's
                wrong += [why for why in [missing_input(path, tree)] if why]
    if argv[1:3] == ["-m", "ops.plot"]:
        wrong += [why for why in [missing_input(argv[3], tree)] if why]
    if argv[1:3] == ["hf.py", "import"]:
        run_dir = _flag(argv, "--run-dir").rstrip("/")
        if run_dir in tree.runs:
            wrong.append(f"imports into {run_dir}, which an earlier example already made")
        tree.runs[run_dir] = (_flag(argv, "--config"), [w for w in argv if "=" in w and not w.startswith("-")], 0)
    tree.made.update(out.rstrip("/") for flag in OUTPUT_FLAGS if (out := _flag(argv, flag)))
    return wrong


@functools.cache
def after_readme() -> tuple[Tree, tuple[str, ...]]:
    """What the README's examples make, in order, and what was wrong with them."""
    tree, wrong = Tree(), []
    for line in ordered_lines("README.md"):
        wrong += [f"README.md: {line}: {why}" for why in follow(line, tree)]
    return tree, tuple(wrong)


def problems(doc: str) -> list[str]:
    """Each page starts where the README's tour left a fresh clone."""
    base, wrong = after_readme()
    if doc == "README.md":
        return list(wrong)
    tree = base.copy()
    return [f"{doc}: {line}: {why}" for line in ordered_lines(doc) for why in follow(line, tree)]


@pytest.mark.parametrize("doc", doc_files())
def test_examples_run_in_the_order_written(doc):
    assert not problems(doc), "\n".join(problems(doc))


def test_the_order_check_sees_a_finished_run_and_a_missing_input():
    """The two mistakes this file looks for are found: a follow-up aimed at the finished default
    run, and a checkpoint directory nobody made."""
    tree = Tree()
    assert follow("make train", tree) == []
    (again,) = follow('make train ARGS="train.steps=50"', tree)
    assert "runs/default" in again and "nothing to do" in again
    assert follow('make train ARGS="train.steps=50 run.dir=runs/short"', tree) == []
    (absent,) = follow("python hf.py import --hf-dir /models/tiny-llama --run-dir runs/x --config configs/tiny.yaml", tree)
    assert "/models/tiny-llama" in absent
    assert follow("python train.py --config runs/x/config.yaml", tree) == []
    assert follow("python hf.py export --run-dir runs/x --out exported/x", tree) == []
    assert follow("python generate.py --run-dir exported/x --prompt a", tree) == []
    assert len(ordered_lines("README.md")) > len(command_lines("README.md"))  # prose commands are read too
