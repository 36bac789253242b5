"""The README's and docs/'s command blocks name only what exists: every config key (dotted
`key=value`), every flag (`--x`, checked against the command's own `--help`, run as a real
process), every file of this repository and every make target; the `python train.py` commands
load their config and overrides through the real loader, and the cheap ones run (`--emit
slurm`). Every relative link in them resolves to a file, and a `#anchor` to one of its headings."""

from __future__ import annotations

import functools
import glob
import json
import shutil
import os
import re
import shlex
import subprocess
import sys

import pytest

import train
from configs import all_keys, load_config
from configs.schema import LOGICAL_AXES
from conftest import ROOT
from sweep import load_sweep

# Placeholders the README writes for "your value here", never passed as they are.
PLACEHOLDERS = {"...", "FILE", "key=value", "dotted.key=value"}
# Shell and scheduler front ends that wrap one of our commands.
WRAPPERS = {"srun"}


def _made_by_use() -> tuple[str, ...]:
    """The top-level entries that exist only once a user has run something (the venv, run
    directories, prepared corpora, exports): .gitignore's root entries, so a clone where the docs'
    commands were followed reads them as the user's, not as files the repository must hold."""
    with open(os.path.join(ROOT, ".gitignore")) as f:
        return tuple(line.strip().strip("/") for line in f if line.startswith("/"))


MADE_BY_USE = _made_by_use()


def doc_files() -> list[str]:
    """README.md and every page of docs/, relative to the repository root."""
    pages = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
    return ["README.md", *pages]


def _read(doc: str) -> str:
    with open(os.path.join(ROOT, doc)) as f:
        return f.read()


def command_lines_at(doc: str = "README.md") -> list[tuple[int, str]]:
    """(offset of its block in `doc`, line) for every line of a fenced block of `doc` that runs
    one of our commands (continuations joined), in reading order."""
    lines = []
    for block in re.finditer(r"^```[^\n]*\n(.*?)^```", _read(doc), re.S | re.M):
        for line in re.sub(r"\\\n\s*", " ", block.group(1)).splitlines():
            line = line.strip()
            if re.match(r"(make|python|\.venv/bin/python|\. |srun|gcloud|[A-Z_]+=)", line):
                lines.append((block.start(), line))
    return lines


def command_lines(doc: str = "README.md") -> list[str]:
    """Every line of a fenced block of `doc` that runs one of our commands (continuations joined)."""
    return [line for _, line in command_lines_at(doc)]


def all_command_lines() -> list[tuple[str, str]]:
    """(document, line) for every command line of README.md and docs/."""
    return [(doc, line) for doc in doc_files() for line in command_lines(doc)]


def _argv(line: str) -> list[str]:
    """The command's words: comments, a trailing `&`, leading VAR=value and wrappers removed;
    `gcloud ... --command "cd X && CMD"` gives CMD. Placeholders are left in (see `synopsis`)."""
    words = shlex.split(line, comments=True)
    if words and words[0] == "gcloud":
        inner = words[words.index("--command") + 1]
        return _argv(inner.split("&&")[-1])
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        words = words[1:]
    if words and words[0] in WRAPPERS:
        words = words[next(i for i, w in enumerate(words) if w == "python"):]
    # `[--config FILE]` in a usage line loses its brackets; `run.trackers=[a,b]` keeps its own.
    return [w.strip("[]") if w.count("[") != w.count("]") else w for w in words if w != "&"]


def synopsis(argv: list[str]) -> bool:
    """A usage line (`[--config FILE] [key=value ...]`): its words are checked, not parsed."""
    return any(w in PLACEHOLDERS for w in argv)


def commands(doc: str | None = None) -> list[list[str]]:
    """The words of every command line of `doc` (None: of README.md and every page of docs/)."""
    lines = command_lines(doc) if doc else [line for _, line in all_command_lines()]
    return [[w for w in _argv(line) if w not in PLACEHOLDERS] for line in lines]


def _starts(argvs: list[list[str]]) -> set[str]:
    return {" ".join(argv[:3]) for argv in argvs}


def test_the_docs_have_the_commands_this_test_reads():
    """A parser that found nothing would pass everything below: the README's tour and the docs'
    blocks hold these."""
    readme = _starts(commands("README.md"))
    for expected in ("make train", "make test", "python train.py --config", "python plan.py", "python hf.py",
                     "python generate.py"):
        assert any(f.startswith(expected) for f in readme), (expected, readme)
    everywhere = _starts(commands())
    for expected in ("python train.py --sweep", "python -m data.prepare"):
        assert any(f.startswith(expected) for f in everywhere), (expected, everywhere)
    for wrapper in ("srun", "gcloud"):  # unwrapped by _argv, so looked for in the lines
        assert any(line.startswith(wrapper) for _, line in all_command_lines()), wrapper
    assert len(commands("README.md")) >= 8 and len(commands()) >= 60
    assert len(doc_files()) >= 15, doc_files()


