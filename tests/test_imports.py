"""The import graph: dependencies point one way
(docs/design.md, "Packages and the one import direction"), and no modules import each other in a
circle. Every import statement counts, those inside functions too, so an entry point cannot hide
in a package behind a deferred import."""

from __future__ import annotations

import ast
import os

from conftest import ROOT

# What each package may import (besides the standard library and third-party packages).
ALLOWED = {
    "storage": {"storage"},
    "configs": {"storage", "configs"},
    "model": {"storage", "configs", "model"},
    "data": {"storage", "configs", "data"},
    "sharding": {"storage", "configs", "model", "sharding"},
    "pipeline": {"storage", "configs", "model", "sharding", "pipeline"},
    "planner": {"storage", "configs", "model", "sharding", "pipeline", "planner"},
    "ops": {"storage", "configs", "sharding", "ops"},
    "evaluation": {"storage", "configs", "model", "data", "ops", "evaluation"},
    "trainer": {"storage", "configs", "model", "data", "sharding", "pipeline", "ops", "evaluation", "trainer"},
    "bench": {"storage", "configs", "model", "data", "sharding", "pipeline", "planner", "ops", "evaluation", "trainer",
              "bench"},
}
ENTRY_POINTS = ("train.py", "plan.py", "hf.py", "generate.py", "eval.py", "sweep.py")


def _modules() -> dict[str, str]:
    """Dotted module name -> file, for every package module and entry point (subpackages too,
    such as data/corpus_format/, so their imports are judged like any other)."""
    found = {name.removesuffix(".py"): os.path.join(ROOT, name) for name in ENTRY_POINTS}
    for package in ALLOWED:
        for folder, subdirs, names in os.walk(os.path.join(ROOT, package)):
            subdirs[:] = sorted(d for d in subdirs if os.path.isfile(os.path.join(folder, d, "__init__.py")))
            dotted = os.path.relpath(folder, ROOT).replace(os.sep, ".")
            for name in sorted(n for n in names if n.endswith(".py")):
                module = dotted if name == "__init__.py" else f"{dotted}.{name.removesuffix('.py')}"
                found[module] = os.path.join(folder, name)
    return found


def _imports(path: str, modules: dict[str, str]) -> set[str]:
    """The project modules a file imports, anywhere in it (a package counts as its __init__)."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # `from pkg import mod` imports the module; `from pkg import name`, the package.
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                     for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def test_no_package_imports_upward() -> None:
    modules = _modules()
    wrong = []
    for module, path in modules.items():
        package = module.split(".")[0]
        for target in _imports(path, modules):
            if package in ALLOWED and target.split(".")[0] not in ALLOWED[package]:
                wrong.append(f"{module} imports {target}")
    assert len(modules) > 40 and not wrong, wrong


def test_no_import_cycle() -> None:
    modules = _modules()
    graph = {m: _imports(p, modules) - {m} for m, p in modules.items()}
    assert sum(len(t) for t in graph.values()) > 100, "the parser found too few imports to judge"
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


ENV_PROBE = """
import os, sys
before = dict(os.environ)
import storage, configs, model, data, sharding, planner, trainer, bench.step  # noqa: F401, E401
changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
print(changed)
"""


def test_importing_a_package_changes_no_environment_variable() -> None:
    """Flags are the entry points' to set (train.py, plan.py, bench): a library import that wrote
    XLA_FLAGS would change every program of the process that imports it."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # this process's flags came from conftest
    done = subprocess.run([sys.executable, "-c", ENV_PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout
