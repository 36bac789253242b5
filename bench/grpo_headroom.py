"""What reinforcement learning can find in a checkpoint's own samples: greedy exact match beside pass@k.

    python -m bench.grpo_headroom --run-dir RUN --prompts FILE.jsonl [--n 256] [--k 64]
                                  [--temperature 1.0] [--max-new-tokens 4] [--seed 1]

For the first `--n` rows `{"prompt", "answer"}` of FILE (the toy task's held-out split,
prepared/addition/heldout.jsonl), the run's newest checkpoint completes each prompt greedily and
`--k` times at `--temperature` (the KV-cached decoder GRPO's rollouts use, on one CPU device),
each completion cut at its end token and scored by `exact_match` (trainer/rewards.py). Prints a
markdown table: the greedy accuracy, the mean reward of the samples, pass@k (the share of prompts
with at least one right answer among their first k samples) for k = 1, 2, 4, ... `--k`, the
prompts greedy gets wrong that a sample gets right, and, where the answers are integers, the
place of the lowest wrong digit of each wrong greedy answer. GRPO learns only from groups with
spread: pass@group_size bounds what a step can see, and the gap between greedy and pass@k is the
room it has.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from typing import Any

import numpy as np

PLACES = ("ones", "tens", "hundreds", "thousands")


def _prompts(path: str, n: int, tokenizer: Any) -> tuple[list[dict], np.ndarray, np.ndarray]:
    """(the first n rows, their prompts left-padded with the end token int32 [n, L], the padding [n])."""
    with open(path) as f:
        rows = [json.loads(line) for line, _ in zip(f, range(n))]
    encoded = [[int(t) for t in tokenizer.encode(r["prompt"])] for r in rows]
    width = max(map(len, encoded))
    pad = [width - len(e) for e in encoded]
    prompts = [[tokenizer.eod_id] * p + e for p, e in zip(pad, encoded)]
    return rows, np.array(prompts, np.int32), np.array(pad, np.int32)


def _texts(tokens: np.ndarray, tokenizer: Any) -> list[str]:
    """Completions [rows, T] -> their text, each cut before its first end token."""
    from model.decode import until_end

    return [tokenizer.decode(until_end(row, tokenizer.eod_id)) for row in np.asarray(tokens)]


def _wrong_place(answer: str, got: str) -> str:
    """The place of the lowest digit where an integer answer and a wrong one differ."""
    if not (answer.strip().lstrip("-").isdigit() and got.strip().lstrip("-").isdigit()):
        return "not a number"
    diff, place = abs(int(got) - int(answer)), 0
    while diff % 10 == 0:
        diff, place = diff // 10, place + 1
    return PLACES[place] if place < len(PLACES) else f"10^{place}"


def measure(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The table's rows (what, value) for the run's newest checkpoint."""
    from data.tokenizer import load_tokenizer
    from model.decode import Sampling, generate
    from model.transformer import transformer_from_params
    from trainer.checkpoint import restore_params
    from trainer.rewards import ExactMatch

    cfg, step, params = restore_params(args.run_dir)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    rows, prompts, pad = _prompts(args.prompts, args.n, tokenizer)
    model, reward = transformer_from_params(cfg.model, params), ExactMatch(cfg.rl)

    def scores(texts: list[str], repeats: int) -> np.ndarray:
        return np.array([reward(r["prompt"], t, r) for r, t in zip(rows * repeats, texts)]).reshape(repeats, -1)

    greedy_texts = _texts(generate(model, prompts, args.max_new_tokens, pad=pad), tokenizer)
    sampled = generate(model, np.tile(prompts, (args.k, 1)), args.max_new_tokens, seed=args.seed,
                       sampling=Sampling(args.temperature), pad=np.tile(pad, args.k))
    head = [("checkpoint", f"{args.run_dir} step {step}, {len(rows)} prompts of {args.prompts}")]
    answers = [str(r["answer"]) for r in rows]
    return head + summary(scores(greedy_texts, 1)[0], scores(_texts(sampled, tokenizer), args.k), answers,
                          greedy_texts, args.temperature)


def summary(greedy: np.ndarray, sampled: np.ndarray, answers: list[str], greedy_texts: list[str],
            temperature: float) -> list[tuple[str, str]]:
    """The table's rows from the rewards of the greedy completions [prompts] and of the samples
    [k, prompts] (1 right, 0 wrong), the answers and the greedy completions' text."""
    k_max, n = sampled.shape
    table = [("greedy exact match", f"{greedy.mean():.3f}"),
             (f"mean reward of the samples (temperature {temperature:g})", f"{sampled.mean():.3f}")]
    for name, where in (("right", greedy > 0), ("wrong", greedy == 0)):
        if where.any():  # where the samples' right answers are: GRPO's push up comes from them
            table.append((f"mean reward of the samples on the prompts greedy gets {name}",
                          f"{sampled[:, where].mean():.3f}"))
    k = 1
    while k <= k_max:
        table.append((f"pass@{k}", f"{sampled[:k].max(axis=0).mean():.3f}"))
        k *= 2
    table.append((f"greedy wrong, right in a sample of {k_max}", f"{((greedy == 0) & (sampled.max(0) > 0)).mean():.3f}"))
    places = Counter(_wrong_place(a, t) for a, t, ok in zip(answers, greedy_texts, greedy) if not ok)
    return table + [(f"greedy wrong, lowest wrong digit: {place}", f"{count / n:.3f}")
                    for place, count in places.most_common()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.grpo_headroom", description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--prompts", required=True, help='jsonl rows {"prompt", "answer"}')
    p.add_argument("--n", type=int, default=256, help="prompts, from the file's start")
    p.add_argument("--k", type=int, default=64, help="samples per prompt")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    print("| what | value |\n| --- | --- |")
    for what, value in measure(args):
        print(f"| {what} | {value} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
