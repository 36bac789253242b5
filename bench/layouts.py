"""Compile the train step for several layouts on N fake CPU devices and print, per layout:
compile time, per-device memory from `memory_analysis()`, FLOPs per device from
`cost_analysis()`, and the collective ops in the compiled HLO, by kind.

    python -m bench.layouts --config tiny
    python -m bench.layouts --config llama3-1b --set model.attention=dot_product
    python -m bench.layouts --config tiny --layout "mesh.pipeline=4 mesh.data=2 pipeline.microbatches=8"

Nothing is allocated or trained: the state and the batch are abstract. A pipelined layout
that names no `pipeline.microbatches` gets as many as the per-replica batch allows. XLA's cost analysis
counts the body of a loop (the layer scan, the pipeline ticks) once, not once per trip, so its
FLOPs sit below the model's; the `model GF/dev` column is the formula of model/flops.py for reference.
"""

from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__" and "jax" not in sys.modules:  # fake devices must be set before jax loads
    _n = next((a.split("=")[1] for a in sys.argv if a.startswith("--devices=")), None)
    _n = _n or (sys.argv[sys.argv.index("--devices") + 1] if "--devices" in sys.argv else "8")
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_n}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

DEFAULT_LAYOUTS = [
    "mesh.data=8",
    "mesh.data=1 mesh.fsdp=8",
    "mesh.data=2 mesh.fsdp=2 mesh.tensor=2",
    "mesh.data=1 mesh.fsdp=2 mesh.tensor=4",
    "mesh.pipeline=4 mesh.data=2",
    "mesh.pipeline=2 mesh.data=1 mesh.fsdp=2 mesh.tensor=2",
    "mesh.pipeline=2 mesh.data=4 pipeline.repeats=2",
]


def _gib(n: float) -> str:
    return f"{n / 2**30:.3f}"


def measure(config: str, overrides: list[str]) -> dict:
    import jax

    from configs import load_config
    from model import flops_per_token
    from planner.compiled import collective_counts, compiled_stats
    from trainer import abstract_program
    from trainer.program import fill_microbatches

    cfg = fill_microbatches(load_config(config, overrides), jax.device_count())
    program = abstract_program(cfg)
    compiled, seconds = program.compile()
    stats = compiled_stats(compiled)
    tokens = cfg.train.global_batch * cfg.model.seq_len
    return {
        "compile_s": seconds,
        "args": stats["argument_bytes"],
        "temps": stats["temp_bytes"],
        "xla_flops": stats["xla_flops"],
        "model_flops": flops_per_token(cfg.model) * tokens / jax.device_count(),
        "collectives": collective_counts(compiled.as_text()),
        "bubble": program.spec.layout.bubble if program.spec.layout.pipelined else 0.0,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--layout", action="append", help="space-separated overrides; repeatable")
    parser.add_argument("--set", action="append", default=[], help="an override applied to every layout")
    args = parser.parse_args(argv)

    import jax

    from configs import ConfigError
    from planner.hlo import COLLECTIVES

    short = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS", "all-to-all": "A2A", "collective-permute": "CP"}
    print(f"config {args.config} {' '.join(args.set)} on {jax.device_count()} fake {jax.devices()[0].platform} devices")
    print("| layout | compile s | args GiB/dev | temps GiB/dev | XLA GF/dev | model GF/dev | bubble | "
          + " | ".join(short[k] for k in COLLECTIVES) + " |")
    print("|" + " --- |" * (7 + len(COLLECTIVES)))
    for layout in args.layout or DEFAULT_LAYOUTS:
        try:
            r = measure(args.config, args.set + layout.split())
        except ConfigError as e:
            print(f"| {layout} | not valid: {e} |", flush=True)
            continue
        cols = [f"{r['compile_s']:.1f}", _gib(r["args"]), _gib(r["temps"]), f"{r['xla_flops'] / 1e9:.2f}",
                f"{r['model_flops'] / 1e9:.2f}", f"{r['bubble']:.3f}"]
        cols += [str(r["collectives"][k]) for k in COLLECTIVES]
        print(f"| {layout} | " + " | ".join(cols) + " |", flush=True)


if __name__ == "__main__":
    main()
