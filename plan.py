"""Plan before you launch: compile the real train step for N devices you do not have, with
their own compiler, and read per-device memory, FLOPs, collective traffic against its minimum,
step time and MFU from the compiled program.

    python plan.py --config configs/llama3-8b.yaml --devices 64 --hardware h100 mesh.fsdp=64
    python plan.py --config configs/llama3-8b.yaml --devices 64 --hardware tpu-v5p mesh.fsdp=64
    python plan.py --config configs/llama3-8b.yaml --devices 64 --search --out plan.json
    python plan.py --config tiny --devices 8 --search mesh.pipeline=1 --remat none,full
    python plan.py --config configs/deepseek-v3.yaml --devices 256 --search --top 3 mesh.nodes=32 mesh.across=expert

The compile runs in a child process. For a GPU (h100, h200, a100) it is XLA's GPU compiler, fed
the GPU's target description (planner/gpu_specs/), in nodes of 8; for a TPU (tpu-v5e, tpu-v5p,
tpu-v6e) libtpu, for a slice shaped by `--topology` or the most cubic/square one of N chips
(planner/targets.py). Only when that compiler is not installed does the child compile for N
fake CPU devices instead, and the plan then says so on its first line: the CPU compiler makes a
different program (it gathers in float32, has no reduce-scatter), so no figure of it is a
GPU/TPU figure. Every plan names its compiler. While the child compiles, stderr names each
compile (`compiling llama3-8b for v5p 4x4x4 (fsdp=64, remat full)`) and its elapsed time every
15 s; the FALLBACK line comes before the compile.

Memory is `memory_analysis()` of the compile (a TPU compile that does not fit is refused by the
compiler itself); parameters and optimizer state are the shard sizes the rules give;
collectives are parsed from the compiled HLO (planner/hlo.py) and set beside the layout's
minimum (planner/minimum.py); the step time is a roofline over the compiled kernels
(planner/roofline.py) plus the collectives not overlapped (sharding/hardware.py).

`--search` tries every factorization of N over pipeline x data x fsdp x tensor, and for a
mixture of experts x expert (the sizes that divide the expert count; axes named on the command
line stay as given), each pipeline schedule on a pipelined mesh (unless
`pipeline.schedule` is given) and each remat policy of `--remat`, skips layouts the layout
checks reject (with the reason) and, per mesh and schedule, policies that recompute more than one
that already fits (they can only be slower); it ranks what fits by predicted step time (a
pipelined plan prints its schedule's bubble with the formula; the compiled compute already
holds it, as every stage computes on every tick). With `--top K` it compiles only the K layouts
an analytic estimate ranks best (planner/rank.py: a memory floor from the exact state sizes, a
step time from the FLOPs and the layout's least traffic), for models whose every compile takes
minutes; the others are listed with their analytic rank, not compiled.

Exit status: 0 fits (search: something fits); 1 does not fit; 2 bad input (one line, before
any compile). An entry point above the trainer, like train.py; the HLO, roofline and hardware
arithmetic it reads the compile with live in planner/.
"""

from __future__ import annotations

from configs import handle_interrupts

# What a signal before the command finishes leaves.
KEPT = "the compile was stopped and nothing was written"

if __name__ == "__main__":  # before the imports below (pydantic, JAX): a signal while they load gets the line too
    handle_interrupts(KEPT)

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from typing import TYPE_CHECKING, Any

import storage
from configs import Config, ConfigError, check_output, guarded, load_config, on_interrupt
from configs.schema import MESH_AXES, REMAT_POLICIES

if TYPE_CHECKING:  # the real imports are in the functions: JAX, the planner and the trainer take seconds to
    # import, which `--help`, a bad argument or a Ctrl-C meanwhile should not wait for
    from sharding.hardware import Hardware

