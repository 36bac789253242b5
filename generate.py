"""Sample text from a run's checkpoint: `python generate.py --run-dir RUN --prompt TEXT`.

    python generate.py --run-dir RUN --prompt TEXT [--max-new-tokens N] [--temperature T]
                       [--top-k K] [--seed S] [--step N]

Reads the run's `config.yaml` and only the parameters of its newest (or `--step`) checkpoint,
onto one local device, whatever mesh the checkpoint was saved from. Temperature 0 is greedy
decoding. The text goes through the run's own tokenizer (`data.tokenizer`; the byte tokenizer by
default) and decoding uses the key/value cache of model/decode.py. An entry point above the
packages, like train.py: it is the one place that joins a checkpoint, a tokenizer and the model.
"""

from __future__ import annotations

from configs import handle_interrupts

# What a signal before the command finishes leaves.
KEPT = "nothing was written"

if __name__ == "__main__":  # before the imports below (pydantic, JAX): a signal while they load gets the line too
    handle_interrupts(KEPT)

import argparse
import sys

from configs import ConfigError, guarded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python generate.py", description="Sample from a run's checkpoint.")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step", type=int, help="the checkpoint step (default: the newest)")
    args = parser.parse_args(argv)
    # After the arguments (and the signal handler): importing JAX and the model takes seconds.
    import numpy as np

    from data.tokenizer import load_tokenizer
    from model.decode import Sampling, generate, until_end
    from model.transformer import transformer_from_params
    from ops.xla_env import set_default_flags
    from trainer.checkpoint import restore_params

    set_default_flags()
    try:
        if args.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens: must be >= 1, got {args.max_new_tokens}")
        if args.temperature < 0 or args.top_k < 0:
            raise ConfigError("--temperature and --top-k: must be >= 0")
        cfg, step, params = restore_params(args.run_dir, args.step)
        tokenizer = load_tokenizer(cfg.data.tokenizer)
        prompt = np.asarray(tokenizer.encode(args.prompt), np.int32)[None]
        if prompt.shape[1] == 0:
            raise ConfigError("--prompt: must not be empty")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if prompt.shape[1] + args.max_new_tokens > cfg.model.seq_len:
        # Positions past the trained length were never seen in training: the text goes on, its quality may not.
        print(f"warning: the prompt ({prompt.shape[1]} tokens) and --max-new-tokens {args.max_new_tokens} reach "
              f"past the length the model was trained on (model.seq_len={cfg.model.seq_len})", file=sys.stderr)
    model = transformer_from_params(cfg.model, params)
    new = generate(model, prompt, args.max_new_tokens, sampling=Sampling(args.temperature, args.top_k), seed=args.seed)
    print(args.prompt + tokenizer.decode(until_end(np.asarray(new)[0], tokenizer.eod_id)))
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main, KEPT))
