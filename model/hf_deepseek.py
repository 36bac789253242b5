"""Hugging Face's DeepseekV3ForCausalLM beside our model: config.json <-> `model.*` keys, and its
tensor names beside our parameter paths (model/hf_arch.py dispatches here; model/hf.py converts).

DeepSeek-V3 is multi-head latent attention (`model.attention_type=mla`, model/mla.py) in every
layer, dense SwiGLU in the first `first_k_dense_replace` layers (our `dense_layers` stack: Hugging
Face layers 0..k-1) and a mixture of experts in the others (our `layers` stack: layers k..), with
the sigmoid router (`model.moe.router=sigmoid`): its `gate.e_score_correction_bias` is our
`router_bias`, its shared experts one SwiGLU of `n_shared_experts x moe_intermediate_size`, as
ours. Checkpoints store the experts one by one (`experts.{j}.gate_proj.weight`, ...), which
transformers 5 fuses when it loads them and splits again when it saves. Multi-token prediction
layers (index num_hidden_layers and up) are neither read nor written.
"""

from __future__ import annotations

from typing import Any

from configs.schema import ConfigError, ModelConfig

Entry = tuple[tuple[str, ...], str, int]  # as model/hf_arch.py's
LAYER = "model.layers.{i}"
NORMS: tuple[Entry, ...] = (
    (("attn_norm", "scale"), LAYER + ".input_layernorm.weight", 0),
    (("mlp_norm", "scale"), LAYER + ".post_attention_layernorm.weight", 0),
)
ATTENTION: tuple[Entry, ...] = (
    (("attn", "q_a"), LAYER + ".self_attn.q_a_proj.weight", 1),
    (("attn", "q_norm", "scale"), LAYER + ".self_attn.q_a_layernorm.weight", 0),
    (("attn", "q_b"), LAYER + ".self_attn.q_b_proj.weight", 1),
    (("attn", "q"), LAYER + ".self_attn.q_proj.weight", 1),
    (("attn", "kv_a"), LAYER + ".self_attn.kv_a_proj_with_mqa.weight", 1),
    (("attn", "kv_norm", "scale"), LAYER + ".self_attn.kv_a_layernorm.weight", 0),
    (("attn", "kv_b"), LAYER + ".self_attn.kv_b_proj.weight", 1),
    (("attn", "o"), LAYER + ".self_attn.o_proj.weight", 2),
)
DENSE: tuple[Entry, ...] = tuple((("mlp", p), f"{LAYER}.mlp.{p}_proj.weight", 1) for p in ("gate", "up", "down"))
MOE: tuple[Entry, ...] = (
    (("mlp", "router"), LAYER + ".mlp.gate.weight", 1),
    (("mlp", "router_bias"), LAYER + ".mlp.gate.e_score_correction_bias", 0),
    *((("mlp", p), f"{LAYER}.mlp.experts.{{j}}.{p}_proj.weight", 1) for p in ("gate", "up", "down")),
)
SHARED: tuple[Entry, ...] = tuple((("mlp", "shared", p), f"{LAYER}.mlp.shared_experts.{p}_proj.weight", 1)
                                  for p in ("gate", "up", "down"))
UNSUPPORTED_DEFAULTS: dict[str, Any] = {"hidden_act": "silu", "attention_bias": False}


def entries(cfg: ModelConfig) -> list[Entry]:
    """The DeepSeek-V3 tensors `cfg`'s parameters hold."""
    query = ("q",) if cfg.mla.q_lora_rank == 0 else ("q_a", "q_norm", "q_b")  # direct, or through a latent
    attention = [e for e in ATTENTION if e[0][1] not in ("q", "q_a", "q_norm", "q_b") or e[0][1] in query]
    layer = [*NORMS, *attention]
    out: list[Entry] = [(("embedding",), "model.embed_tokens.weight", 0), (("final_norm", "scale"), "model.norm.weight", 0)]
    if not cfg.tie_embeddings:
        out.append((("lm_head",), "lm_head.weight", 1))
    out += [(("layers", *path), name, n) for path, name, n in (*layer, *MOE, *(SHARED if cfg.moe.shared_experts else ()))]
    if cfg.moe.first_k_dense_replace:
        out += [(("dense_layers", *path), name, n) for path, name, n in (*layer, *DENSE)]
    return out


