"""The `model.rope_scaling` section: YaRN's rotary scaling, as DeepSeek-V3's and DeepSeek-V2's
config.json have it (`rope_scaling` with type yarn), so their checkpoints import unchanged.

The names and meanings are Hugging Face's (transformers' `_compute_yarn_parameters`): the
rotary frequencies of dims that turn fewer than `beta_slow` times over the pretraining context
are divided by `factor`, those that turn more than `beta_fast` times are kept, and a linear
ramp joins them. With `mscale_all_dim` the attention's softmax scale is multiplied by
(0.1 x mscale_all_dim x ln(factor) + 1)^2, as DeepSeek's attention does (model/rope.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from configs.fields import Range


@dataclass(kw_only=True)
class RopeScalingConfig:
    """Rotary position scaling (YaRN) for a context past the pretraining one."""

    type: Literal["none", "yarn"] = "none"
    """none: plain rotary frequencies; yarn: YaRN's (Hugging Face's rope_type yarn)."""
    factor: Annotated[float, Range(ge=1.0)] = 1.0
    """How many times the pretraining context the frequencies are stretched for."""
    original_max_position_embeddings: Annotated[int, Range(gt=0)] = 4096
    """The pretraining context length the ramp's bounds are counted on."""
    beta_fast: Annotated[float, Range(gt=0)] = 32.0
    """Dims turning more than this many times over the pretraining context keep their frequency."""
    beta_slow: Annotated[float, Range(gt=0)] = 1.0
    """Dims turning fewer than this many times are divided by the factor."""
    # DeepSeek-V3 sets mscale = mscale_all_dim = 1.0: the cosines stay, the softmax scale grows.
    mscale: Annotated[float, Range(ge=0)] = 0.0
    """With mscale_all_dim, the cosines and sines scale by m(mscale) / m(mscale_all_dim) (0: by m(1))."""
    mscale_all_dim: Annotated[float, Range(ge=0, hint="0: off")] = 0.0
    """The softmax scale is multiplied by m(mscale_all_dim)^2, m(s) = 0.1 x s x ln(factor) + 1."""
