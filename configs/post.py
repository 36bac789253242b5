"""The keys of post-training objectives (`train.objective=sft|dpo`): the DPO section.

Kept beside configs/schema.py so that the schema references the section with one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from configs.fields import Range


@dataclass(kw_only=True)
class DPOConfig:
    """Direct preference optimization (train.objective=dpo): the policy against the frozen starting weights."""

    beta: Annotated[float, Range(gt=0)] = 0.1
    """The strength of the pull toward the reference (sigmoid: the logits' scale; ipo: 1/(2 beta) is the target margin)."""
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: -log sigmoid(beta * margin), the DPO paper; ipo: (margin - 1/(2 beta))^2 on per-token mean log-probs."""
