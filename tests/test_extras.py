"""The optional packages' gate: under `make test` a missing extra fails the tests that need it;
a user who runs a file by hand without the extra sees it skipped.

The real tests/test_hf.py is collected in a child pytest whose `torch` is shadowed by a package
that fails to import, once with MESHLM_REQUIRE_EXTRAS=1 and once without.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import REQUIRE_EXTRAS, ROOT


def _pytest_without_torch(tmp_path, require: bool) -> subprocess.CompletedProcess:  # noqa: ANN001 (a Path)
    shadow = tmp_path / "shadow" / "torch"
    shadow.mkdir(parents=True, exist_ok=True)
    (shadow / "__init__.py").write_text('raise ImportError("torch shadowed by the test")\n')
    env = {k: v for k, v in os.environ.items() if k != REQUIRE_EXTRAS}
    env["PYTHONPATH"] = str(shadow.parent)
    if require:
        env[REQUIRE_EXTRAS] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_hf.py"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_make_test_sets_the_variable():
    with open(os.path.join(ROOT, "Makefile")) as f:
        recipe = re.search(r"^test:.*\n((?:\t.*\n)+)", f.read(), re.MULTILINE)
    assert recipe, "the Makefile has no test target"
    pytest_lines = [line for line in recipe.group(1).splitlines() if "-m pytest" in line]
    assert pytest_lines and all(line.startswith(f"\t{REQUIRE_EXTRAS}=1 ") for line in pytest_lines), recipe.group(1)


def test_a_missing_extra_fails_under_make_test(tmp_path):
    run = _pytest_without_torch(tmp_path, require=True)
    out = run.stdout + run.stderr
    assert run.returncode not in (0, 5), out  # 5: nothing collected, as when everything skips
    assert f"torch is missing but {REQUIRE_EXTRAS}=1 (make test installs meshlm[hf])" in out, out
    assert "skipped" not in out, out


def test_a_missing_extra_skips_a_hand_run(tmp_path):
    run = _pytest_without_torch(tmp_path, require=False)
    out = run.stdout + run.stderr
    assert run.returncode in (0, 5) and "ERROR" not in out, out
    assert "1 skipped" in out and "needs torch" in out and "pip install 'meshlm[hf]'" in out, out
