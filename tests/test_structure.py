"""The structure docs/design.md promises, read from the source: no objective's name compared
outside the objective and corpus-format registries, no function over 6 parameters, no module
importing more than 10 of the project's modules. Each rule lists its exceptions with the reason."""

from __future__ import annotations

import ast
import os
import re

from conftest import ROOT

PACKAGES = ("configs", "model", "data", "sharding", "pipeline", "planner", "ops", "evaluation", "trainer", "bench")
ENTRY_POINTS = ("train", "plan", "hf", "generate", "eval", "sweep")
OBJECTIVES = ("lm", "sft", "dpo", "distill")

# Functions whose parameters stay over 6, and why.
MANY_PARAMETERS: dict[str, str] = {}
# Modules importing more than 10 project modules, and why.
MANY_IMPORTS: dict[str, str] = {}


def _sources() -> dict[str, str]:
    """Dotted module name -> path, for the entry points and every package module (subpackages too)."""
    found = {name: os.path.join(ROOT, f"{name}.py") for name in ENTRY_POINTS}
    for package in PACKAGES:
        for folder, dirs, files in os.walk(os.path.join(ROOT, package)):
            dirs[:] = sorted(d for d in dirs if os.path.isfile(os.path.join(folder, d, "__init__.py")))
            dotted = os.path.relpath(folder, ROOT).replace(os.sep, ".")
            for name in sorted(f for f in files if f.endswith(".py")):
                found[dotted if name == "__init__.py" else f"{dotted}.{name[:-3]}"] = os.path.join(folder, name)
    return found


def test_no_objective_name_is_compared_outside_the_registries() -> None:
    """`x == "dpo"`-style comparisons belong to trainer/objectives/ and data/corpus_format/ only."""
    names = "|".join(OBJECTIVES)
    pattern = re.compile(rf"""(==|!=)\s*["']({names})["']|["']({names})["']\s*(==|!=)""")
    sources = _sources()
    wrong = []
    for module, path in sources.items():
        if "objective" in module or "format" in module:
            continue
        for n, line in enumerate(open(path), 1):
            if pattern.search(line):
                wrong.append(f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()}")
    assert len(sources) > 100 and not wrong, wrong


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg not in ("self", "cls")]
    return len(names) + (a.vararg is not None) + (a.kwarg is not None)


def test_no_function_takes_more_than_six_parameters() -> None:
    wrong, seen = [], 0
    for module, path in _sources().items():
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                seen += 1
                name = f"{module}.{node.name}"
                if _parameters(node) > 6 and name not in MANY_PARAMETERS:
                    wrong.append(f"{name} ({_parameters(node)})")
    assert seen > 500 and not wrong, wrong


def _project_imports(path: str, sources: dict[str, str]) -> set[str]:
    """The project modules a file imports (a `from package import module` counts the module)."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in sources else node.module
                     for a in node.names]
        else:
            continue
        out.update(n for n in names if n.split(".")[0] in PACKAGES + ENTRY_POINTS)
    return out


def test_no_module_imports_more_than_ten_project_modules() -> None:
    sources = _sources()
    counts = {m: len(_project_imports(p, sources) - {m}) for m, p in sources.items() if not m.startswith("bench")}
    wrong = {m: n for m, n in counts.items() if n > 10 and m not in MANY_IMPORTS}
    assert max(counts.values()) >= 8 and not wrong, wrong