DEFAULT_REMATS = ("none", "save_dots", "full")  # in order of growing recompute


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="a YAML preset (a path, or a name in configs/)")
    parser.add_argument("--devices", type=int, help="how many devices to plan for")
    parser.add_argument("--hardware", default="h100", metavar="NAME",
                        help="what to plan for: a name in sharding/hardware.py's table (default: h100)")
    parser.add_argument("--dump-hlo", default="",
                        help="write each compiled program's HLO text into this folder (or gs:// s3:// prefix)")
    parser.add_argument("--topology", default="", help="TPU slice shape, e.g. 4x4x4 (default: from --devices)")
    parser.add_argument("--search", action="store_true", help="try every valid layout and remat policy")
    parser.add_argument("--remat", default=",".join(DEFAULT_REMATS), help="policies --search tries, in order")
    parser.add_argument("--top", type=int, default=0,
                        help="--search: compile only the K layouts the analytic estimate ranks best (0: all)")
    parser.add_argument("--out", help="write the plan as JSON here (--search: plan.json by default)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # internal: the compiling process
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return parser.parse_args(argv)


def check(config: str | None, overrides: list[str], n: int) -> Config:
    """The config for this candidate, after every layout check that needs no devices."""
    from trainer import fill_microbatches, prepare

    cfg = fill_microbatches(load_config(config, overrides), n)
    prepare(cfg, n, with_data=False)
    return cfg


def state_bytes(cfg: Config, n: int) -> dict[str, int]:
    """Per-device bytes of parameters (an objective's frozen weights with them) and optimizer state
    (the step counter included), and the sequences a step trains, from the shardings the rules give on an abstract mesh of n devices:
    exact, nothing compiled."""
    import jax
    from jax.sharding import AbstractMesh

    from planner import minimum_traffic
    from trainer import abstract_state, prepare, sharded_optimizer

    spec = prepare(cfg, n, with_data=False)
    mesh = AbstractMesh(tuple(spec.layout.sizes[a] for a in MESH_AXES), MESH_AXES)
    tx, _, sh = sharded_optimizer(spec, mesh)
    state = abstract_state(tx, spec.model.shapes, sh, None if spec.frozen is None else spec.frozen.shapes)

    def per_device(tree: Any) -> int:
        return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))

    return {
        "params": per_device(state.params) + per_device(state.ref_params),  # the frozen weights too (DPO, distill)
        "optimizer": per_device(state.opt_state) + per_device(state.step),
        "minimum": minimum_traffic(cfg, spec.layout.sizes, spec.model.shapes, spec.model.axes),
        # the sequences a step trains, as its objective counts them (DPO: two a pair)
        "sequences": cfg.train.global_batch * spec.objective.rows_per_example,
    }


def measure(cfg: Config, hw: Hardware, target: Hardware | None, n: int, topology: str, dump: str = "") -> dict[str, Any]:
    """Compile `cfg` for n devices of `target` (None: this process's fake CPU devices, the
    fallback); what the compile says, per device."""
    import jax

    from model import attn_kernels
    from planner import collectives, compiled_stats, compute_seconds, kernels
    from planner.targets import compiler_name, node_of, target_devices
    from sharding.hardware import kernel_seconds
    from trainer import abstract_program, attention_notes

    notes = []
    stand_in = attn_kernels.get(cfg.model.attention).planned_as(None if target is None else target.platform)
    if stand_in is not None:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention=stand_in[0]))
        notes.append(stand_in[1])
    if cfg.model.moe.grouped_matmul == "megablox" and (target is None or target.platform != "tpu"):
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(
            cfg.model, moe=dataclasses.replace(cfg.model.moe, grouped_matmul="ragged_dot")))
        notes.append("model.moe.grouped_matmul=megablox is a TPU kernel: planned with ragged_dot")
    if target is not None and target.platform == "cuda":
        notes += attention_notes(cfg)
    if target is None and cfg.mesh.nodes > 1:
        cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, nodes=1))
        notes.append("mesh.nodes: fake CPU devices sit in one process, so the fallback lays them out as one node")
    slices = cfg.mesh.nodes if target is not None and target.platform == "tpu" else 1
    devices = jax.devices() if target is None else target_devices(target, n, slices=slices, topology=topology)
    program = abstract_program(cfg, devices)
    try:
        compiled, seconds = program.compile()
    except Exception as e:  # libtpu checks memory itself: "RESOURCE_EXHAUSTED ... exceeds available HBM"
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        lines = [line.strip() for line in str(e).splitlines() if "RESOURCE_EXHAUSTED" in line or "exceeds" in line]
        return {"out_of_memory": " ".join(lines)[:300]}
    side = program.compile_side()  # the objective's own program besides the step (GRPO's rollout decoding)
    text = compiled.as_text()
    if dump:  # a local folder or a bucket prefix: one file (object) per compile
        storage.makedirs(dump)
        layout = "_".join(f"{a}{s}" for a, s in program.spec.layout.sizes.items() if s > 1) or "1"
        storage.write_text(storage.join(dump, f"{hw.name}_{n}_{layout}_{cfg.model.remat}.hlo"), text)
    nodes = node_of(list(program.mesh.devices.flat), target, hw.devices_per_node or n)
    ops, unknown = collectives(text, program.spec.layout.sizes, nodes)
    if unknown:
        notes.append(f"{unknown} loop(s) of unknown trip count: their collectives and kernels are counted once")
    batch = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(program.abstract_batch())) // n
    roofline = compute_seconds(kernels(text), lambda f, b, prec: kernel_seconds(f, b, hw, prec))
    if roofline["unknown_flops"]:
        names = roofline["unknown_flops"]
        notes.append(f"{len(names)} Pallas kernel(s) of unknown FLOPs ({', '.join(names[:3])}"
                     f"{', ...' if len(names) > 3 else ''}): charged their operand and result bytes, 0 FLOPs")
    ragged = [c for c in ops if c.kind == "ragged-all-to-all"]
    if ragged:
        notes.append(f"ragged-all-to-all: charged its bound, the output buffers ({sum(c.bytes * c.count for c in ragged) / 1e9:.2f} "
                     f"GB a step); balanced routing would send {sum(c.balanced * c.count for c in ragged) / 1e9:.2f} GB")
    if cfg.model.quant != "none":
        low = roofline[f"{cfg.model.quant}_flops"] / max(roofline["flops"], 1.0)
        notes.append(f"model.quant={cfg.model.quant}: {low:.0%} of the compiled FLOPs are {cfg.model.quant} matmuls, "
                     f"timed at {hw.peak_for(cfg.model.quant) / 1e12:,.0f} TFLOP/s; MFU stays against the bf16 peak")
    return {
        **compiled_stats(compiled),
        "compiler": compiler_name(target),
        "compile_s": seconds,
        "batch_bytes": batch,
        "collectives": [{**dataclasses.asdict(c), "wire_bytes": c.wire_bytes} for c in ops],
        "roofline": roofline,
        "bubble": program.spec.layout.bubble if program.spec.layout.pipelined else 0.0,
        "side_program": None if side is None else compiled_stats(side),
        "notes": notes,
    }


