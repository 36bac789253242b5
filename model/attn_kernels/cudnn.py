"""`model.attention=cudnn`: cuDNN's fused flash attention through `jax.nn.dot_product_attention`.

GPU only. With packed documents and `model.max_documents` > 0 it takes each row's documents as
cuDNN's packed layout (model/attention.py `cudnn_packed_attention`), else a dense mask of them,
which a run says at start. One head dim for q, k and v (a narrower v is padded). A sequence split
only under `context.strategy=ring` with rows of one document: each ring block is one cuDNN call
(model/ring_blocks.py, sharding/fused_ring.py).
"""

from __future__ import annotations

from configs import Config
from model import ring_blocks
from model.attention import cudnn_packed_attention, fused_attention
from model.attn_kernels.registry import Array, Kernel, MeshBinders, Options, register
from model.kernels import AttentionFn


@register
class CuDNN(Kernel):
    name = "cudnn"
    one_head_dim = True
    platforms = ("gpu",)

    def local(self, q: Array, k: Array, v: Array, positions: Array, segment_ids: Array | None,
              opts: Options) -> Array:
        if segment_ids is not None and opts.max_documents > 0:
            return cudnn_packed_attention(q, k, v, segment_ids, opts.max_documents)
        return fused_attention(q, k, v, segment_ids, "cudnn", positions)

    def notes(self, cfg: Config) -> list[str]:
        m = cfg.model
        if cfg.data.packing == "document" and m.max_documents == 0:
            return ["model.attention=cudnn with data.packing=document builds a dense [batch, 1, T, T] mask of the "
                    "documents; set model.max_documents (the most documents a row may hold) for cuDNN's packed "
                    "layout, no mask"]
        return []

    def check_split(self, cfg: Config, context: int) -> None:
        # cuDNN cannot take a sharded sequence under GSPMD; under the ring each block is a whole
        # cuDNN call on local arrays.
        self.check_ring_blocks(cfg, context)

    def mesh_bound(self, cfg: Config, platform: str, binders: MeshBinders) -> AttentionFn | None:
        # Under a sequence split: the ring, each block one cuDNN flash call (no [T, T] scores).
        if binders.shards == 1:
            return None
        return binders.fused_ring(ring_blocks.CUDNN, cfg.context.load_balance)

    def planned_as(self, target: str | None) -> tuple[str, str] | None:
        if target == "cuda":
            return None
        where = "the CPU" if target is None else "a TPU"
        return "xla", (f"model.attention=cudnn has no kernel on {where}: planned with xla attention, whose "
                       "[batch, heads, T, T] scores flash attention would not hold (temporaries: an upper bound)")
