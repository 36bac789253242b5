"""Oracle tests of the DeepSeek-V3 mapping (model/hf_deepseek.py, model/hf.py, `hf.py`) against `transformers`.

As tests/test_hf_moe.py: a random tiny DeepseekV3ForCausalLM (torch, CPU, float32, every weight
and the routing bias random; multi-head latent attention, a dense first layer, grouped sigmoid
routing with shared experts) is saved with `save_pretrained`, imported and scored on the same
tokens; our parameters (imported, or our own random init) are written back and loaded by
`transformers` strictly. Same tolerance: max |ours - theirs| <= TOL x max |logit|.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import require

torch = require("torch", "hf", lazy=True)
transformers = require("transformers", "hf", lazy=True)
pytestmark = pytest.mark.usefixtures("one_torch_thread")

import hf as hf_cli  # noqa: E402
from configs import ConfigError, load_config  # noqa: E402
from model import hf, hf_arch  # noqa: E402
from model.transformer import Transformer, transformer_from_params  # noqa: E402
from test_hf import CPU0, TOKENS, TOL, VOCAB, assert_greedy_matches, rel_diff, their_logits  # noqa: E402
from model.safetensors_files import write_safetensors  # noqa: E402
from test_hf_moe import logits, stored_names  # noqa: E402

ARCH = "deepseek_v3"


def export_and_load(params: dict, cfg, out: str) -> torch.nn.Module:  # noqa: ANN001 (a ModelConfig)
    """Our parameters -> a Hugging Face directory -> DeepseekV3ForCausalLM, failing on any
    missing, unexpected or mismatched weight."""
    os.makedirs(out)
    write_safetensors(hf.to_hf_tensors(params, cfg), os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf_arch.hf_config(cfg, {"eos_token_id": 256}), f)
    model, info = transformers.DeepseekV3ForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    return model.eval()


def make_hf(path: str, q_lora_rank: int | None, rope: dict | None = None) -> torch.nn.Module:
    """A random 3-layer DeepSeek-V3 (layer 0 dense, 1 and 2 with 8 experts in 4 groups, top-2 of
    the best 2 groups, one shared expert) saved to `path`; `rope`: its rope_parameters."""
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        **({"rope_parameters": rope} if rope else {}),
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
        first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, kv_lora_rank=16,
        q_lora_rank=q_lora_rank, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, rms_norm_eps=1e-6,
        tie_word_embeddings=False, num_nextn_predict_layers=0)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_import_matches_transformers_and_export_round_trips(tmp_path, q_lora_rank):
    theirs = make_hf(str(tmp_path / "hf"), q_lora_rank)
    cfg = hf_cli.import_config(str(tmp_path / "hf"), str(tmp_path / "run"), "tiny-moe", []).model
    assert (cfg.attention_type, cfg.mla.q_lora_rank, cfg.mla.v_head_dim) == ("mla", q_lora_rank or 0, 12)
    e = cfg.moe
    assert (e.router, e.num_experts, e.n_group, e.topk_group, e.first_k_dense_replace, e.shared_experts) == (
        "sigmoid", 8, 4, 2, 1, 1)
    params = hf.load_params(str(tmp_path / "hf"), cfg, CPU0)
    assert np.abs(params["layers"]["mlp"]["router_bias"]).min() > 0
    ref = their_logits(theirs, TOKENS)
    assert ref.std() > 0.5
    assert rel_diff(logits(cfg, params), ref) < TOL
    # The test sees the routing: without the bias, or without the groups, the logits move.
    unbiased = {**params, "layers": {**params["layers"], "mlp": {**params["layers"]["mlp"], "router_bias":
                                                                 np.zeros((2, 8), np.float32)}}}
    assert rel_diff(logits(cfg, unbiased), ref) > 100 * TOL
    ungrouped = dataclasses.replace(cfg, moe=dataclasses.replace(e, n_group=1, topk_group=1))
    assert rel_diff(logits(ungrouped, params), ref) > 100 * TOL

    out = str(tmp_path / "exported")
    exported = export_and_load(params, cfg, out)
    assert stored_names(out) == stored_names(str(tmp_path / "hf"))  # the published per-expert layout
    assert rel_diff(their_logits(exported, TOKENS), ref) < TOL


def test_our_random_deepseek_exports_and_generates_as_transformers(tmp_path):
    """Our own random init (norm scales and routing bias drawn too) -> export -> transformers:
    logits and greedy decoding (our latent cache) equal."""
    cfg = load_config("tiny-moe", [
        "model.num_layers=3", "model.d_model=32", "model.num_heads=4", "model.num_kv_heads=4", "model.d_ff=40",
        "model.attention_type=mla", "model.mla.q_lora_rank=24", "model.mla.kv_lora_rank=16",
        "model.mla.qk_rope_head_dim=8", "model.mla.qk_nope_head_dim=8", "model.mla.v_head_dim=12",
        "model.moe.num_experts=8", "model.moe.d_ff=24", "model.moe.shared_experts=1", "model.moe.router=sigmoid",
        "model.moe.n_group=4", "model.moe.topk_group=2", "model.moe.routed_scaling_factor=2.5",
        "model.moe.first_k_dense_replace=1", "model.init_std=0.2", "model.tie_embeddings=false"]).model
    params = nnx.to_pure_dict(nnx.state(Transformer(cfg, rngs=nnx.Rngs(5))))
    keys = iter(jax.random.split(jax.random.key(4), 64))
    draw = {"scale": lambda s: 1 + 0.2 * jax.random.normal(next(keys), s),
            "router_bias": lambda s: 0.3 * jax.random.normal(next(keys), s)}
    params = jax.tree_util.tree_map_with_path(lambda p, a: draw[p[-1].key](a.shape) if p[-1].key in draw else a, params)
    assert hf_arch.architecture(cfg) == ARCH
    theirs = export_and_load(params, cfg, str(tmp_path / "out"))
    assert theirs.config.first_k_dense_replace == 1 and theirs.config.n_group == 4
    assert rel_diff(their_logits(theirs, TOKENS), logits(cfg, params)) < TOL
    assert_greedy_matches(transformer_from_params(cfg, params), theirs)


@pytest.mark.parametrize("overrides, message", [
    (["model.moe.router=sigmoid", "model.moe.num_experts=4"], "model.attention_type=gqa: Hugging Face's DeepSeek-V3"),
    (["model.attention_type=mla", "model.num_kv_heads=16", "model.moe.num_experts=4"], "model.moe.router=softmax_topk"),
])
def test_export_refuses_what_deepseek_v3_cannot_hold(overrides, message):
    with pytest.raises(ConfigError, match="^" + message):
        hf_arch.architecture(load_config("tiny", overrides).model)


# DeepSeek-V3's released rotary scaling (its config.json's rope_scaling, in transformers 5's words).
V3_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
           "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


@pytest.mark.parametrize("mscale", [1.0, 0.0])  # DeepSeek-V3's softmax factor; plain YaRN's cosine factor
def test_yarn_imports_and_exports_as_transformers(tmp_path, mscale):
    """A random tiny DeepSeek-V3 with YaRN rotary scaling: imported, our logits are transformers'
    (and without the scaling they are not); exported, transformers reads the scaling back and
    gives the same logits."""
    rope = {**V3_YARN, "mscale": mscale, "mscale_all_dim": mscale}
    theirs = make_hf(str(tmp_path / "hf"), 24, rope)
    cfg = hf_cli.import_config(str(tmp_path / "hf"), str(tmp_path / "run"), "tiny-moe", []).model
    s = cfg.rope_scaling
    assert (s.type, s.factor, s.original_max_position_embeddings, s.mscale_all_dim) == ("yarn", 40.0, 4096, mscale)
    params = hf.load_params(str(tmp_path / "hf"), cfg, CPU0)
    ref = their_logits(theirs, TOKENS)
    assert rel_diff(logits(cfg, params), ref) < TOL
    plain = dataclasses.replace(cfg, rope_scaling=dataclasses.replace(s, type="none"))
    assert rel_diff(logits(plain, params), ref) > 100 * TOL
    out = str(tmp_path / "exported")
    exported = export_and_load(params, cfg, out)
    assert {k: exported.config.rope_parameters[k] for k in rope} == rope
    assert rel_diff(their_logits(exported, TOKENS), ref) < TOL


@pytest.mark.parametrize("rope_dim, factor, original, mscale", [(64, 40.0, 4096, 1.0), (8, 4.0, 64, 0.707),
                                                                 (16, 8.0, 512, 0.0)])
def test_yarn_frequencies_and_factors_are_transformers(rope_dim, factor, original, mscale):
    """The frequencies, the cosine factor and the softmax factor (model/rope.py) against
    transformers' own YaRN and DeepseekV3Attention's scale, at DeepSeek-V3's shape and others."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    from configs.rope import RopeScalingConfig
    from model.rope import softmax_factor, yarn_frequencies

    rope = {**V3_YARN, "factor": factor, "original_max_position_embeddings": original, "mscale": mscale,
            "mscale_all_dim": mscale}
    config = transformers.DeepseekV3Config(qk_rope_head_dim=rope_dim, rope_parameters=rope)
    inv_freq, attention = ROPE_INIT_FUNCTIONS["yarn"](config)
    s = RopeScalingConfig(**{k: v for k, v in rope.items() if k not in ("rope_type", "rope_theta")}, type="yarn")
    ours, our_attention = yarn_frequencies(rope_dim, 10000.0, s)
    plain = 1.0 / 10000.0 ** (np.arange(0, rope_dim, 2) / rope_dim)
    assert np.abs(inv_freq.numpy() / plain - 1).max() > 0.5  # the scaling moves some frequencies
    np.testing.assert_allclose(ours, inv_freq.numpy(), rtol=1e-6)
    assert our_attention == pytest.approx(attention, rel=1e-12)
    assert softmax_factor(s) == pytest.approx(yarn_apply_mscale(rope, 1.0), rel=1e-12)


def test_import_reads_deepseeks_rope_scaling_and_refuses_fp8(tmp_path):
    """DeepSeek-V3's own config.json (transformers 4's `rope_scaling`, FP8 weights with block
    scales) exits 2 naming the FP8 weights only; a rope type we do not build is named."""
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    released = {k: v for k, v in V3_YARN.items() if k not in ("rope_type", "rope_theta")}
    config = {"model_type": "deepseek_v3", "quantization_config": {"quant_method": "fp8"}, "rope_theta": 10000,
              "rope_scaling": {"type": "yarn", **released}}
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="quant_method='fp8'$"):
        hf_cli.import_config(str(hf_dir), str(tmp_path / "run"), "tiny-moe", [])
    config["rope_scaling"] = {"type": "longrope", "factor": 4.0}
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="rope_type='longrope'"):
        hf_cli.import_config(str(hf_dir), str(tmp_path / "run"), "tiny-moe", [])
