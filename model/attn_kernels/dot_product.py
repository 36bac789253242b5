"""`model.attention=dot_product`: `jax.nn.dot_product_attention` with the implementation JAX picks.

It takes one head dim for q, k and v (a narrower v, multi-head latent attention's, is padded) and
no sequence split: it would need whole keys and values in sequence order on every device.
"""

from __future__ import annotations

from model.attention import fused_attention
from model.attn_kernels.registry import Array, Kernel, Options, register


@register
class DotProduct(Kernel):
    name = "dot_product"
    one_head_dim = True

    def local(self, q: Array, k: Array, v: Array, positions: Array, segment_ids: Array | None,
              opts: Options) -> Array:
        return fused_attention(q, k, v, segment_ids, None, positions)
