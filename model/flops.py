"""Model FLOPs per token, the one formula every MFU figure in this project uses.

6 x (matmul parameters, output head included) + 6 x layers x seq_len x d_model (causal
attention: QK^T and AV, halved by causality, times 3 for forward + backward). Embedding
lookups are not matmuls; a tied embedding is counted once, as the output head. A mixture of
experts counts its *active* parameters: the router, the `experts_per_token` experts each token
runs through, and the shared experts (capacity mode counts dropped tokens as computed). Under
multi-head latent attention the attention term is per head (qk_head_dim + v_head_dim) / 2
instead of d_model / heads, and its projections are the latent ones.

With LoRA (`model.lora`) the frozen weights get no weight gradient: 4 x their parameters (the
forward and the input gradient), plus 6 x the adapters' parameters.
"""

from __future__ import annotations

from configs.schema import ModelConfig


def attention_params(cfg: ModelConfig) -> int:
    """One layer's attention projections."""
    d, h, m = cfg.d_model, cfg.num_heads, cfg.mla
    if cfg.attention_type == "gqa":
        return d * cfg.resolved_head_dim * (2 * h + 2 * cfg.num_kv_heads)  # q, o and k, v
    q = (d + h * m.qk_head_dim) * m.q_lora_rank if m.q_lora_rank else d * h * m.qk_head_dim
    kv = d * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim)
    return q + kv + h * m.v_head_dim * d


def matmul_params(cfg: ModelConfig) -> int:
    d = cfg.d_model
    attn = attention_params(cfg)
    dense = 3 * d * cfg.d_ff
    moe_layers = moe_layer_count(cfg)
    e = cfg.moe
    moe = 3 * d * (e.d_ff or cfg.d_ff) * (e.experts_per_token + e.shared_experts) + d * e.num_experts
    head = d * cfg.vocab_size
    return cfg.num_layers * attn + (cfg.num_layers - moe_layers) * dense + moe_layers * moe + head


def stack_layers(cfg: ModelConfig) -> int:
    """Layers in the model's main stack, the one a pipeline splits into stages: all but the
    `model.moe.first_k_dense_replace` dense ones before it."""
    return cfg.num_layers - (cfg.moe.first_k_dense_replace if cfg.moe.enabled else 0)


def moe_layer_count(cfg: ModelConfig) -> int:
    """How many layers are MoE layers (`model.moe.every`: one in each group of that many, after
    the `first_k_dense_replace` dense ones)."""
    return stack_layers(cfg) // cfg.moe.every if cfg.moe.enabled else 0


def adapter_params(cfg: ModelConfig) -> int:
    """The LoRA adapters' parameters: rank x (fan in + fan out) per adapted projection and layer."""
    lo = cfg.lora
    if not lo.enabled:
        return 0
    d, f, q, kv = cfg.d_model, cfg.d_ff, cfg.num_heads * cfg.resolved_head_dim, cfg.num_kv_heads * cfg.resolved_head_dim
    sizes = {"q": d + q, "k": d + kv, "v": d + kv, "o": q + d, "gate": d + f, "up": d + f, "down": f + d}
    dense_layers = cfg.num_layers - moe_layer_count(cfg)
    layers = {t: dense_layers if t in ("gate", "up", "down") else cfg.num_layers for t in lo.targets}
    return sum(lo.rank * sizes[t] * layers[t] for t in lo.targets)


def flops_per_token(cfg: ModelConfig) -> float:
    m = cfg.mla
    width = cfg.d_model if cfg.attention_type == "gqa" else cfg.num_heads * (m.qk_head_dim + m.v_head_dim) / 2
    weights = 4.0 * matmul_params(cfg) + 6.0 * adapter_params(cfg) if cfg.lora.enabled else 6.0 * matmul_params(cfg)
    return weights + 6.0 * cfg.num_layers * cfg.seq_len * width
