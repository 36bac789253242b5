"""`sft`: supervised examples as documents with a loss mask of the assistant (completion) tokens,
packed whole (`data.packing=document`, which keeps conversations apart; configs/validate.py).

`data.prepare --objective sft` reads JSONL lines or parquet rows: {"messages": [...]} through the chat template,
every assistant turn trained, or {"prompt", "completion"}; a record is one sequence with bit 31
set on the trained tokens (data/chat.py).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from data.chat import ChatTemplate, Skip, conversation_segments, encode, prompt_segments
from data.corpus_format.lm import PlainDocuments
from data.corpus_format.registry import register


@register
class SupervisedDocuments(PlainDocuments):
    """PlainDocuments whose rows carry the loss mask of the tokens that train (`train.objective=sft`)."""

    name = "sft"
    masked = True
    examples = True

    def record(self, obj: Any, template: ChatTemplate,
               encode_batch: Callable[[list[str]], list[np.ndarray]]) -> np.ndarray:
        if not isinstance(obj, dict):
            raise Skip("not_object")
        if "messages" in obj:
            return encode(conversation_segments(template, obj["messages"]), encode_batch)
        if "prompt" not in obj:  # neither form: counted as the chat form's missing key
            raise Skip("no_messages")
        [segments] = prompt_segments(obj, template, ("completion",))
        return encode(segments, encode_batch)
