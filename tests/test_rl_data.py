"""Reinforcement learning's data: the toy addition task (data/addition.py), its prepared corpus
(`data.prepare --objective rl`, data/corpus_format/rl.py), and a batch's prompts and answers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from data import corpus_format
from data.addition import addition_rows, main as addition_main
from data.chat import ChatTemplate, template_file
from data.corpus_format.rl import PromptRows, prompts_and_answers
from data.prepare import prepare
from data.tokenizer import load_tokenizer

EOD = 256  # the byte tokenizer's end-of-document id


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The toy task written by its script, and addition.jsonl prepared with the same fraction."""
    root = tmp_path_factory.mktemp("addition")
    assert addition_main(["--output", str(root), "--eval-fraction", "0.1"]) == 0
    manifest = prepare([str(root / "addition.jsonl")], str(root / "prepared"), progress=False, objective="rl",
                       eval_fraction=0.1)
    read = lambda name: [json.loads(line) for line in open(root / f"{name}.jsonl")]  # noqa: E731
    return {"root": root, "manifest": manifest, **{name: read(name) for name in ("addition", "train", "heldout")}}


def test_the_toy_task_is_every_sum_below_100_in_a_fixed_order(toy, tmp_path):
    rows = toy["addition"]
    assert len(rows) == 100 * 100 and rows == addition_rows()
    assert {"prompt": "37+48=", "answer": "85", "completion": "85"} in rows
    for row in rows:
        a, b = row["prompt"].rstrip("=").split("+")
        assert int(a) < 100 and int(b) < 100 and row["answer"] == str(int(a) + int(b))
    assert addition_main(["--output", str(tmp_path)]) == 0  # a rerun writes the same bytes
    assert (tmp_path / "addition.jsonl").read_bytes() == (toy["root"] / "addition.jsonl").read_bytes()


def test_the_held_out_split_is_the_prepared_corpus_eval_split(toy):
    train, held = toy["train"], toy["heldout"]
    assert 800 < len(held) < 1200 and len(train) + len(held) == 10_000
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    splits = toy["manifest"]["splits"]
    assert (splits["train"]["documents"], splits["eval"]["documents"]) == (len(train), len(held))
    # The prepared held-out rows are heldout.jsonl's, in its order.
    rows = PromptRows(str(toy["root"] / "prepared"), splits["eval"]["shards"], EOD, 15)
    tokenizer = load_tokenizer("byte")
    first = rows[0]
    assert first["tokens"].shape == first["loss_mask"].shape == (16,)
    text = held[0]["prompt"] + held[0]["answer"]
    assert tokenizer.decode(first["tokens"][:len(text)].tolist()) == text
    assert first["tokens"][len(text)] == EOD
    # The mask: the answer and its end token.
    np.testing.assert_array_equal(np.nonzero(first["loss_mask"])[0],
                                  np.arange(len(held[0]["prompt"]), len(text) + 1))


def test_a_batch_comes_apart_into_left_padded_prompts_and_answers(toy):
    tokenizer = load_tokenizer("byte")
    splits = toy["manifest"]["splits"]
    rows = PromptRows(str(toy["root"] / "prepared"), splits["train"]["shards"], EOD, 15)
    batch = [rows[i] for i in range(4)]
    tokens, mask = np.stack([b["tokens"] for b in batch]), np.stack([b["loss_mask"] for b in batch])
    prompts, pad, answers = prompts_and_answers(tokens, mask, 8, EOD)
    assert prompts.shape == (4, 8) and prompts.dtype == np.int32
    for r, row in enumerate(toy["train"][:4]):
        assert pad[r] == 8 - len(row["prompt"]) and np.all(prompts[r, :pad[r]] == EOD)
        assert tokenizer.decode(prompts[r, pad[r]:].tolist()) == row["prompt"]
        assert tokenizer.decode(answers[r].tolist()) == row["answer"] and len(answers[r]) == len(row["answer"])
    # A prompt longer than the room keeps its end: the tokens right before the answer.
    short, pad, _ = prompts_and_answers(tokens, mask, 3, EOD)
    assert np.all(pad == 0)
    assert tokenizer.decode(short[0].tolist()) == toy["train"][0]["prompt"][-3:]


def test_a_chat_prompt_gets_the_generation_prompt_and_bad_rows_are_skipped():
    from data.chat import Skip

    fmt, template = corpus_format.get("rl"), ChatTemplate(template_file("byte", None))
    tokenizer = load_tokenizer("byte")
    messages = [{"role": "user", "content": "2+2="}]
    record = fmt.record({"prompt": messages, "answer": "4"}, template, tokenizer.encode_batch)
    trained = (record >> 31) != 0
    prompt = tokenizer.decode((record[~trained]).tolist())
    assert prompt == template.render(messages, add_generation_prompt=True) and "2+2=" in prompt
    assert tokenizer.decode((record[trained] & 0x7FFFFFFF).tolist()) == "4"
    for row, why in [({"prompt": "1+1="}, "no_answer"), ({"prompt": "1+1=", "answer": 2}, "bad_answer"),
                     ({"prompt": [{"text": "x"}], "answer": "2"}, "bad_prompt"), ([1], "not_object")]:
        with pytest.raises(Skip, match=why):
            fmt.record(row, template, tokenizer.encode_batch)


def test_parquet_rows_prepare_as_their_jsonl_lines(toy, tmp_path):
    """The same prompts and answers as a parquet file (one row per example, the jsonl line's keys
    as columns) prepare to the same corpus: the same records in each split, byte for byte."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    rows = toy["addition"][:300]
    (tmp_path / "rl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "rl.parquet"), row_group_size=64)
    splits = {fmt: prepare([str(tmp_path / f"rl.{fmt}")], str(tmp_path / fmt), progress=False, objective="rl",
                           eval_fraction=0.2)["splits"] for fmt in ("jsonl", "parquet")}
    assert 0 < splits["parquet"]["eval"]["documents"] < splits["parquet"]["train"]["documents"]
    for split in ("train", "eval"):
        assert splits["parquet"][split]["shard_sha256"] == splits["jsonl"][split]["shard_sha256"], split
