"""`model.attention=splash`: the TPU Pallas splash kernel that ships in JAX (model/attention.py
`splash_attention`), interpreted off TPU (slow: for checking numerics).

A Pallas call is opaque to XLA's partitioner, which would gather whole arrays to every device
around it, so the kernel always runs per device under shard_map, bound by the trainer. Its tiles
are 512 positions where they divide the length, else 128: the length must be a multiple of 128.
Under a sequence split it runs only as ring attention's blocks (context.strategy=ring, rows of
one document): each block one splash call on local arrays (model/ring_blocks.py
`splash_blocks`, sharding/fused_ring.py).
"""

from __future__ import annotations

import functools

from configs import Config
from model import ring_blocks
from model.attention import splash_attention
from model.attn_kernels.registry import Array, Kernel, MeshBinders, Options, register
from model.kernels import AttentionFn


@register
class Splash(Kernel):
    name = "splash"
    tile = 128
    per_device = True

    def local(self, q: Array, k: Array, v: Array, positions: Array, segment_ids: Array | None,
              opts: Options) -> Array:
        return splash_attention(q, k, v, segment_ids)

    def check_split(self, cfg: Config, context: int) -> None:
        self.check_ring_blocks(cfg, context)

    def mesh_bound(self, cfg: Config, platform: str, binders: MeshBinders) -> AttentionFn | None:
        if binders.shards > 1:
            return binders.fused_ring(ring_blocks.splash_blocks(interpret=platform != "tpu"), cfg.context.load_balance)
        return binders.per_device(functools.partial(splash_attention, interpret=platform != "tpu"))

    def planned_as(self, target: str | None) -> tuple[str, str] | None:
        if target == "tpu":
            return None
        fused = "xla" if target is None else "cudnn"
        return fused, (f"model.attention=splash is a TPU kernel: planned with {fused} attention"
                       + (" (temporaries: an upper bound)" if target is None else ""))
