"""The corpus formats (data/corpus_format/): every name `data.prepare --objective` and
`train.objective` accept is a registered format, and a batch of each, read from a tiny corpus
prepared for it, holds exactly the fields and shape its format declares, training and eval alike."""

from __future__ import annotations

import json
import math
import os
import re

import numpy as np
import pytest
from test_prepare import sentences

from configs import load_config
from configs.fields import choices
from configs.schema import TrainConfig
from conftest import ROOT
from data import batch_fields, batch_shape, corpus_format, describe, eval_batches, open_source, process_dataset
from data.addition import addition_rows
from data.examples import dpo_rows, sft_rows, write
from data.prepare import Options, main, prepare
from trainer import objectives

SMALL = ["model.seq_len=32", "train.global_batch=4"]
PACKED = ("tokens", "segment_ids", "positions")
# (format, preset, overrides, the fields and the [batch, ..., seq_len + 1] shape it must declare):
# plain documents both ways of packing, SFT, DPO, RL prompts
CASES = {
    "lm concat": ("lm", "tiny.yaml", ["data.packing=concat"], ("tokens",), (4, 33)),
    "lm document": ("lm", "tiny.yaml", ["data.packing=document"], PACKED, (4, 33)),
    "sft": ("sft", "sft-tiny.yaml", [], PACKED + ("loss_mask",), (4, 33)),
    "dpo": ("dpo", "dpo-tiny.yaml", [], ("tokens", "loss_mask"), (4, 2, 33)),
    "rl": ("rl", "tiny.yaml", [], ("tokens", "loss_mask"), (4, 33)),
}


def _cli_objectives(capsys: pytest.CaptureFixture) -> list[str]:
    """The --objective choices of the `data.prepare` command line, read from its refusal of another."""
    with pytest.raises(SystemExit):
        main(["--input", "x", "--output", "y", "--objective", "no-such-format"])
    found = re.search(r"--objective: invalid choice: .*\(choose from (.*)\)", capsys.readouterr().err)
    assert found, "data.prepare did not list its --objective choices"
    return [name.strip(" '\"") for name in found.group(1).split(",")]


def test_every_objective_the_cli_and_config_accept_is_a_format_with_fields_and_shape(capsys):
    cli = _cli_objectives(capsys)
    config = list(choices(TrainConfig, "objective"))
    # Every train.objective is a registered objective whose batches come in one of these formats.
    assert set(objectives.names()) == set(config)
    assert cli == ["lm", "sft", "dpo", "rl"] and {objectives.get(name).data_format for name in config} <= set(cli)
    assert list(corpus_format.names()) == cli
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), SMALL)
    for name in cli:
        Options(objective=name).validate()
        fmt = corpus_format.get(name)
        assert fmt.name == name
        fields, shape = batch_fields(cfg, name), batch_shape(cfg, name)
        assert fields[0] == "tokens" and len(set(fields)) == len(fields)
        assert ("loss_mask" in fields) == fmt.masked
        assert shape[0] == 4 and shape[-1] == 33 and math.prod(shape[1:-1]) == fmt.rows


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A tiny corpus prepared for each format, a quarter of it held out."""
    root = tmp_path_factory.mktemp("formats")
    with open(root / "lm.jsonl", "w") as f:
        f.writelines(json.dumps({"text": s}) + "\n" for s in sentences(200))
    write(str(root / "sft.jsonl"), sft_rows(64))
    write(str(root / "dpo.jsonl"), dpo_rows(48))
    write(str(root / "rl.jsonl"), addition_rows()[:48])
    for name in ("lm", "sft", "dpo", "rl"):
        prepare([str(root / f"{name}.jsonl")], str(root / name), progress=False, objective=name, eval_fraction=0.25)
    return {name: str(root / name) for name in ("lm", "sft", "dpo", "rl")}


@pytest.mark.parametrize("case", CASES)
def test_a_batch_of_each_format_has_the_fields_and_shape_it_declares(corpora, tmp_path, case):
    name, preset, extra, fields, shape = CASES[case]
    cfg = load_config(os.path.join(ROOT, "configs", preset), [
        f"run.dir={tmp_path / 'run'}", "data.source=prepared", f"data.path={corpora[name]}", *SMALL, *extra])
    assert (batch_fields(cfg, name), batch_shape(cfg, name)) == (fields, shape)
    sources = open_source(cfg, name)
    assert sources.fields == fields and sources.eval is not None
    train = process_dataset(sources, cfg.train.global_batch, cfg.run.seed, 0, 1)[0]
    [held] = eval_batches(sources, cfg.train.global_batch, 1, cfg.run.seed, 0, 1)
    for batch in (train, held):
        assert sorted(batch) == sorted(fields)
        assert all(batch[f].shape == shape and batch[f].dtype == np.int32 for f in fields), \
            {f: (batch[f].shape, batch[f].dtype) for f in batch}
        assert 0 <= batch["tokens"].min() and batch["tokens"].max() < cfg.model.vocab_size
        if "loss_mask" in fields:  # some tokens train and some do not
            assert 0 < batch["loss_mask"].sum() < batch["loss_mask"].size
    assert describe(sources, cfg, name).startswith("data: ")
