"""Real `train.py` processes, started, watched line by line, signalled and waited for: what the
fault tests and `bench.faults` inject their faults into."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time

from ops.xla_env import FORCE_COUNT, set_cpu_collective_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_env(devices: int) -> dict[str, str]:
    """This process's environment for a child on `devices` fake CPU devices. The caller's other
    XLA flags are kept: under pytest they are the suite's (tests/conftest.py), so a child compiles
    the programs the tests and the other children do, and the shared compilation cache serves them.
    The child's train.py leaves a count it finds in XLA_FLAGS alone, pool size and collective
    flags included, so they are set here (a caller's NPROC wins, as in train.py)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(FORCE_COUNT + "=")]
    env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu",
               XLA_FLAGS=" ".join([*flags, f"{FORCE_COUNT}={devices}"]))
    set_cpu_collective_env(devices, env)
    return env


class Train:
    """`python train.py ARGS` with `devices` fake CPU devices; output collected line by line."""

    def __init__(self, *args: str, devices: int = 8, env: dict[str, str] | None = None):
        env = {**cpu_env(devices), **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "train.py"), *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env,
        )
        self.started = time.monotonic()
        self.lines: list[str] = []
        self.stamps: list[float] = []  # time.monotonic() when each line arrived
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.stamps.append(time.monotonic())  # first: a reader of `lines` then finds its stamp
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 90) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if m := re.search(pattern, line):
                    return m
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.01)
        self.kill()
        raise AssertionError(f"no line matching {pattern!r} within {timeout} s; output:\n{self.output[-3000:]}")

    def seen_at(self, pattern: str) -> float:
        """time.monotonic() of the first line matching `pattern` (one already seen)."""
        for line, stamp in zip(self.lines, self.stamps):
            if re.search(pattern, line):
                return stamp
        raise AssertionError(f"no line matching {pattern!r}; output:\n{self.output[-3000:]}")

    def finish(self, timeout: float = 120) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running after {timeout} s; output:\n{self.output[-3000:]}") from None
        self._reader.join(timeout=5)
        return code

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def two_processes(*args: str, per_process: tuple[list[str], list[str]] = ([], []), heartbeat: int = 20) -> list[Train]:
    """`train.py ARGS` as processes 0 and 1 of one job on 127.0.0.1, 4 fake CPU devices each;
    `per_process` adds each one's own overrides (to make them disagree)."""
    return processes(2, *args, per_process=per_process, heartbeat=heartbeat)


def processes(n: int, *args: str, per_process: tuple[list[str], ...] | None = None, heartbeat: int = 20,
              env: dict[int, dict[str, str]] | None = None, devices: int = 0) -> list[Train]:
    """`train.py ARGS` as processes 0..n-1 of one job on 127.0.0.1, `devices` fake CPU devices each
    (default 8/n); `per_process` adds each one's own overrides, `env` each one's own environment
    variables."""
    port = free_port()
    common = [*args, f"dist.coordinator=127.0.0.1:{port}", f"dist.num_processes={n}",
              f"dist.heartbeat_timeout_s={heartbeat}", "dist.init_timeout_s=60"]
    extra = per_process or tuple([] for _ in range(n))
    return [Train(*common, f"dist.process_id={i}", *extra[i], devices=devices or 8 // n, env=(env or {}).get(i, {}))
            for i in range(n)]


def run(*args: str, devices: int = 8, timeout: float = 120) -> tuple[int, str]:
    t = Train(*args, devices=devices)
    code = t.finish(timeout)
    return code, t.output
