"""The embedding lookup under FSDP (sharding/lookup.py): the table stays split, the tokens are
gathered and the looked-up rows traded by all-to-alls, on every layout that splits the table's
`embed` dim, without the partitioner rematerializing anything; elsewhere the model's own lookup.
The losses are those of one device (tests/test_sharding.py, tests/test_golden.py)."""

from __future__ import annotations

import re

import pytest

from sharding.lookup import traded_lookup
from planner.compiled import collective_counts
from trainer import abstract_program
from trainer.layout import plan_layout

UNTIED = "model.tie_embeddings=false"  # a tied head needs the whole table anyway


def _results(text: str, op: str) -> list[str]:
    return re.findall(rf"= (\S+) {op}(?:-start)?\(", text)


@pytest.mark.parametrize("layout", [["mesh.fsdp=8"], ["mesh.data=2", "mesh.fsdp=4"],
                                    ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"], ["mesh.fsdp=4", "mesh.context=2"]])
def test_fsdp_trades_rows_instead_of_gathering_the_table(tiny, capfd, layout) -> None:
    cfg = tiny(*layout, UNTIED)
    text = abstract_program(cfg).lower().compile().as_text()
    assert "Involuntary full rematerialization" not in capfd.readouterr().err
    table = rf"\w+\[{cfg.model.vocab_size},{cfg.model.d_model}\]"
    table_gathers = [r for r in _results(text, "all-gather") if re.match(table, r)]
    traded = "mesh.context=2" not in layout  # under a sequence split: the model's own lookup
    # Traded: no gather of the whole table, the tokens (s32) gathered, rows traded forward and back.
    assert bool(table_gathers) != traded, table_gathers
    assert any(r.startswith("s32[") for r in _results(text, "all-gather")) == traded
    assert (collective_counts(text)["all-to-all"] >= 2) == traded


def test_the_lookup_is_chosen_by_the_layout(tiny) -> None:
    def chosen(*overrides: str) -> bool:
        layout = plan_layout(tiny(*overrides), 8, 1)
        return traded_lookup(layout.param_rules, layout.act_rules, layout.sizes) is not None

    assert chosen("mesh.fsdp=8") and chosen("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
    assert not chosen("mesh.data=8")  # the table's `embed` is whole
    assert not chosen("mesh.data=2", "mesh.tensor=4")
    assert not chosen("mesh.fsdp=4", "mesh.context=2")  # the partitioner cannot trade back a split length
