"""The keys of post-training objectives (`train.objective=sft|dpo|distill`): the DPO and
distillation sections.

Kept beside configs/schema.py so that the schema references each section with one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from configs.fields import Range, Resume


@dataclass(kw_only=True)
class DPOConfig:
    """Direct preference optimization (train.objective=dpo): the policy against the frozen starting weights."""

    beta: Annotated[float, Range(gt=0)] = 0.1
    """The strength of the pull toward the reference (sigmoid: the logits' scale; ipo: 1/(2 beta) is the target margin)."""
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: -log sigmoid(beta * margin), the DPO paper; ipo: (margin - 1/(2 beta))^2 on per-token mean log-probs."""


@dataclass(kw_only=True)
class DistillConfig:
    """Knowledge distillation (train.objective=distill): the student against a frozen teacher's logits."""

    teacher: Annotated[str, Resume()] = ""
    """The teacher: a meshlm run directory (config.yaml, newest checkpoint) or a Hugging Face one (config.json)."""
    temperature: Annotated[float, Range(gt=0)] = 1.0
    """T: both softmaxes at logits / T; the KL term is scaled by T^2."""
    lm_weight: Annotated[float, Range(ge=0, le=1)] = 0.0
    """w: loss = (1 - w) T^2 KL(teacher_T || student_T) + w x the LM cross-entropy, per target token."""
