"""Rewards (trainer/rewards.py): the shipped ones, a user's function by path, their sum, and the
one line a failing reward stops the run with."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from configs import ConfigError
from configs.post import RLConfig
from trainer import rewards
from trainer.rewards import RewardError

EXAMPLE = {"prompt": "37+48=", "answer": "85"}

USER_MODULE = '''
import math

def digits(prompt, completion, example):
    return float(sum(c.isdigit() for c in completion))

def raises(prompt, completion, example):
    raise KeyError("score")

def nan(prompt, completion, example):
    return math.nan

def text(prompt, completion, example):
    return "1.0"

def boolean(prompt, completion, example):
    return completion == example["answer"]

not_callable = 3
'''


@pytest.fixture
def user_module(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "rl_user_rewards.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "rl_user_rewards"


def _score(reward: str, completion: str, **keys) -> float:
    return rewards.build(RLConfig(reward=reward, **keys))("37+48=", completion, EXAMPLE)


def test_exact_match_with_and_without_a_format():
    assert _score("exact_match", "85") == 1.0
    assert _score("exact_match", " 85\n") == 1.0  # surrounding white space is no mistake
    assert _score("exact_match", "84") == 0.0 and _score("exact_match", "851") == 0.0
    assert _score("exact_match", "85", answer_format=r"\d+") == 1.0
    assert _score("exact_match", " 85", answer_format=r"\d+") == 0.0  # right answer, wrong format


def test_length_penalty_and_a_sum():
    assert _score("length_penalty", "8500", length_penalty=0.25) == -1.0
    assert _score("exact_match, length_penalty", "85", length_penalty=0.25) == 0.5
    scores = rewards.build(RLConfig(reward="exact_match")).score(["1+1="] * 3, ["2", "3", "2"], [{"answer": "2"}] * 3)
    np.testing.assert_array_equal(scores, np.array([1, 0, 1], np.float32))


def test_a_users_function_by_path(user_module):
    assert _score(f"{user_module}:digits", "85 or 86") == 4.0
    assert _score(f"exact_match,{user_module}:boolean", "85") == 2.0  # a bool counts as a number


@pytest.mark.parametrize("fn, message", [
    ("raises", "rl.reward: rl_user_rewards:raises raised KeyError: 'score' on prompt '37+48='"),
    ("nan", "rl.reward: rl_user_rewards:nan returned nan on prompt '37+48='"),
    ("text", "rl.reward: rl_user_rewards:text returned str '1.0', not a number, on prompt '37+48='"),
])
def test_a_failing_reward_is_one_line_naming_it_and_the_prompt(user_module, fn, message):
    with pytest.raises(RewardError) as err:
        _score(f"exact_match,{user_module}:{fn}", "85")
    assert str(err.value) == message and "\n" not in str(err.value)


@pytest.mark.parametrize("reward, message", [
    ("exact_matc", "rl.reward: 'exact_matc' is not one of exact_match, length_penalty, nor a function's path"),
    ("no_such_module_xyz:fn", "rl.reward: cannot import 'no_such_module_xyz:fn' (ModuleNotFoundError"),
    ("rl_user_rewards:missing", "rl.reward: cannot import 'rl_user_rewards:missing' (AttributeError"),
    ("rl_user_rewards:not_callable", "rl.reward: 'rl_user_rewards:not_callable' is not a function"),
])
def test_an_unknown_reward_is_a_config_error(user_module, reward, message):
    with pytest.raises(ConfigError) as err:
        rewards.build(RLConfig(reward=reward))
    assert str(err.value).startswith(message), str(err.value)
