"""Supervised and preference examples for `data.prepare --objective sft|dpo`: chat templates,
the trained (assistant/completion) tokens, and the records a prepared corpus holds for them. Which
rows an example of each format is, is the format's (data/corpus_format/sft.py, dpo.py).

The chat template is the tokenizer's own: `chat_template` of the `tokenizer_config.json` beside
its `tokenizer.json` (or the file `--chat-template` names; the byte tokenizer's is
configs/byte_tokenizer_config.json), rendered by jinja2 in the sandboxed environment Hugging Face
`transformers` renders it in, so no template is written per model here. Which tokens train is
found by rendering the conversation up to each assistant turn with and without that turn: the
text between the two is the turn's, and its tokens are the ones the loss covers.

A record is little-endian uint32: token ids with bit 31 set on trained tokens (`encode`); a DPO
record is [chosen length] + chosen + rejected, each sequence prompt then response.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any, Callable

import numpy as np

import storage
from configs.schema import ConfigError

TRAINED = np.uint32(1 << 31)  # the bit that marks a trained token in a record
BYTE_TEMPLATE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                             "byte_tokenizer_config.json")
SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")

Segments = list[tuple[str, bool]]  # text pieces in order, each trained or not


class Skip(Exception):
    """A row that is no example; its message is the reason counted in the manifest."""


def template_file(tokenizer: str, chat_template: str | None) -> str:
    """The tokenizer_config.json-style file holding the chat template to use."""
    if chat_template:
        return chat_template
    if tokenizer == "byte":
        return BYTE_TEMPLATE
    return storage.join(storage.parent(storage.absolute(tokenizer)), "tokenizer_config.json")


class ChatTemplate:
    """A tokenizer's chat template, compiled once, with the special tokens it refers to."""

    def __init__(self, path: str) -> None:
        try:
            config = json.loads(storage.read_text(path))  # beside a tokenizer on a bucket, or on disk
            source = config["chat_template"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"--chat-template: {path}: no readable chat_template ({e!r}); name a "
                              "tokenizer_config.json that has one") from None
        if isinstance(source, list):  # several named templates: the default one
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if not isinstance(source, str):
            raise ConfigError(f"--chat-template: {path}: chat_template is not a template string")
        self.path, self.source = path, source
        self.tokens = {k: _token_text(config.get(k)) for k in SPECIAL}
        try:
            import jinja2
        except ImportError:
            raise ConfigError("--objective: chat templates need the `jinja2` package (pip install 'meshlm[data]')") from None

        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as e:
            raise ConfigError(f"--chat-template: {path}: the chat_template does not compile ({e})") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.tokens)


def _token_text(value: Any) -> str:
    """A special token of tokenizer_config.json: a string or an AddedToken-like dict."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def _environment() -> Any:
    """The jinja2 environment `transformers` renders chat templates in (same options and globals)."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (templates that mark assistant text for
        transformers' mask) renders its body; the trained text is found by rendering instead."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, Generation])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _messages(value: Any, key: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise Skip(f"bad_{key}")
    for m in value:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise Skip(f"bad_{key}")
    return value


def chat_segments(template: ChatTemplate, messages: list[dict], trained_from: int = 0) -> Segments:
    """The rendered conversation cut into pieces; the assistant turns at index >= `trained_from`
    are trained. Raises Skip when there is none, or the template does not render turn by turn."""
    import jinja2

    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant" and k >= trained_from]
    if not turns:
        raise Skip("no_assistant")
    try:
        full = template.render(messages)
        cuts = [(template.render(messages[:k], True), template.render(messages[: k + 1])) for k in turns]
    except jinja2.TemplateError:
        raise Skip("template_error") from None
    out: Segments = []
    at = 0
    for before, through in cuts:
        start, stop = len(before), len(through)
        if not (full.startswith(through) and through.startswith(before)) or start < at or stop <= start:
            raise Skip("template_not_incremental")
        out += [(full[at:start], False), (full[start:stop], True)]
        at = stop
    out.append((full[at:], False))
    return [(text, trained) for text, trained in out if text]


def conversation_segments(template: ChatTemplate, value: Any) -> Segments:
    """A `messages` value -> the rendered conversation, every assistant turn trained. Raises Skip."""
    return chat_segments(template, _messages(value, "messages"))


def prompt_segments(obj: dict, template: ChatTemplate, responses: tuple[str, ...]) -> list[Segments]:
    """A {"prompt", *responses} row -> one sequence per response, the prompt then that response.

    Strings are joined as they are (prompt untrained, response trained); lists of messages go
    through the chat template (the response's assistant turns trained). Raises Skip naming the
    first missing key."""
    for key in ("prompt",) + responses:
        if key not in obj:
            raise Skip(f"no_{key}")
    prompt = obj["prompt"]
    if isinstance(prompt, str):
        if not all(isinstance(obj[k], str) for k in responses):
            raise Skip("not_string")
        return [[(prompt, False), (obj[k], True)] for k in responses]
    prompt = _messages(prompt, "prompt")
    return [chat_segments(template, prompt + _messages(obj[k], k), len(prompt)) for k in responses]


def encode(segments: Segments, encode_batch: Callable[[list[str]], list[np.ndarray]]) -> np.ndarray:
    """Segments -> one uint32 sequence with TRAINED set on the trained segments' tokens. Raises
    Skip if no trained token is left."""
    ids = encode_batch([text for text, _ in segments])
    parts = [np.asarray(t, np.uint32) | (TRAINED if trained else np.uint32(0)) for t, (_, trained) in zip(ids, segments)]
    seq = np.concatenate(parts) if parts else np.zeros(0, np.uint32)
    if not np.any(seq & TRAINED):
        raise Skip("no_trained_tokens")
    return seq


def decode_sequence(record: np.ndarray, eod_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, trained as 0/1) of one encoded sequence, with the end-of-document token appended,
    trained when the sequence's last token is (the model learns to end its answer)."""
    tokens = np.append(record & ~TRAINED, np.uint32(eod_id)).astype(np.int32)
    mask = (record & TRAINED) != 0
    return tokens, np.append(mask, mask[-1] if len(mask) else False).astype(np.int32)


def encode_pair(chosen: np.ndarray, rejected: np.ndarray) -> np.ndarray:
    """The record of a DPO example: [chosen length] + chosen + rejected (each from `encode`)."""
    return np.concatenate([np.array([len(chosen)], np.uint32), chosen, rejected])


def decode_pair(record: np.ndarray, eod_id: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """[(tokens, mask) of chosen, (tokens, mask) of rejected] of a DPO record."""
    n = int(record[0])
    return [decode_sequence(record[1 : 1 + n], eod_id), decode_sequence(record[1 + n :], eod_id)]
