"""Sample text from a run's checkpoint: `python -m model.generate --run-dir RUN --prompt TEXT`.

    python -m model.generate --run-dir RUN --prompt TEXT [--max-new-tokens N] [--temperature T]
                             [--top-k K] [--seed S] [--step N]

Reads the run's `config.yaml` and only the parameters of its newest (or `--step`) checkpoint,
onto one local device, whatever mesh the checkpoint was saved from (Orbax reassembles the
shards). Temperature 0 is greedy decoding. The text goes through the run's own tokenizer
(`data.tokenizer`; the byte tokenizer by default) and decoding uses the key/value cache of
model/decode.py.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from configs import Config, ConfigError, load_config
from model.decode import generate
from model.hf import param_shapes
from model.transformer import Transformer, abstract_transformer


def load_run(run_dir: str, step: int | None = None, device: jax.Device | None = None) -> tuple[Config, int, dict]:
    """(the run's config, the step, its parameters on `device`), restoring nothing but the
    parameters: the optimizer state and data position stay on disk."""
    cfg_path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(cfg_path):
        raise ConfigError(f"--run-dir: no config.yaml in {run_dir}")
    cfg = load_config(cfg_path)
    ckpt_dir = os.path.abspath(os.path.join(run_dir, "checkpoints"))
    steps = sorted(int(s) for s in os.listdir(ckpt_dir) if s.isdigit()) if os.path.isdir(ckpt_dir) else []
    if not steps:
        raise ConfigError(f"--run-dir: no checkpoints in {ckpt_dir}")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise ConfigError(f"--step: no checkpoint for step {step} in {ckpt_dir} (steps: {', '.join(map(str, steps))})")
    placement = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
    shapes = param_shapes(cfg.model)
    target = {"params": jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=placement), shapes)}
    restore_args = jax.tree.map(
        lambda s: ocp.ArrayRestoreArgs(sharding=placement, global_shape=s.shape, dtype=s.dtype), target
    )
    with ocp.CheckpointManager(ckpt_dir, item_names=("state", "data")) as manager:
        state_args = ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True)
        restored = manager.restore(step, args=ocp.args.Composite(state=state_args))
    return cfg, step, restored.state["params"]


def build_model(cfg: Config, params: dict) -> Transformer:
    """The Transformer holding `params` (no random init is materialized)."""
    graphdef, state = nnx.split(abstract_transformer(cfg.model))
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model.generate", description="Sample from a run's checkpoint.")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step", type=int, help="the checkpoint step (default: the newest)")
    args = parser.parse_args(argv)
    try:
        if args.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens: must be >= 1, got {args.max_new_tokens}")
        if args.temperature < 0 or args.top_k < 0:
            raise ConfigError("--temperature and --top-k: must be >= 0")
        cfg, step, params = load_run(args.run_dir, args.step)
        # The CLI needs the run's tokenizer; the decoding itself (model.decode) knows no data.
        from data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(cfg.data.tokenizer)
        prompt = np.asarray(tokenizer.encode(args.prompt), np.int32)[None]
        if prompt.shape[1] == 0:
            raise ConfigError("--prompt: must not be empty")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    model = build_model(cfg, params)
    new = generate(model, prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    tokens = [int(t) for t in np.asarray(new)[0]]
    if tokenizer.eod_id in tokens:  # the end of a document ends the sample
        tokens = tokens[: tokens.index(tokenizer.eod_id)]
    print(args.prompt + tokenizer.decode(tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
