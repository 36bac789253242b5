"""A training run's start, before run.dir is touched: the job's processes, its devices, every check.

`bring_up` sets the CPU device count a mesh asks for (ops.xla_env) and the compile cache, starts
the multi-process job and checks that every process runs the same config and code, then checks
the config against the devices and files (trainer.checks, `trainer.program.prepare`). Bad input
raises ConfigError here, with run.dir as it was; `trainer.loop.run` takes run.dir's lock after.
`log_layout` says what was brought up: the mesh, the parameters, how the step computes.
"""

from __future__ import annotations

import jax

from configs import Config
from model.lora import trainable
from ops.faults import fingerprint
from ops.metrics import log, peak_flops
from ops.xla_env import set_cpu_device_count, use_compile_cache
from sharding import distributed
from trainer.checks import check_devices
from trainer.kernels import attention_notes
from trainer.spec import RunSpec, prepare
from trainer.state import param_count


def bring_up(cfg: Config, devices: list | None) -> tuple[RunSpec, list]:
    """The checked `RunSpec` of `cfg` and the devices it runs on (`devices`, default: all).
    Raises ConfigError for bad input; writes nothing."""
    notices: list[str] = []
    why_not = set_cpu_device_count(cfg, notices=notices) if devices is None else "the caller chose the devices"
    use_compile_cache(cfg.run.compile_cache)
    distributed.initialize(cfg.dist)
    distributed.check_same_everywhere(fingerprint(cfg), cfg.dist.init_timeout_s)
    devices = jax.devices() if devices is None else devices
    check_devices(cfg, devices, why_not)
    spec = prepare(cfg, len(devices))
    for line in notices:  # after the checks: a bad command gets its error line alone
        print(line, flush=True)
    return spec, devices


def log_layout(spec: RunSpec, devices: list) -> None:
    """The mesh, the parameter count and the notes on how the step computes."""
    cfg, layout = spec.cfg, spec.layout
    log(
        f"mesh {' x '.join(f'{a}={s}' for a, s in layout.sizes.items())} on {len(devices)} "
        f"{devices[0].platform} devices, {jax.process_count()} process(es); "
        f"{param_count(spec.model.shapes) / 1e6:.2f}M parameters"
        + (f", {param_count(trainable(spec.model.shapes)) / 1e6:.3f}M of them trained (LoRA adapters; the rest frozen)"
           if cfg.model.lora.enabled else "")
    )
    for note in attention_notes(cfg):
        log(note)
    if cfg.model.quant != "none":
        log(f"model.quant={cfg.model.quant}: the block matmuls run in 8 bits"
            + ("; MFU is against the bf16 peak" if peak_flops(devices[0]) else
               " (emulated on this device)"))
