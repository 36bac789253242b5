"""Tokenizers: the built-in bytes, a Hugging Face `tokenizer.json`, or a SentencePiece `.model`.

`load_tokenizer(spec)` picks one from the `data.tokenizer` / `--tokenizer` value. All share one
small interface (`Tokenizer`): ids come back without BOS/EOS (the data pipeline appends `eod_id`
after every document itself), and `fingerprint()` names the exact vocabulary so a corpus prepared
with one tokenizer is never read with another.

The byte tokenizer needs no file: token i < 256 is byte i, 256 ends a document; the model's
vocab_size may be larger (padded for sharding). `tokenizers` and `sentencepiece` are optional
dependencies (`pip install 'meshlm[data]'`), imported only when such a file is named.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Protocol, Sequence

import numpy as np

import storage
from configs.schema import ConfigError

# Names that end a document in common vocabularies (GPT-2/Qwen, Llama 3, Llama 2/Mistral/T5, Gemma);
# a document separator, not a chat turn end, is what packing needs.
EOD_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
INSTALL = "pip install 'meshlm[data]'"


class Tokenizer(Protocol):
    kind: str  # "byte", "hf" or "sentencepiece"
    vocab_size: int
    eod_id: int

    def encode(self, text: str) -> np.ndarray:
        """Text -> unsigned integer ids (uint32; uint8 for bytes), no BOS/EOS added."""
        ...

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...

    def decode(self, ids: np.ndarray | Sequence[int]) -> str: ...

    def fingerprint(self) -> str:
        """'byte', or '<kind>:<sha256 of the vocabulary file>'."""
        ...

    def describe(self) -> dict[str, Any]:
        """What a prepared corpus's manifest records about its tokenizer."""
        ...


class ByteTokenizer:
    name = "byte"
    kind = "byte"
    vocab_size = 257
    eod_id = 256

    def encode(self, data: bytes | str) -> np.ndarray:
        """Bytes -> token ids (a zero-copy uint8 view; every id fits)."""
        if isinstance(data, str):
            data = data.encode("utf-8")
        return np.frombuffer(data, dtype=np.uint8)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, tokens: np.ndarray | Sequence[int]) -> str:
        return bytes(int(t) for t in tokens if 0 <= int(t) < 256).decode("utf-8", errors="replace")

    def fingerprint(self) -> str:
        return "byte"

    def describe(self) -> dict[str, Any]:
        return {"kind": "byte", "vocab_size": 257, "eod_id": 256, "fingerprint": "byte", "path": None}


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class _FileTokenizer:
    """What the file-backed tokenizers share: the path and its content hash."""

    kind = ""
    vocab_size = 0
    eod_id = 0

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self._sha = _sha256(self.path)

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        raise NotImplementedError

    def fingerprint(self) -> str:
        return f"{self.kind}:{self._sha}"

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "vocab_size": self.vocab_size,
            "eod_id": self.eod_id,
            "fingerprint": self.fingerprint(),
            "path": self.path,
        }


def _configured_eos(path: str) -> str | None:
    """The eos_token of a Hugging Face tokenizer_config.json beside the tokenizer.json, if any."""
    config = os.path.join(os.path.dirname(path), "tokenizer_config.json")
    try:
        with open(config) as f:
            eos = json.load(f).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(eos, dict):  # older files store an AddedToken as {"content": ...}
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


class HFTokenizer(_FileTokenizer):
    """A Hugging Face `tokenizers` tokenizer.json (BPE, WordPiece, Unigram, WordLevel)."""

    kind = "hf"

    def __init__(self, path: str, key: str):
        try:
            import tokenizers
        except ImportError:
            raise ConfigError(f"{key}: reading {path!r} needs the `tokenizers` package ({INSTALL})") from None
        super().__init__(path)
        try:
            self._tok = tokenizers.Tokenizer.from_file(self.path)
        except Exception as e:  # the Rust side raises a bare Exception for a malformed file
            raise ConfigError(f"{key}: {path!r} is not a readable tokenizer.json ({e})") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        eos = _configured_eos(self.path)
        names = EOD_NAMES + ((eos,) if eos else ())
        ids = [self._tok.token_to_id(n) for n in names]
        found = [i for i in ids if i is not None]
        if not found:
            raise ConfigError(
                f"{key}: {path!r} has no end-of-document token (none of {', '.join(EOD_NAMES)}); name it as "
                '{"eos_token": "..."} in a tokenizer_config.json beside it'
            )
        self.eod_id = int(found[0])
        # encode_batch_fast (tokenizers >= 0.21) skips computing character offsets we never use.
        self._encode_batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encodings = self._encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encodings]

    def decode(self, ids: np.ndarray | Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class SentencePieceTokenizer(_FileTokenizer):
    """A SentencePiece `.model` (Llama 2, T5, Gemma ...)."""

    kind = "sentencepiece"

    def __init__(self, path: str, key: str):
        try:
            import sentencepiece
        except ImportError:
            raise ConfigError(f"{key}: reading {path!r} needs the `sentencepiece` package ({INSTALL})") from None
        super().__init__(path)
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=self.path)
        except (OSError, RuntimeError) as e:
            raise ConfigError(f"{key}: {path!r} is not a readable SentencePiece model ({e})") from None
        self.vocab_size = self._sp.get_piece_size()
        self.eod_id = self._sp.eos_id()
        if self.eod_id < 0:
            raise ConfigError(f"{key}: {path!r} was trained without an end-of-sentence piece (eos_id=-1)")

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        # add_bos/add_eos pinned off: a model may have been saved with extra encode options.
        pieces = self._sp.encode(list(texts), out_type=int, add_bos=False, add_eos=False)
        return [np.asarray(p, dtype=np.uint32) for p in pieces]

    def decode(self, ids: np.ndarray | Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


def load_tokenizer(spec: str, key: str = "data.tokenizer") -> Tokenizer:
    """'byte', a tokenizer.json path or a SentencePiece .model path -> a tokenizer.
    Raises ConfigError naming `key` for a missing, unknown or unreadable file."""
    if spec == "byte":
        return ByteTokenizer()
    if storage.is_remote(spec):
        return _remote(spec, key)
    path = os.path.expanduser(spec)
    if not os.path.isfile(path):
        raise ConfigError(f"{key}: no file {spec!r} (expected 'byte', a tokenizer.json or a SentencePiece .model)")
    if path.endswith(".json"):
        return HFTokenizer(path, key)
    if path.endswith(".model"):
        return SentencePieceTokenizer(path, key)
    raise ConfigError(f"{key}: {spec!r} is neither a tokenizer.json (.json) nor a SentencePiece model (.model)")


def _remote(url: str, key: str) -> Tokenizer:
    """A tokenizer file on a bucket, read from a local copy (the libraries open local files only),
    with the tokenizer_config.json beside it, if any, copied beside the copy; it describes itself
    by its URL. The fingerprint is the content's, the same as a local copy's."""
    if not storage.exists(url) or storage.isdir(url):
        raise ConfigError(f"{key}: no file {url!r} (expected 'byte', a tokenizer.json or a SentencePiece .model)")
    beside = storage.join(storage.parent(url), "tokenizer_config.json")
    if url.endswith(".json") and storage.exists(beside):
        storage.local_copy(beside)
    local = storage.local_copy(url)
    try:
        tok = load_tokenizer(local, key)
    except ConfigError as e:  # named by the URL the user gave, not this process's copy
        raise ConfigError(str(e).replace(local, url)) from None
    tok.path = url
    return tok
