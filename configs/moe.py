"""The `model.moe` section: a mixture of experts in place of the blocks' SwiGLU (model/moe.py).

Its own file, beside configs/schema.py which references it: Mixtral, Qwen3-MoE and DeepSeek-V3
routing (sigmoid scores, a load-driven per-expert bias, grouped top-k, dense first layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from configs.fields import Range, Resume


@dataclass(kw_only=True)
class MoEConfig:
    """A mixture of experts in place of the blocks' SwiGLU (model/moe.py); num_experts 0: dense."""

    num_experts: Annotated[int, Range(ge=0, hint="0: dense"), Resume()] = 0
    """Experts per MoE layer."""
    # Qwen3-MoE's decoder_sparse_step: layers k-1, 2k-1, ... are MoE, the others dense SwiGLU.
    every: Annotated[int, Range(ge=1, hint="1: every layer is an MoE"), Resume()] = 1
    """Every k-th layer is an MoE; model.num_layers must be a multiple."""
    # DeepSeek-V3's first_k_dense_replace: a second stack of dense layers before the MoE ones.
    first_k_dense_replace: Annotated[int, Range(ge=0), Resume()] = 0
    """The first k layers are dense SwiGLU (model.d_ff), the other num_layers - k MoE."""
    experts_per_token: int = 2
    """Top-k: the experts each token is routed to, in [1, num_experts]."""
    d_ff: Annotated[int, Range(ge=0, hint="0: model.d_ff"), Resume()] = 0
    """Each expert's hidden size."""
    shared_experts: Annotated[int, Range(ge=0), Resume()] = 0
    """Always-on experts (one SwiGLU of shared_experts x d_ff beside the routed ones)."""
    # softmax_topk (Mixtral): top-k of the logits, softmax over those k. topk_softmax (Qwen3-MoE):
    # softmax over all experts, then top-k, divided by their sum if `renormalize`. sigmoid
    # (DeepSeek-V3): top-k of sigmoid(logits) + a per-expert bias, weights from the unbiased
    # scores, divided by their sum if `renormalize`, times `routed_scaling_factor`.
    router: Literal["softmax_topk", "topk_softmax", "sigmoid"] = "softmax_topk"
    """How router logits become the chosen experts' weights."""
    renormalize: bool = True
    """Under topk_softmax and sigmoid: divide the top-k weights by their sum."""
    # DeepSeek-V3's auxiliary-loss-free balancing: after each step every expert's bias moves by
    # this much against its load (down if above the mean, up if below).
    router_bias_update_rate: Annotated[float, Range(ge=0, hint="0: the bias stays")] = 0.001
    """Under sigmoid: how far each step moves the per-expert routing bias toward balance."""
    n_group: Annotated[int, Range(ge=1, hint="1: no groups")] = 1
    """Under sigmoid: expert groups; a token picks from the topk_group best groups only."""
    topk_group: Annotated[int, Range(ge=1)] = 1
    """Under sigmoid: the groups (ranked by their two best biased scores) a token may pick from."""
    routed_scaling_factor: Annotated[float, Range(gt=0)] = 1.0
    """Under sigmoid: multiplies the routed experts' weights."""
    aux_loss_coef: Annotated[float, Range(ge=0)] = 0.01
    """Weight of the load-balancing loss (Switch's; under sigmoid DeepSeek-V3's sequence-wise one)."""
    router_z_loss_coef: Annotated[float, Range(ge=0)] = 0.001
    """Weight of the router z-loss (mean squared logsumexp of the router logits)."""
    # > 0: each expert takes at most ceil(capacity_factor x tokens x top-k / experts) of a
    # device's tokens; the rest are dropped.
    capacity_factor: Annotated[float, Range(ge=0, hint="0: dropless")] = 0.0
    """Bounds the tokens each expert takes; 0 computes every chosen expert for every token."""
    # megablox (the Pallas TPU kernel; interpreted on CPU, for tests) needs model.d_model, the
    # expert d_ff and each device's rows (model.seq_len / mesh.context x experts_per_token) in
    # multiples of 128, its tile.
    grouped_matmul: Literal["auto", "ragged_dot", "megablox"] = "auto"
    """The dropless experts' grouped matmuls (auto: megablox on TPU where its tiles divide, else ragged_dot)."""
    # ragged: each device sends each other device only the rows routed to its experts
    # (jax.lax.ragged_all_to_all; XLA:CPU lacks it, so on CPU devices, for tests, the same exchange
    # is emulated by a dense all-to-all). dense: every device sends every other a buffer padded to
    # the worst case, whatever the routing. Both hold the same worst-case receive buffer.
    dispatch: Literal["auto", "ragged", "dense"] = "auto"
    """Under mesh.expert > 1, how routed tokens reach their experts (auto: ragged on TPU and GPU, dense on CPU)."""

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0

    @property
    def router_bias(self) -> bool:
        """Whether the MoE layers keep a per-expert routing bias (the sigmoid router's)."""
        return self.enabled and self.router == "sigmoid"
