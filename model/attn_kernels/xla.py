"""`model.attention=xla`: plain einsums and a softmax in float32, the reference that runs everywhere.

The one kernel that takes a sequence split: the layers constrain keys and values whole along
`length` (the all-gather strategy, model/attention.py `gathered_attention`), and under
`context.strategy=ring` the trainer binds ring attention over the split instead. The one kernel
that runs `model.attention_chunk`'s query blocks.
"""

from __future__ import annotations

from configs import Config
from model.attention import block_mask, gathered_attention, xla_attention
from model.attn_kernels.registry import Array, Kernel, MeshBinders, Options, register
from model.kernels import AttentionFn


@register
class XLA(Kernel):
    name = "xla"
    splits_sequence = True
    chunks = True

    def local(self, q: Array, k: Array, v: Array, positions: Array, segment_ids: Array | None,
              opts: Options) -> Array:
        return xla_attention(q, k, v, segment_ids, positions)

    def attend(self, q: Array, k: Array, v: Array, positions: Array, segment_ids: Array | None,
               opts: Options) -> Array:
        return gathered_attention(q, k, v, positions, segment_ids, opts.chunk)

    def mesh_bound(self, cfg: Config, platform: str, binders: MeshBinders) -> AttentionFn | None:
        # Ring attention with the model's mask; with one context shard it is blockwise attention
        # on each device's whole rows (no [T, T] scores). The all-gather strategy is the model's own.
        return binders.ring(block_mask) if cfg.context.strategy == "ring" else None
