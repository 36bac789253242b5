"""The default run's step against PyTorch eager on the same CPU, in one process, one after the other.

    python -m bench.cpu_peer                   # the default model, 16 x 256 tokens, 2 threads
    python -m bench.cpu_peer --steps 20 model.num_layers=8

Both sides train the same shape (the config's model, batch and sequence) with the same recipe:
AdamW with the config's betas, epsilon and weight decay, global-norm clipping, float32. Ours is
the real compiled train step (`bench.step`, state donated); the peer is Hugging Face
`LlamaForCausalLM` (eager, SDPA attention) with `torch.optim.AdamW` and
`clip_grad_norm_`, on as many threads as the process has cores, in a child process of its own.
Each side reports the median
step time over the timed steps, tokens/s from it, and the process CPU seconds per step (user +
system over the timed steps: what the step costs in core time, which the machine's other load
disturbs less than wall time does). CPU figures only: this says nothing about GPUs or TPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from bench.step import bench
from configs import ConfigError, load_config
from configs.schema import Config


def torch_peer(cfg: Config, steps: int, warmup: int) -> dict:
    """Times Hugging Face Llama of `cfg.model`'s shape under torch eager AdamW + clipping."""
    import torch  # the `hf` extra; imported here so that `--help` and config errors stay fast
    from transformers import LlamaConfig, LlamaForCausalLM

    m, o = cfg.model, cfg.optim
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.d_ff,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
        head_dim=m.resolved_head_dim, max_position_embeddings=m.seq_len, rope_theta=m.rope_theta,
        rms_norm_eps=m.norm_eps, tie_word_embeddings=m.tie_embeddings, attn_implementation="sdpa"))
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.b1, o.b2), eps=o.eps, weight_decay=o.weight_decay)
    shape = (cfg.train.global_batch, m.seq_len + 1)
    tokens = torch.randint(0, m.vocab_size, shape, generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step() -> float:  # the loss, read each step as a training loop would
        logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, m.vocab_size), targets.reshape(-1))
        loss.backward()
        if o.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    for _ in range(warmup):
        step()
    times = []
    cpu0 = time.process_time()
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    cpu = (time.process_time() - cpu0) / steps
    step_s = statistics.median(times)
    return {"tokens_per_s": cfg.train.global_batch * m.seq_len / step_s, "step_ms": 1e3 * step_s,
            "cpu_ms": 1e3 * cpu, "threads": torch.get_num_threads(),
            "params": sum(p.numel() for p in model.parameters())}


def peer_in_child(argv: list[str]) -> dict:
    """`torch_peer` in a fresh process (`--peer-only`), its result read back as JSON."""
    done = subprocess.run([sys.executable, "-m", "bench.cpu_peer", "--peer-only", *argv], capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="a YAML preset (path or name in configs/)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps on each side")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps on each side")
    parser.add_argument("--peer-only", action="store_true", help="time the PyTorch side alone, print its JSON")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    overrides = ["mesh.data=1", *args.overrides]  # one device: the peer runs on one too
    try:
        cfg = load_config(args.config, [*overrides, "data.source=synthetic", "data.packing=concat"])
        if args.peer_only:
            print(json.dumps(torch_peer(cfg, args.steps, args.warmup)))
            return 0
        r = bench(args.config, overrides, args.steps, args.warmup)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    p = peer_in_child([a for a in argv if a != "--peer-only"])
    load = os.getloadavg()[0]
    m = cfg.model
    print(f"CPU only: {os.cpu_count()} cores, load average {load:.1f} at the end; model {m.num_layers} layers, "
          f"d_model {m.d_model}, {m.num_heads}/{m.num_kv_heads} heads, d_ff {m.d_ff}, vocab {m.vocab_size}; "
          f"batch {cfg.train.global_batch} x {m.seq_len}; float32")
    print("| side | parameters | tokens/s | step ms (median) | CPU ms per step |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| meshlm (XLA:CPU, compiled step) | {round(r['params_m'] * 1e6):,} | {r['tokens_per_s']:,.0f} | "
          f"{r['step_ms']:.0f} | {r['cpu_ms']:.0f} |")
    print(f"| PyTorch eager ({p['threads']} threads, HF Llama) | {p['params']:,} | {p['tokens_per_s']:,.0f} | "
          f"{p['step_ms']:.0f} | {p['cpu_ms']:.0f} |")
    print(f"meshlm / PyTorch tokens/s: {r['tokens_per_s'] / p['tokens_per_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
