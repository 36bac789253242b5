"""The `model.mla` section: the shape of multi-head latent attention (DeepSeek-V2/V3), used when
`model.attention_type=mla` (model/mla.py).

The names and meanings are those of Hugging Face's DeepseekV3Config, so a checkpoint's
config.json maps onto them one to one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from configs.fields import Range, Resume


@dataclass(kw_only=True)
class MLAConfig:
    """Multi-head latent attention: queries and keys/values through low-rank latents."""

    # DeepSeek-V2-Lite projects the queries directly (0); DeepSeek-V3 compresses them to 1536.
    q_lora_rank: Annotated[int, Range(ge=0, hint="0: no query compression"), Resume()] = 0
    """Width of the query latent (q_a -> RMSNorm -> q_b)."""
    kv_lora_rank: Annotated[int, Range(gt=0), Resume()] = 64
    """Width of the key/value latent, the one array (with the rotary key) a decode cache keeps."""
    qk_rope_head_dim: Annotated[int, Range(gt=0), Resume()] = 16
    """Per-head query width that carries the rotary embedding; the rotary key is shared by all heads."""
    qk_nope_head_dim: Annotated[int, Range(gt=0), Resume()] = 32
    """Per-head query and key width without position (the key part expanded from the latent)."""
    v_head_dim: Annotated[int, Range(gt=0), Resume()] = 32
    """Per-head value width (the attention output per head)."""
    # DeepSeek-V3 checkpoints store the rotary dims as interleaved pairs (x0, x1), (x2, x3), ...
    rope_interleave: bool = True
    """Rotary dims as interleaved pairs (Hugging Face's rope_interleave), else split in halves."""

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim
