"""A GRPO run on a sharded layout against one device: the same rollouts, rewards and updates.

    python -m bench.grpo_layouts [--out DIR]

A tiny `train.objective=grpo` run on the toy addition task (data/addition.py), 3 steps of 8
prompts x 4 completions, once on one CPU device and once on 8 fake CPU devices as data=2 x
fsdp=2 x tensor=2 (the rollouts decode under the same activation rules as the step). The reward
is exact match plus a little per lower-case letter, so the untrained model's groups have spread.
Prints a markdown table of each logged metric, step by step, both runs side by side.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

# Before anything imports JAX: 8 fake CPU devices.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REWARD = "def letters(prompt, completion, example):\n    return 0.1 * sum('a' <= c <= 'z' for c in completion)\n"
LAYOUTS = {"one device": (["mesh.data=1"], 1), "data=2 x fsdp=2 x tensor=2": (["mesh.data=2", "mesh.fsdp=2",
                                                                            "mesh.tensor=2"], 8)}
KEYS = ("loss", "grad_norm", "reward_mean", "kl", "logp_gap_max")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.grpo_layouts", description=__doc__.split("\n")[0])
    p.add_argument("--out", help="working directory (default: a temporary one, removed)")
    args = p.parse_args(argv)
    root = args.out or tempfile.mkdtemp(prefix="grpo-layouts-")
    sys.path.insert(0, ROOT)
    sys.path.insert(0, root)
    import jax

    import trainer
    from configs import load_config
    from data.addition import addition_rows, write
    from data.prepare import prepare

    write(os.path.join(root, "rl.jsonl"), addition_rows()[:64])
    prepare([os.path.join(root, "rl.jsonl")], os.path.join(root, "rl"), progress=False, objective="rl",
            eval_fraction=0.2, overwrite=True)
    with open(os.path.join(root, "bench_grpo_reward.py"), "w") as f:
        f.write(REWARD)
    common = ["train.objective=grpo", "data.source=prepared", f"data.path={os.path.join(root, 'rl')}",
              "train.steps=3", "train.log_every=1", "optim.warmup_steps=1", "optim.decay_steps=3",
              "checkpoint.every=100", "eval.every=3", "eval.batches=1", "model.num_layers=2", "model.seq_len=16",
              "train.global_batch=8", "rl.group_size=4", "rl.max_new_tokens=4", "rl.kl_coef=0.1",
              "rl.reward=exact_match,bench_grpo_reward:letters"]
    runs = {}
    for name, (mesh, devices) in LAYOUTS.items():
        run_dir = os.path.join(root, f"run-{devices}")
        shutil.rmtree(run_dir, ignore_errors=True)
        cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [f"run.dir={run_dir}", *common, *mesh])
        runs[name] = [r for r in trainer.run(cfg, devices=jax.devices()[:devices]) if "loss" in r]
    print("| step | metric | " + " | ".join(LAYOUTS) + " |\n| --- | --- |" + " --- |" * len(LAYOUTS))
    for i, record in enumerate(runs["one device"]):
        for key in KEYS:
            print(f"| {record['step']} | {key} | " + " | ".join(f"{runs[n][i][key]:.9g}" for n in LAYOUTS) + " |")
    if not args.out:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
