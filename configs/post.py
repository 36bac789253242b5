"""The keys of post-training objectives (`train.objective=sft|dpo|distill`, and reinforcement
learning's rollouts and rewards): the DPO, distillation and RL sections.

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


@dataclass(kw_only=True)
class RLConfig:
    """Reinforcement learning from verifiable rewards (GRPO, docs/rl.md): rollouts, rewards and the clipped loss."""

    group_size: Annotated[int, Range(ge=2)] = 8
    """Completions sampled per prompt; each one's advantage is its reward normalized within its group."""
    max_new_tokens: Annotated[int, Range(gt=0)] = 16
    """The most tokens a completion has; sampling stops earlier at end-of-text."""
    temperature: Annotated[float, Range(gt=0)] = 1.0
    """Sampling temperature of the rollouts (> 0: a group needs different completions to compare)."""
    top_k: Annotated[int, Range(ge=0, hint="0: all")] = 0
    """Rollouts draw among the k most likely tokens only."""
    top_p: Annotated[float, Range(gt=0, le=1, hint="1: all")] = 1.0
    """Rollouts draw among the most likely tokens whose probabilities add up to p (nucleus sampling)."""
    clip: Annotated[float, Range(gt=0, lt=1)] = 0.2
    """The importance ratio is clipped to [1 - clip, 1 + clip] in the policy-gradient loss."""
    kl_coef: Annotated[float, Range(ge=0, hint="0: no reference copy")] = 0.04
    """Weight of the k3 KL estimate to the frozen starting weights, per completion token."""
    updates_per_rollout: Annotated[int, Range(gt=0)] = 1
    """Optimizer updates on one batch of rollouts before sampling the next."""
    loss_averaging: Literal["token", "sequence"] = "token"
    """token: every completion token weighs the same over the batch; sequence: each completion's token mean, then their mean."""
    reward: str = "exact_match"
    """Rewards added up, comma-separated: exact_match, length_penalty, or a function by path pkg.module:fn."""
    answer_format: str = ""
    """exact_match's format check: a regex the whole completion must match, else reward 0 ("": none)."""
    length_penalty: Annotated[float, Range(ge=0)] = 0.01
    """length_penalty's reward: minus this times the completion's length in characters."""
