"""The on-disk contract of a prepared corpus (`python -m data.prepare`), and its validation.

A prepared directory holds:
- `train-00000-of-0000N.array_record` ... and `eval-00000-of-0000M.array_record` (none when the
  eval fraction is 0): ArrayRecord files (group_size 1, for random access), one record per
  document, its token ids as little-endian uint32 without an end-of-document token;
- `train.lengths.npy`, `eval.lengths.npy`: int64, the token count of every record in order;
- `manifest.json`: tokenizer, format, inputs with their bad-data counts, splits (each with its
  shards' sizes and sha256, `shard_bytes` and `shard_sha256`; absent in older corpora), content hash,
  and the `objective` it was prepared for (absent: `lm`). An `sft` corpus's records carry the
  loss mask in bit 31 of each id, a `dpo` corpus's record is one preference pair; `chat_template`
  names the template they were rendered with (data/chat.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import re

import numpy as np

from configs.schema import ConfigError

FORMAT_VERSION = 1
SPLITS = ("train", "eval")
MANIFEST = "manifest.json"
_OWN_FILE = re.compile(r"(manifest\.json|(train|eval)\.lengths\.npy|(train|eval)-\d{5}-of-\d{5}\.array_record)")


def shard_name(split: str, index: int, count: int) -> str:
    return f"{split}-{index:05d}-of-{count:05d}.array_record"


def lengths_name(split: str) -> str:
    return f"{split}.lengths.npy"


def is_prepared_file(name: str) -> bool:
    """Whether a file name is one that `data.prepare` writes (so replacing it loses nothing else)."""
    return _OWN_FILE.fullmatch(name) is not None


def _feed(path: str, hashes: tuple) -> int:
    """Feeds the file at `path` to every hash of `hashes`; its size in bytes."""
    size = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            for h in hashes:
                h.update(block)
            size += len(block)
    return size


def corpus_digests(directory: str, splits: dict[str, list[str]]) -> tuple[str, dict[str, dict]]:
    """One read of every file: the content hash (sha256 over every shard's bytes then the lengths
    file, split by split), and per split its shards' sizes and sha256 (`shard_bytes`,
    `shard_sha256`), which let a reader tell a truncated shard at open and, asked to
    (`data.verify`), a changed one."""
    whole, per_split = hashlib.sha256(), {}
    for split in SPLITS:
        sizes, hashes = [], []
        for name in splits.get(split, []):
            own = hashlib.sha256()
            sizes.append(_feed(os.path.join(directory, name), (whole, own)))
            hashes.append(own.hexdigest())
        _feed(os.path.join(directory, lengths_name(split)), (whole,))
        per_split[split] = {"shard_bytes": sizes, "shard_sha256": hashes}
    return whole.hexdigest(), per_split


def differing_shard(manifest: dict, per_split: dict[str, dict], fields: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, field) of the first shard whose `fields` (`shard_bytes`, `shard_sha256`) as the
    manifest records them differ from `per_split` (corpus_digests' of the files at hand); a field
    the manifest lacks is not compared. None when they agree."""
    for split in SPLITS:
        recorded = manifest["splits"][split]
        for i, name in enumerate(recorded["shards"]):
            for field in fields:
                if field in recorded and per_split[split][field][i] != recorded[field][i]:
                    return name, field
    return None


def verify_shards(directory: str, manifest: dict) -> None:
    """Every shard's bytes against the sha256 the manifest records (`data.verify=true`; a corpus
    prepared before shards had their own hashes is checked against its content hash as a whole).
    Raises ConfigError naming the first shard that differs."""
    splits = manifest["splits"]
    whole, per_split = corpus_digests(directory, {s: splits[s]["shards"] for s in SPLITS})
    if not all("shard_sha256" in splits[s] for s in SPLITS):
        if whole != manifest.get("content_hash"):
            raise ConfigError(f"{directory}: its shards' content hash differs from the manifest's (data.verify); "
                              "prepare the corpus again (python -m data.prepare)")
        return
    if bad := differing_shard(manifest, per_split, ("shard_sha256",)):
        raise ConfigError(f"{os.path.join(directory, bad[0])}: its sha256 differs from the manifest's "
                          "(data.verify): the shard is damaged or was changed; prepare the corpus again "
                          "(python -m data.prepare)")


def read_manifest(directory: str, key: str = "data.path") -> dict:
    """The manifest of a prepared directory, after checking that every shard and lengths file it
    names is there and that the lengths match the documents counted. Raises ConfigError with one
    line naming the file at fault (`key` names the setting that pointed here)."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        raise ConfigError(f"{key}: {directory!r} is not a prepared corpus (no {MANIFEST}); run python -m data.prepare")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: unreadable manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        version = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise ConfigError(f"{path}: format_version {version!r}, this reader knows {FORMAT_VERSION}; prepare it again")
    try:
        tokenizer, splits = manifest["tokenizer"], manifest["splits"]
        tokenizer["fingerprint"], tokenizer["eod_id"], tokenizer["vocab_size"]  # noqa: B018 - must exist
        for split in SPLITS:
            splits[split]["documents"], splits[split]["tokens"], splits[split]["shards"]  # noqa: B018
    except (KeyError, TypeError) as e:
        raise ConfigError(f"{path}: the manifest lacks {e}; prepare it again") from None
    for split in SPLITS:
        info = splits[split]
        for i, shard in enumerate(info["shards"]):
            path = os.path.join(directory, shard)
            if not os.path.isfile(path):
                raise ConfigError(f"{path}: shard named in the manifest is missing")
            if "shard_bytes" in info and os.path.getsize(path) != info["shard_bytes"][i]:
                raise ConfigError(f"{path}: {os.path.getsize(path)} bytes, the manifest says {info['shard_bytes'][i]}: "
                                  "the shard is truncated or was changed; prepare the corpus again "
                                  "(python -m data.prepare)")
        lengths_path = os.path.join(directory, lengths_name(split))
        try:
            lengths = np.load(lengths_path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{lengths_path}: missing or unreadable ({e}); prepare it again") from None
        if lengths.ndim != 1 or len(lengths) != info["documents"] or int(lengths.sum()) != info["tokens"]:
            raise ConfigError(
                f"{lengths_path}: {len(lengths)} lengths summing to {int(lengths.sum())} tokens, the manifest says "
                f"{info['documents']} documents of {info['tokens']} tokens; prepare it again"
            )
    return manifest