def check_exportable(cfg: ModelConfig) -> None:
    """ConfigError unless `cfg` is a network DeepseekV3ForCausalLM holds."""
    e = cfg.moe
    if not e.enabled:
        raise ConfigError("model.moe.num_experts=0: Hugging Face export writes a dense model as Llama, whose "
                          "attention is grouped-query; a dense model with model.attention_type=mla has no export")
    if cfg.attention_type != "mla":
        raise ConfigError(f"model.attention_type={cfg.attention_type}: Hugging Face's DeepSeek-V3 (the sigmoid "
                          "router, dense first layers) has multi-head latent attention; set model.attention_type=mla")
    if e.router != "sigmoid" or e.every != 1 or cfg.qk_norm:
        raise ConfigError(f"model.moe.router={e.router}, model.moe.every={e.every}, model.qk_norm={cfg.qk_norm}: "
                          "DeepSeek-V3 needs the sigmoid router in every layer after the dense ones, without q/k norms")


def model_keys(hf: dict[str, Any], key: str, rope_theta: float, bad: list[str]) -> dict[str, Any]:
    """config.json (model_type deepseek_v3) -> our `model.*` values; ConfigError names what we cannot
    express (`bad`: the rotary options already found so)."""
    bad = bad + [f"{n}={hf[n]!r}" for n, default in UNSUPPORTED_DEFAULTS.items() if hf.get(n, default) != default]
    if hf.get("quantization_config"):  # DeepSeek-V3's own release: FP8 blocks with their scales
        bad.append(f"quantization_config.quant_method={hf['quantization_config'].get('quant_method')!r}")
    if bad:
        raise ConfigError(f"{key}: {key}/config.json uses options this model cannot express: {', '.join(bad)}")
    heads = hf["num_attention_heads"]
    return {
        "attention_type": "mla", "qk_norm": False, "num_layers": hf["num_hidden_layers"], "d_model": hf["hidden_size"],
        "num_heads": heads, "num_kv_heads": heads, "d_ff": hf["intermediate_size"], "vocab_size": hf["vocab_size"],
        "rope_theta": rope_theta, "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "mla.q_lora_rank": hf.get("q_lora_rank") or 0, "mla.kv_lora_rank": hf["kv_lora_rank"],
        "mla.qk_rope_head_dim": hf["qk_rope_head_dim"], "mla.qk_nope_head_dim": hf["qk_nope_head_dim"],
        "mla.v_head_dim": hf["v_head_dim"], "mla.rope_interleave": bool(hf.get("rope_interleave", True)),
        "moe.num_experts": hf.get("n_routed_experts") or hf["num_local_experts"], "moe.router": "sigmoid",
        "moe.experts_per_token": hf["num_experts_per_tok"], "moe.d_ff": hf["moe_intermediate_size"],
        "moe.shared_experts": hf.get("n_shared_experts") or 0, "moe.every": 1,
        "moe.first_k_dense_replace": hf.get("first_k_dense_replace", 0), "moe.n_group": hf.get("n_group") or 1,
        "moe.topk_group": hf.get("topk_group") or 1, "moe.routed_scaling_factor": float(hf["routed_scaling_factor"]),
        "moe.renormalize": bool(hf.get("norm_topk_prob", True)),
    }


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The DeepSeek-V3 keys of config.json (model/hf_arch.py adds the common ones)."""
    e, m = cfg.moe, cfg.mla
    return {
        "num_key_value_heads": cfg.num_heads,
        "moe_intermediate_size": e.d_ff or cfg.d_ff, "n_routed_experts": e.num_experts,
        "n_shared_experts": e.shared_experts, "num_experts_per_tok": e.experts_per_token,
        "first_k_dense_replace": e.first_k_dense_replace, "n_group": e.n_group, "topk_group": e.topk_group,
        "routed_scaling_factor": e.routed_scaling_factor, "norm_topk_prob": e.renormalize,
        "q_lora_rank": m.q_lora_rank or None, "kv_lora_rank": m.kv_lora_rank, "qk_rope_head_dim": m.qk_rope_head_dim,
        "qk_nope_head_dim": m.qk_nope_head_dim, "v_head_dim": m.v_head_dim, "head_dim": m.qk_rope_head_dim,
        "rope_interleave": m.rope_interleave, "attention_bias": False, "num_nextn_predict_layers": 0,
    }
