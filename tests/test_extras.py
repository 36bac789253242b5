"""The optional packages' gate: under `make test` a missing extra fails the tests that need it;
a user who runs a file by hand without the extra sees it skipped.

The real tests/test_hf.py is collected in a child pytest that cannot find `torch` (a plugin puts
a finder first on sys.meta_path that says it is not installed), once with MESHLM_REQUIRE_EXTRAS=1
and once without.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import REQUIRE_EXTRAS, ROOT


def _pytest_without_torch(tmp_path, require: bool) -> subprocess.CompletedProcess:  # noqa: ANN001 (a Path)
    plugins = tmp_path / "plugins"
    plugins.mkdir(exist_ok=True)
    # Not found, as when the extra is not installed (a finder that answers first and raises).
    (plugins / "hide_torch.py").write_text(
        "import sys\n\n\n"
        "class HideTorch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'torch':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r} (hidden by the test)')\n\n\n"
        "sys.meta_path.insert(0, HideTorch())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != REQUIRE_EXTRAS}
    env["PYTHONPATH"] = str(plugins)
    if require:
        env[REQUIRE_EXTRAS] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "hide_torch", "tests/test_hf.py"]
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
