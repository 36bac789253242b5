"""LoRA on multi-head latent attention (DeepSeek-V3): adapters on `o` and, without a query latent,
`q`; keys and values come from a shared latent and are refused.

The base is test_hf_deepseek's random 3-layer DeepSeek-V3 saved by `transformers` (a dense first
layer, then MoE layers); the oracle is `peft` loading our exported adapter onto that model, with
our logits (tolerance as tests/test_hf.py).
"""

from __future__ import annotations


import jax
import numpy as np
import pytest

from conftest import require, stdlib_glob

torch = require("torch", "hf", lazy=True)
transformers = require("transformers", "hf", lazy=True)
peft = require("peft", "hf", lazy=True)
pytestmark = pytest.mark.usefixtures("one_torch_thread")

import hf as hf_cli  # noqa: E402
import trainer  # noqa: E402
from configs import ConfigError  # noqa: E402
from trainer.checkpoint import restore_params  # noqa: E402
from test_hf import TOKENS, TOL, rel_diff, their_logits  # noqa: E402
from test_hf_deepseek import make_hf  # noqa: E402
from test_lora import logits  # noqa: E402

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.dropout=0.1"]
TRAIN = ["train.log_every=1", "train.steps=3", "optim.decay_steps=3", "optim.warmup_steps=1", "optim.lr=3e-2",
         "model.seq_len=32", "mesh.data=1"]


def mla_config(hf_dir: str, run_dir: str, *overrides: str):  # noqa: ANN201 (a Config)
    return hf_cli.import_config(hf_dir, run_dir, "tiny-moe", [f"data.path={stdlib_glob('json')}", *overrides])


def test_q_and_o_adapters_train_and_load_through_peft(tmp_path):
    make_hf(str(tmp_path / "hf"), q_lora_rank=None)
    cfg = mla_config(str(tmp_path / "hf"), str(tmp_path / "run"), *TRAIN, *LORA, "model.lora.targets=[q,o]")
    assert cfg.model.attention_type == "mla" and cfg.model.moe.first_k_dense_replace == 1
    history = trainer.run(cfg, devices=jax.devices()[:1])
    assert history[-1]["loss"] < history[0]["loss"]
    _, _, params = restore_params(cfg.run.dir, device=jax.devices()[0])
    assert {"q_lora_a", "o_lora_b"} <= set(params["dense_layers"]["attn"]) & set(params["layers"]["attn"])
    ours = logits(cfg.model, params)
    hf_cli.export(cfg.run.dir, str(tmp_path / "adapter"), form="peft")
    base = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert rel_diff(their_logits(base, TOKENS), ours) > 100 * TOL  # the adapters change the logits
    model = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    assert rel_diff(their_logits(model, TOKENS), ours) < TOL


@pytest.mark.parametrize("targets, q_lora_rank, named", [
    ("[q,k,v,o]", 0, "k, v"), ("[q,o]", 16, "q"), ("[v]", 0, "v")])
def test_targets_without_a_projection_name_the_key(tiny, targets, q_lora_rank, named):
    with pytest.raises(ConfigError, match=f"^model.lora.targets: {named}: multi-head latent attention"):
        tiny("model.attention_type=mla", "model.num_kv_heads=16", f"model.mla.q_lora_rank={q_lora_rank}",
             "model.lora.rank=4", f"model.lora.targets={targets}")


def test_an_o_adapter_on_a_query_latent_trains(tiny):
    """With a query latent only `o` adapts; a run with it trains and its loss moves."""
    cfg = tiny(*TRAIN, *LORA, "model.attention_type=mla", "model.num_kv_heads=16", "model.mla.q_lora_rank=16",
               "model.lora.targets=[o]")
    losses = np.array([r["loss"] for r in trainer.run(cfg, devices=jax.devices()[:1])])
    assert losses[-1] < losses[0] - 0.05, losses
