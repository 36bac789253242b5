"""From a Hugging Face Llama to an SFT'd and a DPO'd one with the tiny presets, as docs/post-training.md says.

    python -m bench.post_training [--out DIR]

Runs the page's commands as real processes: a random tiny LlamaForCausalLM saved by
`transformers` (the stand-in for a pretrained model), `data.examples`, `data.prepare` for both
objectives, `hf.py import` into configs/sft-tiny.yaml, `train.py`, `hf.py export`, `hf.py import`
of that export into configs/dpo-tiny.yaml, `train.py`. Then reads the runs' metrics and scores
every training pair with the DPO run's final weights against its reference (the SFT export):
the share of pairs whose chosen reward beats the rejected one. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sh(*args: str) -> float:
    """Runs `python ARGS` in the repository root; its wall seconds."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=ROOT, check=True, capture_output=True)
    return time.perf_counter() - t0


def tiny_llama(path: str) -> None:
    """A random Llama of the tiny presets' shape, saved as a Hugging Face directory."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=16, num_key_value_heads=8, head_dim=8,
                                      tie_word_embeddings=True, eos_token_id=256, bos_token_id=None)
    transformers.LlamaForCausalLM(config).save_pretrained(path)


def metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def pair_accuracy(dpo_run: str, sft_run: str, data_dir: str) -> tuple[float, float, int]:
    """(share of training pairs with chosen reward > rejected, mean margin, pairs) of the DPO run's
    newest checkpoint against the SFT run's (its reference), on one device."""
    from data.manifest import read_manifest
    from data.pairs import PairRows
    from trainer.checkpoint import restore_params
    from trainer.compute import Compute
    from trainer.objectives.dpo import make_reference_fn
    from trainer.state import abstract_model

    cfg, _, policy = restore_params(dpo_run)
    _, _, reference = restore_params(sft_run)
    rows = PairRows(data_dir, read_manifest(data_dir)["splits"]["train"]["shards"], 256, cfg.model.seq_len)
    logps = jax.jit(make_reference_fn(abstract_model(cfg.model).graphdef, Compute(), cfg.dpo))
    margins = []
    for start in range(0, len(rows), 64):
        batch = {k: np.stack([rows[i][k] for i in range(start, min(start + 64, len(rows)))]) for k in rows[0]}
        ratios = np.asarray(logps(policy, batch)) - np.asarray(logps(reference, batch))
        margins.append(cfg.dpo.beta * (ratios[:, 0] - ratios[:, 1]))
    margin = np.concatenate(margins)
    return float((margin > 0).mean()), float(margin.mean()), len(margin)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="where everything goes (default: a temporary directory)")
    out = os.path.abspath(parser.parse_args().out or tempfile.mkdtemp(prefix="post_training_"))
    p = lambda *parts: os.path.join(out, *parts)  # noqa: E731
    tiny_llama(p("hf-tiny"))
    sh("-m", "data.examples", "--output", p("examples"))
    sh("-m", "data.prepare", "--input", p("examples", "sft.jsonl"), "--output", p("sft-data"), "--objective", "sft",
       "--eval-fraction", "0.05")
    sh("-m", "data.prepare", "--input", p("examples", "dpo.jsonl"), "--output", p("dpo-data"), "--objective", "dpo")
    sh("hf.py", "import", "--hf-dir", p("hf-tiny"), "--run-dir", p("sft"), "--config", "configs/sft-tiny.yaml",
       f"data.path={p('sft-data')}")
    sft_s = sh("train.py", "--config", p("sft", "config.yaml"))
    sh("hf.py", "export", "--run-dir", p("sft"), "--out", p("sft-export"))
    sh("hf.py", "import", "--hf-dir", p("sft-export"), "--run-dir", p("dpo"), "--config", "configs/dpo-tiny.yaml",
       f"data.path={p('dpo-data')}")
    dpo_s = sh("train.py", "--config", p("dpo", "config.yaml"))
    sft = [r for r in metrics(p("sft")) if "loss" in r]
    evals = [r for r in metrics(p("sft")) if "eval_loss" in r]
    dpo = [r for r in metrics(p("dpo")) if "loss" in r]
    accuracy, margin, pairs = pair_accuracy(p("dpo"), p("sft"), p("dpo-data"))
    print("| run | steps | wall s | first logged | last logged | held-out / all pairs |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(f"| SFT (assistant-token loss) | {sft[-1]['step']} | {sft_s:.0f} | {sft[0]['loss']:.3f} | "
          f"{sft[-1]['loss']:.3f} ({sft[-1]['loss'] / sft[0]['loss']:.2f}x) | eval loss {evals[-1]['eval_loss']:.3f} |")
    print(f"| DPO (loss; reward accuracy) | {dpo[-1]['step']} | {dpo_s:.0f} | {dpo[0]['loss']:.3f}; "
          f"{dpo[0]['reward_accuracy']:.2f} | {dpo[-1]['loss']:.3f}; {dpo[-1]['reward_accuracy']:.2f} | "
          f"accuracy {accuracy:.3f} on all {pairs} training pairs, mean margin {margin:.3f} |")


if __name__ == "__main__":
    main()
