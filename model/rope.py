"""YaRN rotary scaling (`model.rope_scaling`, configs/rope.py), as Hugging Face computes it for
DeepSeek-V2/V3 (transformers' `_compute_yarn_parameters` and DeepseekV3Attention's softmax
scale): the frequencies, the factor on the cosines and sines, and the factor on the softmax
scale. Computed once in float64 from the config: constants of the compiled program.
"""

from __future__ import annotations

import math

import numpy as np

from configs.rope import RopeScalingConfig


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction m(s) = 0.1 x s x ln(factor) + 1 (1 when nothing is stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _correction_dim(rotations: float, dim: int, theta: float, context: int) -> float:
    """The rotary dim whose frequency turns `rotations` times over `context` positions."""
    return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def yarn_frequencies(dim: int, theta: float, s: RopeScalingConfig) -> tuple[np.ndarray, float]:
    """The inverse frequencies [dim // 2] of a rotary part `dim` wide, and the factor its
    cosines and sines are multiplied by."""
    low = max(math.floor(_correction_dim(s.beta_fast, dim, theta, s.original_max_position_embeddings)), 0)
    high = min(math.ceil(_correction_dim(s.beta_slow, dim, theta, s.original_max_position_embeddings)), dim - 1)
    high = high + 0.001 if low == high else high  # a ramp of one point would divide by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    kept = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)  # the plain frequencies
    inv_freq = kept / s.factor * ramp + kept * (1.0 - ramp)
    if s.mscale and s.mscale_all_dim:
        attention = yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        attention = yarn_mscale(s.factor)
    return inv_freq.astype(np.float32), float(attention)


def softmax_factor(s: RopeScalingConfig) -> float:
    """What DeepSeek's attention multiplies its softmax scale by: m(mscale_all_dim)^2 under YaRN."""
    if s.type != "yarn" or not s.mscale_all_dim:
        return 1.0
    return yarn_mscale(s.factor, s.mscale_all_dim) ** 2
