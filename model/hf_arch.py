"""The Hugging Face architectures we read and write: Llama, Mixtral, Qwen3-MoE and DeepSeek-V3
(the last in model/hf_deepseek.py).

For each: its config.json <-> our `model.*` keys, and its tensor names beside our parameter
paths (the conversion of one tensor's layout is model/hf.py's). Mixtral and Qwen3-MoE are
written in the per-expert layout published checkpoints use (`experts.{j}.w1.weight`, ...),
which transformers 5 fuses into stacked tensors when it loads them and splits again when it
saves; ours are stacked on an `expert` dim.

What tells them apart in our config: Qwen3-MoE normalizes q and k per head (`model.qk_norm`)
and routes by softmax over all experts, then top-k (`model.moe.router=topk_softmax`, divided
by their sum when `norm_topk_prob`); Mixtral takes the top-k logits and a softmax over those
(`softmax_topk`: the same weights as topk_softmax with renormalize). Neither has shared experts.
"""

from __future__ import annotations

from typing import Any

from configs.schema import ConfigError, ModelConfig
from model import hf_deepseek

# (our parameter path, Hugging Face tensor name, input dims). "{i}" is the layer index, "{j}"
# the expert's: each stacks a leading dim of ours. A projection with n input dims is stored by
# Hugging Face as [prod(other dims), prod(input dims)] (torch's [out, in]); ours keeps the dims
# named, input first. 0: stored as is (norms, embedding).
Entry = tuple[tuple[str, ...], str, int]
COMMON: tuple[Entry, ...] = (
    (("embedding",), "model.embed_tokens.weight", 0),
    (("final_norm", "scale"), "model.norm.weight", 0),
    (("lm_head",), "lm_head.weight", 1),
    (("layers", "attn_norm", "scale"), "model.layers.{i}.input_layernorm.weight", 0),
    (("layers", "attn", "q"), "model.layers.{i}.self_attn.q_proj.weight", 1),
    (("layers", "attn", "k"), "model.layers.{i}.self_attn.k_proj.weight", 1),
    (("layers", "attn", "v"), "model.layers.{i}.self_attn.v_proj.weight", 1),
    (("layers", "attn", "o"), "model.layers.{i}.self_attn.o_proj.weight", 2),
    (("layers", "mlp_norm", "scale"), "model.layers.{i}.post_attention_layernorm.weight", 0),
)
MLP = "model.layers.{i}.mlp"
TENSORS: dict[str, tuple[Entry, ...]] = {
    "llama": COMMON + (
        (("layers", "mlp", "gate"), MLP + ".gate_proj.weight", 1),
        (("layers", "mlp", "up"), MLP + ".up_proj.weight", 1),
        (("layers", "mlp", "down"), MLP + ".down_proj.weight", 1),
    ),
    "mixtral": COMMON + (
        (("layers", "mlp", "router"), "model.layers.{i}.block_sparse_moe.gate.weight", 1),
        (("layers", "mlp", "gate"), "model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight", 1),
        (("layers", "mlp", "up"), "model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight", 1),
        (("layers", "mlp", "down"), "model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight", 1),
    ),
    "qwen3_moe": COMMON + (
        (("layers", "attn", "q_norm", "scale"), "model.layers.{i}.self_attn.q_norm.weight", 0),
        (("layers", "attn", "k_norm", "scale"), "model.layers.{i}.self_attn.k_norm.weight", 0),
        (("layers", "mlp", "router"), MLP + ".gate.weight", 1),
        (("layers", "mlp", "gate"), MLP + ".experts.{j}.gate_proj.weight", 1),
        (("layers", "mlp", "up"), MLP + ".experts.{j}.up_proj.weight", 1),
        (("layers", "mlp", "down"), MLP + ".experts.{j}.down_proj.weight", 1),
    ),
}
CLASSES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
           "deepseek_v3": "DeepseekV3ForCausalLM"}
ARCHS = (*TENSORS, "deepseek_v3")

# Options whose non-default values change the network in ways ModelConfig cannot express.
UNSUPPORTED_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "rope_scaling": None,
              "sliding_window": None},
    "mixtral": {"hidden_act": "silu", "rope_scaling": None, "sliding_window": None},
    "qwen3_moe": {"hidden_act": "silu", "attention_bias": False, "rope_scaling": None, "use_sliding_window": False,
                  "mlp_only_layers": []},
}


YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any], list[str]]:
    """The rotary base, our `rope_scaling.*` keys (YaRN) and the rope options we cannot express.
    transformers 5 writes `rope_parameters`; 4.x and DeepSeek's own releases write `rope_theta`
    and `rope_scaling`."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), {}, []
    if rope_type != "yarn":
        return float(theta), {}, [f"rope_parameters.rope_type={rope_type!r}"]
    bad = [f"rope_parameters.{k}={params.get(k)!r}" for k in ("factor", "original_max_position_embeddings")
           if not params.get(k)]
    bad += [f"rope_parameters.attention_factor={params['attention_factor']!r}"] if "attention_factor" in params else []
    bad += ["rope_parameters.truncate=False"] if params.get("truncate", True) is False else []
    # transformers reads a missing or zero beta as YaRN's defaults, a missing mscale as none.
    found = {"factor": params.get("factor"), "original_max_position_embeddings": params.get("original_max_position_embeddings"),
             "beta_fast": params.get("beta_fast") or 32.0, "beta_slow": params.get("beta_slow") or 1.0,
             "mscale": params.get("mscale") or 0.0, "mscale_all_dim": params.get("mscale_all_dim") or 0.0}
    return float(theta), {"rope_scaling.type": "yarn", **{f"rope_scaling.{k}": v for k, v in found.items()}}, bad


def rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    """config.json's `rope_parameters` (transformers 5) for `cfg`'s rotary embedding."""
    s = cfg.rope_scaling
    if s.type == "none":
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {"rope_type": "yarn", "rope_theta": cfg.rope_theta, **{k: getattr(s, k) for k in YARN_KEYS}}


def model_keys(hf: dict[str, Any], key: str) -> dict[str, Any]:
    """A Hugging Face config.json -> our `model.*` values (dotted below `model.`), the keys that
    say which kind of network first. Raises ConfigError naming every option we cannot express."""
    path, arch = f"{key}/config.json", hf.get("model_type")
    if arch not in ARCHS:
        raise ConfigError(f"{key}: {path} has model_type={arch!r}; only {', '.join(map(repr, ARCHS))} can be read")
    theta, scaling, bad = _rope(hf)
    if arch == "deepseek_v3":
        return hf_deepseek.model_keys(hf, key, theta, bad) | scaling
    bad += ["rope_parameters.rope_type='yarn'"] if scaling else []  # built for DeepSeek's latent attention
    bad += [f"{n}={hf[n]!r}" for n, default in UNSUPPORTED_DEFAULTS[arch].items() if hf.get(n, default) != default]
    if bad:
        raise ConfigError(f"{key}: {path} uses options this model cannot express: {', '.join(bad)}")
    heads = hf["num_attention_heads"]
    keys: dict[str, Any] = {"moe.num_experts": 0, "qk_norm": arch == "qwen3_moe"}
    if arch != "llama":
        keys["moe.num_experts"] = hf.get("num_local_experts") or hf["num_experts"]
        keys.update({"moe.experts_per_token": hf["num_experts_per_tok"], "moe.shared_experts": 0})
    if arch == "mixtral":  # intermediate_size is each expert's
        keys.update({"moe.router": "softmax_topk", "moe.d_ff": hf["intermediate_size"]})
    if arch == "qwen3_moe":  # layer i is an MoE iff (i + 1) % decoder_sparse_step == 0: our model.moe.every
        keys.update({"moe.router": "topk_softmax", "moe.renormalize": bool(hf.get("norm_topk_prob", False)),
                     "moe.d_ff": hf["moe_intermediate_size"], "moe.every": hf.get("decoder_sparse_step", 1)})
    return keys | {
        "num_layers": hf["num_hidden_layers"],
        "d_model": hf["hidden_size"],
        "num_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "d_ff": hf["intermediate_size"],
        "vocab_size": hf["vocab_size"],
        "rope_theta": theta,
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


def architecture(cfg: ModelConfig) -> str:
    """The Hugging Face model_type that holds exactly the network `cfg` describes."""
    e = cfg.moe
    if cfg.attention_type == "mla" or e.router == "sigmoid" or e.first_k_dense_replace:
        hf_deepseek.check_exportable(cfg)
        return "deepseek_v3"
    if not e.enabled:
        if cfg.qk_norm:
            raise ConfigError("model.qk_norm=true on a dense model: Hugging Face export writes Llama (no q/k norm) "
                              "or, with model.moe.num_experts > 0, Qwen3-MoE")
        return "llama"
    if e.shared_experts:
        raise ConfigError(f"model.moe.shared_experts={e.shared_experts}: neither Mixtral nor Qwen3-MoE has "
                          "ungated shared experts; such a model cannot be exported to Hugging Face")
    if cfg.qk_norm:
        return "qwen3_moe"
    if e.every > 1:
        raise ConfigError(f"model.moe.every={e.every}: Mixtral has an MoE in every layer, and Qwen3-MoE (whose "
                          "decoder_sparse_step it is) needs model.qk_norm=true")
    if e.router == "topk_softmax" and not e.renormalize:
        raise ConfigError("model.moe.renormalize=false needs Qwen3-MoE, whose attention has q/k norms: "
                          "export needs model.qk_norm=true (or a renormalized router, as Mixtral)")
    return "mixtral"


def entries(arch: str, cfg: ModelConfig) -> list[Entry]:
    """The tensors of `arch` that `cfg`'s parameters hold. Under layer groups (`model.moe.every`
    > 1, model/transformer.py BlockGroup) a layer's parameters sit under ("layers", "dense") or
    ("layers", "moe"): the attention's in both, the dense SwiGLU's (Llama's names) in the first."""
    if arch == "deepseek_v3":
        return hf_deepseek.entries(cfg)
    out = [e for e in TENSORS[arch] if not (cfg.tie_embeddings and e[0] == ("lm_head",))]
    if not (cfg.moe.enabled and cfg.moe.every > 1):
        return out
    grouped = []
    for path, name, n_in in out:
        if path[0] != "layers":
            grouped.append((path, name, n_in))
            continue
        grouped.append((("layers", "moe", *path[1:]), name, n_in))
        if path[1] != "mlp":
            grouped.append((("layers", "dense", *path[1:]), name, n_in))
    return grouped + [(("layers", "dense", *path[1:]), name, n_in) for path, name, n_in in TENSORS["llama"]
                      if path[:2] == ("layers", "mlp")]


def hf_config(cfg: ModelConfig, source: dict[str, Any] | None = None, dtype: str = "float32") -> dict[str, Any]:
    """config.json for the architecture of `cfg`. Token ids and the context length come from
    `source`: the config.json of the checkpoint the run was imported from, or just the
    tokenizer's ids."""
    source, arch, e = source or {}, architecture(cfg), cfg.moe
    rope = rope_parameters(cfg)
    out = {
        "architectures": [CLASSES[arch]],
        "model_type": arch,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.resolved_head_dim,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,  # read by transformers 4.x
        "rope_parameters": rope,  # read by transformers 5
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "max_position_embeddings": max(cfg.seq_len, source.get("max_position_embeddings", 0)),
        "bos_token_id": source.get("bos_token_id"),
        "eos_token_id": source.get("eos_token_id"),
        "pad_token_id": source.get("pad_token_id"),
        "torch_dtype": dtype,  # transformers 4.x
        "dtype": dtype,  # transformers 5
    }
    if arch == "deepseek_v3":
        return out | hf_deepseek.hf_config(cfg)
    if arch == "llama":
        return out | {"attention_bias": False, "mlp_bias": False}
    # num_experts: transformers 4.x's Qwen3-MoE name; 5 maps it to num_local_experts (Mixtral's).
    moe = {"num_local_experts": e.num_experts, "num_experts_per_tok": e.experts_per_token,
           "router_aux_loss_coef": e.aux_loss_coef, "output_router_logits": False}
    if arch == "mixtral":
        return out | moe | {"intermediate_size": e.d_ff or cfg.d_ff, "sliding_window": None}
    return out | moe | {
        "num_experts": e.num_experts, "moe_intermediate_size": e.d_ff or cfg.d_ff, "decoder_sparse_step": e.every,
        "mlp_only_layers": [], "norm_topk_prob": e.router == "softmax_topk" or e.renormalize,
        "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
    }
