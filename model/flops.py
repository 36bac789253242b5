"""Model FLOPs per token, the one formula every MFU figure in this project uses.

6 x (matmul parameters, output head included) + 6 x layers x seq_len x d_model (causal
attention: QK^T and AV, halved by causality, times 3 for forward + backward). Embedding
lookups are not matmuls; a tied embedding is counted once, as the output head. A mixture of
experts counts its *active* parameters: the router, the `experts_per_token` experts each token
runs through, and the shared experts (capacity mode counts dropped tokens as computed).
"""

from __future__ import annotations

from configs.schema import ModelConfig


def matmul_params(cfg: ModelConfig) -> int:
    d, hd = cfg.d_model, cfg.resolved_head_dim
    attn = d * hd * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)  # q, o and k, v
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


def flops_per_token(cfg: ModelConfig) -> float:
    return 6.0 * matmul_params(cfg) + 6.0 * cfg.num_layers * cfg.seq_len * cfg.d_model