def test_the_test_table_names_every_test_file():
    """docs/tests.md's "one file a concern" table has a row for each test file: a page cut
    short or a new file left out shows here."""
    with open(os.path.join(ROOT, "docs", "tests.md")) as f:
        rows = [line for line in f if line.startswith("| `test_")]
    named = set(re.findall(r"`(test_\w+\.py)`", "".join(rows)))
    files = {name for name in os.listdir(os.path.join(ROOT, "tests")) if re.fullmatch(r"test_\w+\.py", name)}
    assert files - named == set(), f"docs/tests.md's test table has no row for {sorted(files - named)}"


def _is_key_value(word: str) -> bool:
    return re.fullmatch(r"[a-z_]+(\.[a-z_0-9]+)+=.*", word) is not None


def _check_key(key: str) -> None:
    table = re.fullmatch(r"sharding\.(params|activations)\.(\w+)", key)
    if table:
        assert table.group(2) in LOGICAL_AXES, f"{key}: not a logical name"
    else:
        assert key in all_keys(), f"{key}: not a config key"


def _check_path(word: str) -> None:
    """A word naming a file of this repository (its first part is a top-level entry) must exist."""
    for value in (word, word.split("=", 1)[-1]):
        first = value.split("/", 1)[0]  # "" for an absolute path: the user's, not ours
        if "/" in value and first and first not in MADE_BY_USE and os.path.exists(os.path.join(ROOT, first)):
            assert os.path.exists(os.path.join(ROOT, value)), f"{value}: no such file in the repository"


def help_command(argv: list[str]) -> tuple[str, ...] | None:
    """The command whose `--help` names `argv`'s flags (`SCRIPT [SUB]` or `-m MODULE [SUB]`);
    None for make, the venv's own tools and usage lines."""
    if argv[0] in ("make", ".") or argv[:3] == [".venv/bin/python", "-m", "pytest"]:
        return None
    if argv[:2] == ["python", "train.py"]:
        return ("train.py",)
    command, rest = (["-m", argv[2]], argv[3:]) if argv[1] == "-m" else ([argv[1]], argv[2:])
    sub = [rest[0]] if rest and not rest[0].startswith("-") and not _is_key_value(rest[0]) else []
    return (*command, *sub)


# Each command run as `python COMMAND --help` runs it (runpy, sys.argv as the shell gives it),
# all in one process: the entry points import JAX and the trainer, and importing them once, not
# once a command, is most of this file's time.
HELP_ALL = """
import contextlib, io, json, runpy, sys
texts = {}
for command in json.load(sys.stdin):
    out, code = io.StringIO(), None
    with contextlib.redirect_stdout(out):
        try:
            if command[0] == "-m":
                sys.argv = [command[1], *command[2:], "--help"]
                runpy.run_module(command[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = [*command, "--help"]
                runpy.run_path(command[0], run_name="__main__")
        except SystemExit as e:
            code = e.code
    texts[" ".join(command)] = [code, out.getvalue()]
json.dump(texts, sys.__stdout__)
"""


