"""`rl`: prompts with reference answers, for reinforcement learning from verifiable rewards.

`data.prepare --objective rl` reads JSONL lines or parquet rows {"prompt", "answer"}: a string prompt is used as
it is (the toy task's "37+48=", data/addition.py), a list of messages goes through the chat
template with the generation prompt after it (as SFT's); the answer is a string. A record is SFT's
(data/chat.py): the prompt's tokens, then the answer's with the trained bit set.

An element is {"tokens", "loss_mask"} int32 [seq_len + 1], nothing packed: the prompt, the answer
and the end-of-document token, padded with it, the mask marking the answer and its end. The
learner samples its own completions from the prompt and scores them against the answer, so a
batch's prompts and answers come apart on the host (`prompts_and_answers`): each prompt
left-padded to one length, so that one decoding program serves every batch.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from configs.schema import Config
from data.chat import ChatTemplate, Skip, decode_sequence, encode
from data.corpus_format.registry import CorpusFormat, DataSources, open_examples, register
from data.shards import RecordRows
from data.tokenizer import Tokenizer


class PromptRows(RecordRows):
    """One split of an RL corpus as padded rows of prompt, answer and end token."""

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        seq, answer = decode_sequence(np.frombuffer(self.source[index], "<u4"), self.eod_id)
        # Too long: the prompt loses its start first, so that the whole answer stays if it can.
        start = min(max(len(seq) - self.capacity, 0), int(np.argmax(answer)))
        n = min(len(seq) - start, self.capacity)
        tokens = np.full(self.capacity, self.eod_id, np.int32)
        mask = np.zeros(self.capacity, np.int32)
        tokens[:n], mask[:n] = seq[start:start + n], answer[start:start + n]
        return {"tokens": tokens, "loss_mask": mask}


def prompts_and_answers(tokens: np.ndarray, mask: np.ndarray, prompt_len: int,
                        eod_id: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """A batch of rows ([rows, seq_len + 1] tokens and answer mask) -> (prompts int32 [rows,
    prompt_len] left-padded with the end token, the padding of each [rows], each row's answer
    tokens without its end token). A prompt longer than prompt_len keeps its last tokens."""
    prompts = np.full((len(tokens), prompt_len), eod_id, np.int32)
    pad = np.zeros(len(tokens), np.int32)
    answers = []
    for r, (row, trained) in enumerate(zip(np.asarray(tokens), np.asarray(mask))):
        first = int(np.argmax(trained)) if trained.any() else len(row)
        prompt = row[max(first - prompt_len, 0):first]
        prompts[r, prompt_len - len(prompt):], pad[r] = prompt, prompt_len - len(prompt)
        answer = row[trained != 0]
        answers.append(answer[:-1] if len(answer) and answer[-1] == eod_id else answer)
    return prompts, pad, answers


@register
class Prompts(CorpusFormat):
    """Prompts with reference answers (`train.objective=grpo` reads them)."""

    name = "rl"
    masked = True
    examples = True

    def fields(self, cfg: Config) -> tuple[str, ...]:
        return ("tokens", "loss_mask")  # padded rows, no documents to tell apart

    def open(self, cfg: Config, tokenizer: Tokenizer) -> DataSources:
        return open_examples(cfg, tokenizer, self.name, PromptRows, "prompts")

    def describe(self, sources: DataSources, cfg: Config) -> str:
        prompts = sum(len(r) for r, _ in sources.train)
        held = f", {len(sources.eval)} held-out prompts" if sources.eval is not None else ""
        return f"data: {prompts} prompts with answers, rows of {cfg.model.seq_len + 1} tokens{held}"

    def record(self, obj: Any, template: ChatTemplate,
               encode_batch: Callable[[list[str]], list[np.ndarray]]) -> np.ndarray:
        if not isinstance(obj, dict):
            raise Skip("not_object")
        for key in ("prompt", "answer"):
            if key not in obj:
                raise Skip(f"no_{key}")
        prompt, answer = obj["prompt"], obj["answer"]
        if not isinstance(answer, str) or not answer:
            raise Skip("bad_answer")
        if not isinstance(prompt, str):  # messages: rendered with the assistant's turn opened after them
            messages = prompt if isinstance(prompt, list) and prompt else None
            if messages is None or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
                raise Skip("bad_prompt")
            prompt = template.render(messages, add_generation_prompt=True)
        if not prompt:
            raise Skip("bad_prompt")
        return encode([(prompt, False), (answer, True)], encode_batch)
