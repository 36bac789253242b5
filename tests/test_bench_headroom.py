"""bench/grpo_headroom.py's table: pass@k, the share greedy misses that a sample finds, and where
greedy integer answers go wrong, from rewards given by hand."""

from __future__ import annotations

import numpy as np

from bench.grpo_headroom import _wrong_place, summary


def test_pass_at_k_counts_prompts_with_a_right_answer_among_their_first_k_samples():
    greedy = np.array([1.0, 0.0, 0.0, 0.0])
    sampled = np.array([[1, 0, 0, 0],   # sample 1 of each of the 4 prompts
                        [0, 1, 0, 0],
                        [0, 0, 0, 0],
                        [0, 0, 1, 0]], np.float32)
    rows = dict(summary(greedy, sampled, ["85", "101", "7", "40"], ["85", "111", "8", "x"], 1.0))
    assert rows["greedy exact match"] == "0.250"
    assert rows["mean reward of the samples (temperature 1)"] == "0.188"
    assert rows["mean reward of the samples on the prompts greedy gets right"] == "0.250"  # prompt 1
    assert rows["mean reward of the samples on the prompts greedy gets wrong"] == "0.167"  # 2 of 12
    assert (rows["pass@1"], rows["pass@2"], rows["pass@4"]) == ("0.250", "0.500", "0.750")
    assert "pass@8" not in rows
    assert rows["greedy wrong, right in a sample of 4"] == "0.500"  # prompts 2 and 3
    assert rows["greedy wrong, lowest wrong digit: tens"] == "0.250"  # 111 for 101
    assert rows["greedy wrong, lowest wrong digit: ones"] == "0.250"  # 8 for 7
    assert rows["greedy wrong, lowest wrong digit: not a number"] == "0.250"


def test_the_wrong_place_is_the_lowest_digit_that_differs():
    assert [_wrong_place("85", got) for got in ("86", "95", "185", "75", "1085")] == [
        "ones", "tens", "hundreds", "tens", "thousands"]
    assert _wrong_place("85", "8 5") == "not a number"