@functools.cache
def help_texts() -> dict[str, list]:
    """' '.join(command) -> [exit code, --help text] for every command the README and docs/ name."""
    wanted = sorted({c for argv in commands() if len(argv) > 1 and (c := help_command(argv))})
    out = subprocess.run([sys.executable, "-c", HELP_ALL], input=json.dumps(wanted), capture_output=True,
                         text=True, cwd=ROOT, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def help_text(*command: str) -> str:
    """`python COMMAND --help`'s text; it must exit 0."""
    code, text = help_texts()[" ".join(command)]
    assert code == 0, f"python {' '.join(command)} --help exited {code}"
    return text


def _check_flags(argv: list[str], text: str) -> None:
    for flag in (w for w in argv if w.startswith("--")):
        assert re.search(rf"{re.escape(flag)}\b", text), f"{flag} is not a flag of {argv[:3]}"


def _check_config(config: str | None, overrides: list[str]) -> None:
    """The config file and the concrete overrides go through the real loader (its static checks)."""
    if config and config.split("/", 1)[0] in MADE_BY_USE:
        return  # written by an earlier command (hf.py import)
    concrete = [w for w in overrides if "$" not in w and "..." not in w]
    load_config(config, concrete)


@pytest.mark.parametrize(("doc", "line"), all_command_lines(), ids=[f"{doc}: {line}" for doc, line in all_command_lines()])
def test_a_documented_command_names_only_what_exists(doc, line):
    argv = _argv(line)
    for word in argv:
        _check_path(word)
        if _is_key_value(word) and word not in PLACEHOLDERS:
            _check_key(word.split("=", 1)[0])
    concrete = [w for w in argv if w not in PLACEHOLDERS]
    if argv[0] == "make":
        with open(os.path.join(ROOT, "Makefile")) as f:
            targets = re.findall(r"^([a-z][a-z-]*):", f.read(), re.M)
        assert set(argv[1:]) <= set(targets), (argv, targets)
    elif argv[0] == "." or argv[:3] == [".venv/bin/python", "-m", "pytest"]:
        return  # the venv's own tools; the test file it names was checked above
    elif argv[:2] == ["python", "train.py"]:
        _check_flags(argv, help_text(*help_command(argv)))
        if synopsis(argv):
            return
        args = train.parse_args(concrete[2:])
        if args.sweep:
            assert load_sweep(os.path.join(ROOT, args.sweep), args.overrides).points
        else:
            _check_config(args.config, args.overrides)
    else:
        if argv[1] == "-m":  # python -m MODULE [SUB]: a package's command (data.prepare, planner.targets)
            module = argv[2]
            assert os.path.exists(os.path.join(ROOT, *module.split(".")) + ".py"), module
        else:  # python SCRIPT [SUB]: an entry point beside train.py (plan.py, hf.py, generate.py)
            assert argv[0] == "python" and os.path.exists(os.path.join(ROOT, argv[1])), argv
        _check_flags(argv, help_text(*help_command(argv)))
        if "--config" in argv:
            _check_config(argv[argv.index("--config") + 1], [w for w in concrete if _is_key_value(w)])


def test_the_sweep_emit_command_runs_as_written(tmp_path):
    """`python train.py --sweep configs/sweeps/tiny_lr.yaml --emit slurm` (from docs/sweeps.md): a
    real process in a copy of the repository's configs, so the sweep's dir: lands in tmp_path."""
    shutil.copytree(os.path.join(ROOT, "configs"), tmp_path / "configs")
    (line,) = {line for _, line in all_command_lines() if "--emit slurm" in line}
    argv = _argv(line)
    assert argv[:2] == ["python", "train.py"], argv
    out = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *argv[2:]], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr
    (script,) = [os.path.join(d, f) for d, _, files in os.walk(tmp_path / "runs") for f in files if f == "sweep.sbatch"]
    with open(script) as f:
        assert 'PYTHON="${PYTHON:-python}"' in f.read()


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lowercase, punctuation other than '-' and '_' dropped
    (backticks and links included), each space a '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(doc: str) -> set[str]:
    """Every heading's anchor in `doc` (outside fenced blocks); repeats get -1, -2, ... as on GitHub."""
    text = re.sub(r"^```.*?^```", "", _read(doc), flags=re.S | re.M)
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, re.M):
        anchor = github_anchor(heading)
        found.add(anchor if anchor not in seen else f"{anchor}-{seen[anchor]}")
        seen[anchor] = seen.get(anchor, 0) + 1
    return found


def relative_links(doc: str) -> list[str]:
    """The targets of `doc`'s Markdown links and images that point into the repository (not
    http(s), mailto or other schemes), outside fenced blocks and code spans."""
    text = re.sub(r"^```.*?^```", "", _read(doc), flags=re.S | re.M)
    text = re.sub(r"`[^`]*`", "", text)  # a code span may wrap a line
    targets = re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)
    targets += re.findall(r"^\s*\[[^\]]+\]:\s*(\S+)", text, re.M)  # reference-style definitions
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t, re.I)]


def broken_links(doc: str) -> list[str]:
    wrong = []
    for target in relative_links(doc):
        path, _, anchor = target.partition("#")
        where = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
        if where.startswith(".."):
            wrong.append(f"{target}: outside the repository")
        elif not os.path.exists(os.path.join(ROOT, where)):
            wrong.append(f"{target}: no file {where}")
        elif anchor and where.endswith(".md") and anchor not in anchors(where):
            wrong.append(f"{target}: {where} has no heading with the anchor #{anchor}")
    return wrong


def test_github_anchors_follow_githubs_rules():
    assert github_anchor("Exit codes: what they mean, what to do") == "exit-codes-what-they-mean-what-to-do"
    assert github_anchor("The compilers: `make compilers`") == "the-compilers-make-compilers"
    assert github_anchor("TPU torus shapes: the planner's advice") == "tpu-torus-shapes-the-planners-advice"
    assert github_anchor("metrics.jsonl") == "metricsjsonl"
    assert github_anchor("Run directory (run_dir)") == "run-directory-run_dir"


@pytest.mark.parametrize("doc", doc_files())
def test_every_relative_link_resolves(doc):
    """A link into the repository names a file that exists, and a `#anchor` one of its headings."""
    assert not broken_links(doc), broken_links(doc)


def test_the_docs_link_each_other():
    """The link check reads links at all: the README links into docs/, and every page of docs/
    is linked from the README."""
    linked = {os.path.normpath(t.partition("#")[0]) for t in relative_links("README.md")}
    pages = {p for p in doc_files() if p.startswith("docs/")}
    assert pages - linked == set(), f"README.md links no page {sorted(pages - linked)}"
