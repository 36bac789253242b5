"""`train.objective=sft`: supervised fine-tuning, the next-token loss on the tokens a corpus
marks as trained (an assistant's turns: `data.prepare --objective sft`, data/chat.py), the
conversations packed apart (document packing). The loss is the LM's (trainer/objectives/lm.py)
with the corpus's loss mask; the step also reports how many tokens it trained on.
"""

from __future__ import annotations

from typing import Any

import jax

from trainer.objectives.lm import LM, terms_console
from trainer.objectives.registry import check_prepared, register, require

Array = jax.Array


@register
class SFT(LM):
    name = "sft"
    data_format = "sft"

    def check(self) -> None:
        cfg = self.cfg
        check_prepared(cfg)
        require(cfg.data.packing == "document", "data.packing", "train.objective=sft needs document packing, which "
                "keeps conversations apart")

    def step_metrics(self, aux: Any) -> dict[str, Array]:
        return {"trained_tokens": jax.tree.leaves(aux)[0], **super().step_metrics(aux)}

    def console(self, record: dict[str, float]) -> list[str]:
        return terms_console(self.cfg, record, [f"trained {record['trained_tokens']:,.0f} tok"])
