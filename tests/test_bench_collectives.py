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


def test_maxtext_expert_parallel_row_shows_its_ragged_dispatch() -> None:
    """MaxText's Mixtral fsdp=16 x expert=4 program dispatches by 192 ragged all-to-alls a step (6 a
    layer): bf16 buffers of 32,768 or 8,192 rows of 4,096 (32.21 GB in all, the bound charged as
    sent); balanced routing would send 3/4 of 8,192 rows each (9.66 GB)."""
    result = peer(os.path.join(PEERS, "maxtext-e591f30-mixtral-8x7b-v5p64-fsdp16-expert4-flash-seq4096.hlo.gz"), 64)
    assert round(result["memory"] / 1e9, 2) == 24.01  # arguments 8.760 GB + temporaries 15.245 GB
    cells = row("maxtext", result).split(" | ")
    bound = 32 * 3 * (32768 + 8192) * 4096 * 2 / 1e9
    assert cells[6] == f"192: {bound:.2f} / {bound:.2f} (balanced {32 * 6 * 8192 * 4096 * 2 * 3 / 4 / 1e9:.2f})"
