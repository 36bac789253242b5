"""docs/design.md stays true to the tree: every package is on it, every citation of it names one
of its sections, and no file cites a design document the repository does not hold."""

from __future__ import annotations

import os
import re
import subprocess

from conftest import ROOT

DESIGN = os.path.join(ROOT, "docs", "design.md")


def _tracked(*patterns: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
    return [os.path.join(ROOT, p) for p in out.stdout.split()]


def _sections() -> set[str]:
    with open(DESIGN) as f:
        return {line.lstrip("#").strip() for line in f if line.startswith("#")}


def test_every_package_is_on_the_design_page() -> None:
    with open(DESIGN) as f:
        text = f.read()
    packages = sorted(d for d in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, d, "__init__.py")))
    assert len(packages) >= 8, packages
    missing = [p for p in packages if f"{p}/" not in text]
    assert not missing, f"docs/design.md does not place {missing}"


def test_citations_of_the_design_page_name_its_sections() -> None:
    sections = _sections()
    cited, wrong = 0, []
    for path in _tracked("*.py", "*.md", "Makefile"):
        with open(path) as f:
            text = f.read()
        if os.path.abspath(path) not in (DESIGN, os.path.abspath(__file__)) and re.search(r"(?<![/\w])DESIGN\.md", text):
            wrong.append(f"{os.path.relpath(path, ROOT)} cites DESIGN.md, which the repository does not hold")
        for name in re.findall(r'docs/design\.md, "([^"]+)"', text):
            cited += 1
            if name not in sections:
                wrong.append(f"{os.path.relpath(path, ROOT)} cites docs/design.md section {name!r}")
    assert cited > 0 and not wrong, wrong