@dataclasses.dataclass(frozen=True)
class Child:
    """What the compiling child process compiles for, the same for every job of one plan."""

    config: str | None  # the preset (--config; None: the built-in default run)
    devices: int  # how many devices it compiles for (--devices)
    hw: Hardware  # the hardware the plan is for (--hardware)
    target: Hardware | None  # whose compiler runs (None: `devices` fake CPU devices)
    topology: str  # --topology
    dump: str = ""  # the folder the HLO is dumped to ("": none)


def run_child(child_spec: Child, jobs: list[list[str]]) -> list[dict]:
    """Measures each job in one child process that compiles for `child_spec.devices` devices of
    its `target` (None: that many fake CPU devices)."""
    from ops.xla_env import set_cpu_collective_env
    from planner import wait_with_progress
    from planner.targets import child_env

    config, n, hw, target = child_spec.config, child_spec.devices, child_spec.hw, child_spec.target
    with tempfile.TemporaryDirectory() as tmp:
        spec = os.path.join(tmp, "spec.json")
        with open(spec, "w") as f:
            json.dump({"config": config, "jobs": jobs, "hardware": hw.name, "target": target is not None,
                       "devices": n, "topology": child_spec.topology, "dump": child_spec.dump}, f)
        env = child_env(target, dict(os.environ))
        if target is None:  # the program train.py runs on n CPU devices
            env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
            set_cpu_collective_env(n, env)
        here = os.path.abspath(__file__)
        with open(os.path.join(tmp, "stderr"), "w+") as err:
            child = subprocess.Popen([sys.executable, here, "--child", spec], env=env, cwd=os.path.dirname(here),
                                     stdout=subprocess.DEVNULL, stderr=err, text=True)
            def stop() -> None:  # Ctrl-C (configs.interrupt): the compile must not run on, orphaned
                child.kill()
                shutil.rmtree(tmp, ignore_errors=True)  # the handler's os._exit skips the context's removal

            try:
                with on_interrupt(stop):
                    code = wait_with_progress(child, spec + ".progress")
            except BaseException:
                child.kill()
                child.wait()
                raise
            if code:
                err.seek(0)
                raise RuntimeError(f"the compiling process failed ({code}):\n{err.read()[-4000:]}")
        with open(spec + ".out") as f:
            return json.load(f)


def compiling_label(config: str | None, cfg: Config, hw: Hardware, target: Hardware | None, n: int,
                    topology: str) -> str:
    """What a compile is for, in the words of the command line: `compiling llama3-8b for v5p
    4x4x4 (fsdp=64)`."""
    from planner.targets import tpu_slice_shape
    from sharding import resolve_mesh_shape

    name = os.path.basename(config).removesuffix(".yaml") if config else "the default config"
    if target is None:
        where = f"{n} fake CPU devices"
    elif target.platform == "tpu":
        slices = cfg.mesh.nodes
        where = f"{target.spec} {topology or tpu_slice_shape(target, n // slices)}"
        where = f"{slices} slices of {where}" if slices > 1 else where
    else:
        where = f"{n} x {target.name}"
    sizes = resolve_mesh_shape(cfg.mesh, n)
    layout = [f"{a}={s}" for a, s in sizes.items() if s > 1] or ["one device"]
    if sizes["pipeline"] > 1:
        layout.append(f"schedule {cfg.pipeline.schedule}")
    return f"compiling {name} for {where} ({', '.join(layout)}, remat {cfg.model.remat})"


