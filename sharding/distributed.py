"""Several processes: `jax.distributed` start-up, cluster detection, a config fingerprint that
every process must share, and the liveness of peers.

One process per host (or per GPU); XLA collectives between them (gloo on CPU, NCCL on GPU). The
coordination service's key-value store carries the fingerprints and process 0's decisions
(the run.dir lock); its heartbeats tell which processes are alive.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import jax

from configs.schema import ConfigError, DistConfig
from sharding.gloo_lines import drop_gloo_lines

_KEY = "meshlm/fingerprint"
_BEATS = "meshlm/beats"
_STOP = "meshlm/stop"  # a stop's line every process prints alike, and each one's acknowledgement
FINISHED = "finished"
# The variables jax.distributed's SLURM detection reads. All are set only inside an `srun` step:
# a batch script's own process lacks SLURM_STEP_NODELIST and is one process whatever --ntasks says.
_SLURM_STEP = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")


def _slurm_tasks(env: Mapping[str, str]) -> int:
    return int(env["SLURM_NTASKS"] or 1) if all(k in env for k in _SLURM_STEP) else 1


def detect_cluster() -> str | None:
    """The launcher that `jax.distributed.initialize()` can read the process layout from."""
    env = os.environ
    if _slurm_tasks(env) > 1:
        return "SLURM"
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return "Open MPI"
    if len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1:
        return "TPU pod"
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return "JAX_COORDINATOR_ADDRESS"
    return None


def process_layout(cfg: DistConfig, env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(processes in the job, this process's index), known before JAX starts: the config's, else
    what `srun` or `mpirun` put in the environment (the same variables `jax.distributed.initialize()`
    reads), else (1, 0). A CPU-only process needs it to ask for its share of the mesh's devices."""
    env = os.environ if env is None else env
    if cfg.num_processes > 0:
        return cfg.num_processes, max(cfg.process_id, 0)
    if _slurm_tasks(env) > 1:
        return _slurm_tasks(env), int(env["SLURM_PROCID"] or 0)
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return int(env["OMPI_COMM_WORLD_SIZE"]), int(env.get("OMPI_COMM_WORLD_RANK", "0") or 0)
    return 1, 0


def initialize(cfg: DistConfig) -> bool:
    """Starts jax.distributed when the config or the environment asks for several processes.
    Returns whether it did. Must run before anything else touches the devices."""
    if _client() is not None:  # already started (a second run in the same process)
        return True
    explicit = bool(cfg.coordinator) or cfg.num_processes > 1
    if not explicit and detect_cluster() is None:
        return False
    if explicit and not (cfg.coordinator and cfg.num_processes > 0 and cfg.process_id >= 0):
        raise ConfigError(
            "dist.coordinator, dist.num_processes and dist.process_id must be set together "
            f"(got {cfg.coordinator!r}, {cfg.num_processes}, {cfg.process_id})"
        )
    drop_gloo_lines()  # XLA:CPU's collectives between processes print a line per device as they connect
    jax.distributed.initialize(
        coordinator_address=cfg.coordinator or None,
        num_processes=cfg.num_processes or None,
        process_id=cfg.process_id if cfg.process_id >= 0 else None,
        initialization_timeout=cfg.init_timeout_s,
        heartbeat_timeout_seconds=cfg.heartbeat_timeout_s,
        # A process leaving with an error must not wait minutes for peers at exit.
        shutdown_timeout_seconds=cfg.heartbeat_timeout_s,
    )
    return True


def _client() -> Any:
    from jax._src import distributed  # the runtime client: key-value store and liveness

    return distributed.global_state.client


def check_same_everywhere(fingerprint: dict[str, Any], timeout_s: int) -> None:
    """Every process publishes its fingerprint (flat key -> value) and compares it with every
    other's. A difference stops all of them with ConfigError naming the keys."""
    if jax.process_count() == 1:
        return
    client, me = _client(), jax.process_index()
    client.key_value_set(f"{_KEY}/{me}", json.dumps(fingerprint, sort_keys=True, default=str))
    problems = []
    for other in range(jax.process_count()):
        if other == me:
            continue
        theirs = json.loads(client.blocking_key_value_get(f"{_KEY}/{other}", timeout_s * 1000))
        for key in sorted(set(fingerprint) | set(theirs)):
            if fingerprint.get(key) != theirs.get(key):
                problems.append(f"{key}: {fingerprint.get(key)!r} here (process {me}), {theirs.get(key)!r} on process {other}")
    if problems:
        raise ConfigError("processes disagree on " + "; ".join(problems))


def share_from_process_0(key: str, value: str, timeout_s: float) -> str:
    """Process 0's `value`, on every process (each key once per job): a decision all processes
    act on alike, taken before they could diverge. Needs no device and compiles nothing."""
    if jax.process_count() == 1:
        return value
    if jax.process_index() == 0:
        _client().key_value_set(key, value)
        return value
    return _client().blocking_key_value_get(key, int(timeout_s * 1000))


def publish_beat(run: int, value: str) -> None:
    """This process's heartbeat for its `run`-th run of the job: a count that grows while it lives,
    or FINISHED once the run has ended. The processes of a job run the same sequence of runs, so
    `run` names the same one on each. A key per run and process, overwritten: one cheap call."""
    if jax.process_count() > 1:
        _client().key_value_set(f"{_BEATS}/{run}/{jax.process_index()}", value, allow_overwrite=True)


def tell_stop(line: str) -> None:
    """Tells every process of the job to stop with `line` (`told_stop`); this one has seen it."""
    _client().key_value_set(_STOP, line, allow_overwrite=True)
    ack_stop()


def told_stop() -> str | None:
    """The line of a stop some process told (`tell_stop`), or None (one non-blocking call)."""
    if jax.process_count() == 1:
        return None
    try:
        return _client().key_value_try_get(_STOP)
    except Exception:  # none told (a missing key raises), or the coordination service is gone
        return None


def ack_stop() -> None:
    _client().key_value_set(f"{_STOP}/ack/{jax.process_index()}", "1", allow_overwrite=True)


def stop_acks() -> int:
    """How many processes have acknowledged the told stop (process 0 exits last: it holds the
    coordination service, whose end would abort the others before they print their line)."""
    return len(_client().key_value_dir_get(f"{_STOP}/ack/"))


def peer_beats(run: int) -> dict[int, str]:
    """The last heartbeat of every process that has published one for `run` (one call however many
    processes). Unlike the coordination service's own liveness query (`get_live_nodes`), which
    waits until every live process asks too, this never blocks: a peer that has ended its run
    and waits in jax.distributed's shutdown barrier asks nothing, and a watchdog waiting on it would
    outlive its own process's exit (the interpreter aborts on the thread blocked in XLA)."""
    if jax.process_count() == 1:
        return {}
    return {int(key.rsplit("/", 1)[1]): value for key, value in _client().key_value_dir_get(f"{_BEATS}/{run}/")}
