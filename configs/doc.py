"""Every config key with its type, default and docstring, generated from configs/schema.py.

`python train.py --help-config` prints `text()`; docs/config.md is `markdown()`, written by
`python -m configs.doc > docs/config.md` (tests/test_config.py checks the file is fresh). Both
read only the schema's declarations, so they cannot drift from what the loader accepts.
"""

from __future__ import annotations

import inspect
import itertools
import sys
from typing import Any

from configs.fields import Key, describe, keys, resume_of
from configs.schema import Config

REGENERATE = "python -m configs.doc > docs/config.md"
FIXED = "(fixed on resume)"  # follows the docstring of a key marked `Resume`


def show(value: Any) -> str:
    """A default as it is written on the command line or in YAML."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, str):
        return value or '""'
    if isinstance(value, list):
        return "[" + ", ".join(show(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {show(v)}" for k, v in value.items()) + "}"
    return str(value)


def _sections() -> list[tuple[str, str, list[Key]]]:
    """(dotted prefix, the section's docstring, its keys) in schema order."""
    out = []
    for section, group in itertools.groupby(keys(Config).values(), key=lambda k: k.section):
        group = list(group)
        prefix = group[0].name.rsplit(".", 1)[0]
        out.append((prefix, inspect.cleandoc(section.__doc__ or "").replace("\n", " "), group))
    return out


def meaning(key: Key) -> str:
    """The key's docstring, and FIXED if a resumed run must keep it."""
    return f"{key.doc} {FIXED}" if resume_of(key.annotation) else key.doc


def text() -> str:
    """The --help-config listing: per section, each key with its type and default, then its docstring."""
    lines = ["Config keys, set as key=value after `python train.py [--config FILE]` or as YAML sections.",
             f"The same list is docs/config.md ({REGENERATE}).",
             f"A key marked {FIXED} must keep the value of the run whose checkpoints run.dir holds.", ""]
    for prefix, doc, group in _sections():
        lines.append(f"{prefix}: {doc}")
        for key in group:
            lines.append(f"  {key.name}: {describe(key.annotation)} = {show(key.default)}")
            lines.append(f"      {meaning(key)}")
        lines.append("")
    return "\n".join(lines)


def _cell(value: str) -> str:
    return value.replace("|", "\\|")


def markdown() -> str:
    """docs/config.md: one table per section."""
    lines = ["# Config keys", "",
             f"Generated from `configs/schema.py` by `{REGENERATE}`: edit the schema, not this file.",
             "Set a key as `key=value` after `python train.py [--config FILE]`, or as a YAML section of a",
             "preset. `python train.py --help-config` prints the same list. A key marked",
             f"{FIXED} must keep the value of the run whose checkpoints `run.dir` holds: it fixes the shapes of",
             "the state, or which example comes at which step ([resume](checkpoints-and-faults.md#resume)).", ""]
    for prefix, doc, group in _sections():
        lines += [f"## `{prefix}`", "", doc, "", "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        for key in group:
            cells = (f"`{key.name}`", _cell(describe(key.annotation)), f"`{show(key.default)}`", _cell(meaning(key)))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(markdown())