def child_main(spec_path: str) -> None:
    from sharding.hardware import HARDWARE
    from trainer import fill_microbatches

    with open(spec_path) as f:
        spec = json.load(f)
    hw, n = HARDWARE[spec["hardware"]], spec["devices"]
    results, target = [], hw if spec["target"] else None
    for i, overrides in enumerate(spec["jobs"]):
        try:
            cfg = fill_microbatches(load_config(spec["config"], overrides), n)
            label = compiling_label(spec["config"], cfg, hw, target, n, spec["topology"])
            count = f" [{i + 1}/{len(spec['jobs'])}]" if len(spec["jobs"]) > 1 else ""
            with open(spec_path + ".progress.tmp", "w") as f:
                f.write(label + count)
            os.replace(spec_path + ".progress.tmp", spec_path + ".progress")  # the parent never reads half a line
            results.append(measure(cfg, hw, target, n, spec["topology"], spec["dump"]))
        except Exception as e:  # one layout XLA cannot compile must not sink the others
            results.append({"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"})
    with open(spec_path + ".out", "w") as f:
        json.dump(results, f)


def main(argv: list[str] | None = None, on_cpu: bool = False) -> int:
    """plan.py's command line; `on_cpu`: this process needs no accelerator (its child, the compiler
    of N devices, is given its own)."""
    args = parse_args(argv)
    import jax

    if on_cpu:
        jax.config.update("jax_platforms", "cpu")
    from ops.xla_env import set_default_flags
    from planner import Heartbeat, candidates, evaluate, print_plan, print_search
    from planner.targets import compiler_name, has_compiler
    from sharding.hardware import HARDWARE, check_quant

    set_default_flags()
    if args.child:
        child_main(args.child)
        return 0
    try:
        if args.hardware not in HARDWARE:
            raise ConfigError(f"--hardware: {args.hardware!r} is not one of {', '.join(sorted(HARDWARE))}")
        hw = HARDWARE[args.hardware]
        if args.devices is None or args.devices <= 0:
            raise ConfigError(f"--devices: a positive device count is required, got {args.devices}")
        check_output(args.out or "", "--out", file=True)  # a local file, or a bucket that answers
        check_output(args.dump_hlo, "--dump-hlo")  # a local folder, or a bucket that answers
        remats = [r.strip() for r in args.remat.split(",") if r.strip()]
        for r in remats:
            if r not in REMAT_POLICIES:
                raise ConfigError(f"--remat: {r!r} is not one of {', '.join(REMAT_POLICIES)}")
        base = load_config(args.config, args.overrides)  # a bad key fails here, whatever the layout
        why = check_quant(base.model.quant, hw)
        if why:
            raise ConfigError(f"model.quant: {why}")
        rows = []
        if args.top < 0 or args.top and not args.search:
            raise ConfigError(f"--top: a number of layouts to compile with --search, got {args.top}")
        tried = candidates(args.overrides, args.devices, args.search, remats, base.model.moe.num_experts)
        beat = Heartbeat("checking the layouts", len(tried))
        for overrides in tried:
            beat.tick()
            try:
                cfg = check(args.config, overrides, args.devices)
                rows.append({"overrides": overrides, "cfg": cfg, "status": "pending"})
            except ConfigError as e:
                if not args.search:
                    raise
                rows.append({"overrides": overrides, "cfg": None, "status": "invalid", "reason": str(e)})
        if not any(r["cfg"] for r in rows):
            raise ConfigError(f"--devices={args.devices}: no valid layout ({rows[0]['reason']})")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    target = hw if has_compiler(hw) else None
    if target is None:
        # Said before the compile (minutes, at scale), so a user can stop and install the compiler.
        print(f"FALLBACK: {hw.name}'s compiler is not installed (make compilers installs it); compiling "
              f"for {args.devices} fake CPU devices: memory, traffic and time below are CPU figures, not {hw.name}'s",
              flush=True)
    child_spec = Child(args.config, args.devices, hw, target, args.topology,
                       storage.absolute(args.dump_hlo) if args.dump_hlo else "")
    measure_jobs = lambda jobs: run_child(child_spec, jobs)  # noqa: E731
    sizing = Heartbeat("sizing the parameters and optimizer state", sum(r["cfg"] is not None for r in rows))

    def sized(cfg: Config, n: int) -> dict[str, int]:
        sizing.tick()
        return state_bytes(cfg, n)

    plan = evaluate(args, rows, hw, measure_jobs, sized, compiler_name(target))
    (print_search if args.search else print_plan)(plan)
    out = args.out or ("plan.json" if args.search else None)
    if out:
        storage.makedirs(storage.parent(out) or ".")
        storage.write_text(out, json.dumps(plan, indent=1))
        print(f"wrote {out}")
    return 0 if plan["best"] is not None else 1


if __name__ == "__main__":
    sys.exit(guarded(lambda: main(on_cpu=True), KEPT))
