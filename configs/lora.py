"""The `model.lora` section: low-rank adapters on the block projections (model/lora.py).

Its own file so that the schema's sections stay one concern each; configs/schema.py names it
once, as the field `ModelConfig.lora`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from configs.fields import Range, Resume

# The block projections an adapter may sit on, in the order Hugging Face's PEFT names them.
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass(kw_only=True)
class LoraConfig:
    """LoRA: trainable low-rank adapters beside frozen block weights (model/lora.py); rank 0: off."""

    rank: Annotated[int, Range(ge=0, hint="0: off"), Resume()] = 0
    """The adapters' rank r; > 0 freezes every base weight and trains the adapters only."""
    alpha: Annotated[float, Range(gt=0)] = 16.0
    """The adapters' output is scaled by alpha / rank (as PEFT's lora_alpha)."""
    dropout: Annotated[float, Range(ge=0, lt=1)] = 0.0
    """Dropout on each adapter's input in training steps (PEFT's lora_dropout); never in eval or generation."""
    targets: Annotated[list[Literal["q", "k", "v", "o", "gate", "up", "down"]], Resume()] = field(
        default_factory=lambda: ["q", "k", "v", "o"])
    """The projections that get an adapter (gate, up, down: dense SwiGLU only; MLA: o, and q without a q latent)."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0
