"""Multi-head latent attention (DeepSeek-V2/V3), `model.attention_type=mla`, shaped by `model.mla`.

Queries come from x directly (`q`) or through a normed low-rank latent (`q_a`, `q_norm`, `q_b`).
Keys and values come from one shared latent per token: `kv_a` gives the latent (normed by
`kv_norm`) and a rotary key shared by all heads; `kv_b` expands the latent into each head's key
part without position and its value. A head's query and key are its position-free part followed
by its rotary part (the decoupled RoPE), so attention scores by (qk_nope_head_dim +
qk_rope_head_dim) ** -0.5 (times YaRN's softmax factor under `model.rope_scaling`, model/rope.py)
and returns v_head_dim per head, then `o` projects back.

The layout follows Hugging Face's DeepseekV3Attention: a projection `W` ([out, in]) there is
our `W.T` reshaped to named dims (q_b_proj -> q_b [q_lora_rank, heads, qk_head_dim], kv_b_proj ->
kv_b [kv_lora_rank, heads, qk_nope_head_dim + v_head_dim], kv_a_proj_with_mqa -> kv_a [embed,
kv_lora_rank + qk_rope_head_dim], o_proj -> o [heads, v_head_dim, embed]), its q_a_layernorm and
kv_a_layernorm are `q_norm` and `kv_norm`, and `model.mla.rope_interleave` is its rope_interleave.

The attention itself is the model's (model/attention.py `attend`), with every kernel and sharded
kernel, so the data, fsdp, tensor, context and pipeline layouts run it unchanged; the latent dims
are named `latent` (stored sharded over fsdp by default, whole in compute). Decoding keeps only
the latent and the rotary key per token (model/decode.py). LoRA adapters (model/lora.py) may sit
on `o` and, without a query latent, on `q`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from configs.schema import ModelConfig
from model.attention import attend
from model.attn_kernels.registry import Options
from model.inputs import TokenInputs
from model.layers import RMSNorm, constrain, param, project, project_adapted, rotary
from model.rope import softmax_factor

Array = jax.Array

# DeepSeek's reference code and Hugging Face norm the latents with this epsilon, not the model's.
LATENT_NORM_EPS = 1e-6


class MLAttention(nnx.Module):
    """Multi-head latent attention; called like `Attention` (model/layers.py)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        m, d, h = cfg.mla, cfg.d_model, cfg.num_heads
        init = nnx.initializers.normal(cfg.init_std)
        if m.q_lora_rank:
            self.q_a = param(rngs, init, (d, m.q_lora_rank), ("embed", "latent"))
            self.q_norm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS, rngs=rngs, axis="latent")
            self.q_b = param(rngs, init, (m.q_lora_rank, h, m.qk_head_dim), ("latent", "heads", "head_dim"))
        else:
            self.q = param(rngs, init, (d, h, m.qk_head_dim), ("embed", "heads", "head_dim"))
        self.kv_a = param(rngs, init, (d, m.kv_lora_rank + m.qk_rope_head_dim), ("embed", "latent"))
        self.kv_norm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS, rngs=rngs, axis="latent")
        self.kv_b = param(rngs, init, (m.kv_lora_rank, h, m.qk_nope_head_dim + m.v_head_dim),
                          ("latent", "heads", "head_dim"))
        self.o = param(rngs, init, (h, m.v_head_dim, d), ("heads", "head_dim", "embed"))
        self.cfg = cfg

    def __call__(self, x: Array, inputs: TokenInputs) -> Array:
        """Normed x [b, l, d] and the layer's per-token inputs (model/inputs.py) -> [b, l, d]."""
        q, k, v = self.project(x, inputs)
        return self.output(attend(q, k, v, inputs, impl=self.cfg.attention,
                                  opts=Options(self.cfg.max_documents, self.cfg.attention_chunk)), inputs)

    def rope(self, x: Array, positions: Array) -> Array:
        """The rotary embedding of x [b, l, heads, qk_rope_head_dim]. Interleaved pairs are
        first gathered as (evens, odds), which is how Hugging Face's interleaved rotary writes
        its output too; both q and k get the same order, so their products are unchanged."""
        if self.cfg.mla.rope_interleave:
            x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        return rotary(x, positions, self.cfg.rope_theta, self.cfg.rope_scaling)

    def queries(self, x: Array, inputs: TokenInputs) -> tuple[Array, Array]:
        """x [b, l, d] -> each head's position-free query [b, l, heads, qk_nope_head_dim] and
        rotary query [b, l, heads, qk_rope_head_dim], rotary applied at `inputs.positions` (`q`'s
        LoRA adapter, if any, under the layer's dropout)."""
        if self.cfg.mla.q_lora_rank:
            latent = constrain(project("bld,dr->blr", x, self.q_a, self.cfg), ("batch", "length", "latent"))
            q = project("blr,rhk->blhk", self.q_norm(latent), self.q_b, self.cfg)
        else:
            q = project_adapted(self, "q", "bld,dhk->blhk", x, inputs)
        factor = softmax_factor(self.cfg.rope_scaling)
        if factor != 1.0:  # DeepSeek's YaRN softmax scale: every kernel scales by head_dim ** -0.5 alone
            q = q * jnp.asarray(factor, q.dtype)
        q = constrain(q, ("batch", "length", "heads", "head_dim"))
        nope = self.cfg.mla.qk_nope_head_dim
        return q[..., :nope], self.rope(q[..., nope:], inputs.positions)

    def latents(self, x: Array, positions: Array) -> tuple[Array, Array]:
        """x [b, l, d] -> the normed key/value latent [b, l, kv_lora_rank] and the rotary key
        [b, l, qk_rope_head_dim] shared by every head, rotary applied: all a cache keeps."""
        both = constrain(project("bld,dr->blr", x, self.kv_a, self.cfg), ("batch", "length", "latent"))
        rank = self.cfg.mla.kv_lora_rank
        return self.kv_norm(both[..., :rank]), self.rope(both[..., None, rank:], positions)[:, :, 0]

    def project(self, x: Array, inputs: TokenInputs) -> tuple[Array, Array, Array]:
        """x [b, l, d] -> q, k [b, l, heads, qk_head_dim] and v [b, l, heads, v_head_dim]."""
        q_nope, q_rope = self.queries(x, inputs)
        latent, k_rope = self.latents(x, inputs.positions)
        kv = project("blr,rhk->blhk", latent, self.kv_b, self.cfg)
        nope = self.cfg.mla.qk_nope_head_dim
        k_rope = jnp.broadcast_to(k_rope[:, :, None], (*kv.shape[:3], k_rope.shape[-1]))
        q = constrain(jnp.concatenate([q_nope, q_rope], axis=-1), ("batch", "length", "heads", "head_dim"))
        k = constrain(jnp.concatenate([kv[..., :nope], k_rope], axis=-1), ("batch", "length", "kv_heads", "head_dim"))
        return q, k, constrain(kv[..., nope:], ("batch", "length", "kv_heads", "head_dim"))

    def output(self, out: Array, inputs: TokenInputs | None = None) -> Array:
        """Attention output [b, l, heads, v_head_dim] -> [b, l, d] (`o`'s LoRA adapter, if any, under
        the layer's dropout; None: none, as in decoding)."""
        out = constrain(out, ("batch", "length", "heads", "head_dim"))
        return project_adapted(self, "o", "blhk,hkd->bld", out, inputs)
