"""bench/collectives.py on a peer's program: the row it prints for MaxText's llama3-8b fsdp=64
step (tests/fixtures/peers), against the figures of its README and `.mem.json`."""

from __future__ import annotations

import os

from bench.collectives import PEERS, peer, row


def test_the_peer_row_holds_its_memory_and_collectives_by_kind() -> None:
    result = peer(os.path.join(PEERS, "maxtext-e591f30-llama3-8b-v5p64-fsdp64.hlo.gz"), 64)
    assert round(result["memory"] / 1e9, 2) == 23.69  # arguments 1.509 GB + temporaries 22.185 GB
    cells = row("maxtext", result).split(" | ")
    assert cells[2].startswith("546: 30.58 / ")  # 545 bf16 weight gathers and one s32
    assert cells[3].startswith("129 (129 as all-reduce): 15.01 / ")
    assert cells[-1].startswith("**59.")
