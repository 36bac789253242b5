"""Writes the local lm-evaluation-harness tasks of configs/eval/ from the running Python's own
standard library, text every machine with meshlm has: `python scripts/make_eval_tasks.py`.

- `stdlib_words`: a few words of a docstring, then four choices for the next word: the true one
  and three shuffles of its letters (chance 25%). A model that has learned how English or Python
  spells words picks the true one; a few hundred steps of the tiny model on the default data do.
- `stdlib_docstrings`: the first line of a function's docstring, then four choices for the
  function's name, the true one and three from the same module (chance 25%).
- `stdlib_complete`: the 24 characters of a docstring line before the rest of a word, to be
  completed by generation (the harness's generate_until, stopping at a space): exact match.
- `stdlib_text`: whole docstrings scored as text (the harness's rolling log-likelihood): word and
  byte perplexity, bits per byte.

The output depends only on the Python version's library and the fixed seed; the files are
committed beside the task YAMLs, so the tasks run with no internet.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import random
import re
import sys

MODULES = ("os", "os.path", "shutil", "json", "re", "string", "textwrap", "random", "math", "statistics",
           "itertools", "functools", "collections", "heapq", "bisect", "difflib", "csv", "base64", "glob",
           "fnmatch", "inspect", "tempfile", "zipfile", "tarfile", "gzip", "hashlib", "socket", "subprocess",
           "urllib.parse", "email.utils", "calendar", "datetime", "time", "threading", "queue", "pathlib",
           "copy", "pprint", "operator", "types", "typing", "shlex", "logging", "argparse", "decimal")
WORD = re.compile(r"^[a-z]{5,12}$")


def functions(modules: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """(module, function name, first docstring line) of the public functions with a docstring."""
    found = []
    for name in modules:
        module = importlib.import_module(name)
        for fname, fn in sorted(vars(module).items()):
            if fname.startswith("_") or not inspect.isfunction(fn) or not fn.__doc__:
                continue
            line = fn.__doc__.strip().splitlines()[0].strip()
            if 20 <= len(line) <= 120 and fname not in line:
                found.append((name, fname, line))
    return found


def word_items(docs: list[tuple[str, str, str]], rng: random.Random, limit: int) -> list[dict]:
    """The next-word task: the words before a lowercase word of 5-12 letters, that word and
    three distinct shuffles of it."""
    items = []
    for _, _, line in docs:
        words = line.split()
        spots = [i for i in range(2, len(words)) if WORD.match(words[i])]
        if not spots:
            continue
        i = rng.choice(spots)
        true, wrong = words[i], set()
        for _ in range(50):
            letters = list(true)
            rng.shuffle(letters)
            if (s := "".join(letters)) != true:
                wrong.add(s)
            if len(wrong) == 3:
                break
        if len(wrong) < 3:
            continue
        choices = [true, *sorted(wrong)]
        rng.shuffle(choices)
        items.append({"context": " ".join(words[max(0, i - 4):i]), "choices": choices, "label": choices.index(true)})
    return items[:limit]


def docstring_items(docs: list[tuple[str, str, str]], rng: random.Random, limit: int) -> list[dict]:
    """The which-function task: a docstring line, its function and three others of its module."""
    by_module: dict[str, list[str]] = {}
    for module, fname, _ in docs:
        by_module.setdefault(module, []).append(fname)
    items = []
    for module, fname, line in docs:
        others = sorted(set(by_module[module]) - {fname})
        if len(others) < 3:
            continue
        choices = [fname, *rng.sample(others, 3)]
        rng.shuffle(choices)
        items.append({"docstring": line, "choices": choices, "label": choices.index(fname)})
    rng.shuffle(items)
    return items[:limit]


def complete_items(docs: list[tuple[str, str, str]], rng: random.Random, limit: int) -> list[dict]:
    """The completion task: a word of 6-12 letters cut after its first three, the 24 characters
    up to the cut as the prompt (one length: one decoding program for a byte model)."""
    items = []
    for _, _, line in docs:
        spots = [m for m in re.finditer(r"[a-z]{6,12}", line) if m.start() >= 21 and line[m.start() - 1] == " "]
        if spots:
            m = rng.choice(spots)
            cut = m.start() + 3
            items.append({"context": line[cut - 24:cut], "target": line[cut:m.end()]})
    return items[:limit]


def text_items(modules: tuple[str, ...], limit: int) -> list[dict]:
    """The perplexity task: whole function docstrings of 200-1,000 characters, cleaned of their
    indentation."""
    items = []
    for name in modules:
        for fname, fn in sorted(vars(importlib.import_module(name)).items()):
            doc = inspect.getdoc(fn) if inspect.isfunction(fn) and not fname.startswith("_") else None
            if doc and 200 <= len(doc) <= 1000:
                items.append({"text": doc})
    return items[:limit]


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/make_eval_tasks.py", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "configs", "eval"))
    parser.add_argument("--limit", type=int, default=200, help="examples per task")
    args = parser.parse_args(argv)
    docs = functions(MODULES)
    write_jsonl(os.path.join(args.out, "stdlib_words.jsonl"), word_items(docs, random.Random(0), args.limit))
    write_jsonl(os.path.join(args.out, "stdlib_docstrings.jsonl"), docstring_items(docs, random.Random(1), args.limit))
    write_jsonl(os.path.join(args.out, "stdlib_text.jsonl"), text_items(MODULES, args.limit // 4))
    write_jsonl(os.path.join(args.out, "stdlib_complete.jsonl"), complete_items(docs, random.Random(2), args.limit // 2))
    print(f"wrote the tasks from {len(docs)} functions of Python {sys.version.split()[0]} into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
