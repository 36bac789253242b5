"""Rewards of reinforcement learning (`rl.reward`): plug-ins by name, or a user's function by path.

A reward scores one completion: `(prompt, completion, example) -> float`, the prompt and the
completion as text (the completion cut at end-of-text) and the example the prepared row it came
from (its "answer" at least). `rl.reward` names one or several, comma-separated, and a
completion's reward is their sum:

    rl.reward=exact_match                 # 1 if the completion is the answer, else 0
    rl.reward=exact_match,length_penalty  # minus rl.length_penalty per character as well
    rl.reward=mypkg.rewards:score         # any importable function with that signature

A shipped reward is a `Reward` subclass decorated with `@register` (the one Registry of
configs/registry.py). A reward that raises, returns NaN, an infinity or no number stops the run
with one `RewardError` line naming the reward and the prompt, before any update uses it.
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
from typing import Any, Callable, ClassVar, Sequence

import numpy as np

from configs.post import RLConfig
from configs.registry import Registry, api
from configs.schema import ConfigError

RewardFn = Callable[[str, str, dict], float]


class RewardError(ConfigError):
    """A reward that failed on a completion: one line naming the reward and the prompt. A
    ConfigError, so the entry point prints it as one line and exits 2 (the user's reward is input)."""


class Reward:
    """One shipped reward, built from the `rl` section."""

    name: ClassVar[str]

    def __init__(self, rl: RLConfig) -> None:
        self.rl = rl

    def __call__(self, prompt: str, completion: str, example: dict) -> float:
        raise NotImplementedError


_REWARDS: Registry[type[Reward]] = Registry(
    "rl.reward", instances=False,
    unknown="{key}: {name!r} is not one of {names}, nor a function's path pkg.module:fn")
register, get, names = api(_REWARDS)


@register
class ExactMatch(Reward):
    """1.0 when the completion, stripped of surrounding white space, is the example's answer; 0.0
    otherwise, and 0.0 when `rl.answer_format` is set and the completion does not match it whole."""

    name = "exact_match"

    def __init__(self, rl: RLConfig) -> None:
        super().__init__(rl)
        self.format = re.compile(rl.answer_format) if rl.answer_format else None

    def __call__(self, prompt: str, completion: str, example: dict) -> float:
        if self.format is not None and not self.format.fullmatch(completion):
            return 0.0
        return float(completion.strip() == str(example["answer"]).strip())


@register
class LengthPenalty(Reward):
    """-rl.length_penalty x the completion's length in characters: shorter completions score
    higher, all else equal (add it to a correctness reward)."""

    name = "length_penalty"

    def __call__(self, prompt: str, completion: str, example: dict) -> float:
        return -self.rl.length_penalty * len(completion)


def _import(path: str) -> RewardFn:
    """A user's reward by path `pkg.module:fn`. Raises ConfigError naming rl.reward."""
    module_name, _, attr = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"rl.reward: cannot import {path!r} ({type(e).__name__}: {e})") from None
    if not callable(fn):
        raise ConfigError(f"rl.reward: {path!r} is not a function (prompt, completion, example) -> float")
    return fn


class Rewards:
    """The rewards `rl.reward` names, their sum per completion, each result checked."""

    def __init__(self, rl: RLConfig) -> None:
        parts = [p.strip() for p in rl.reward.split(",")]
        # A path has a ':'; a name is looked up in the registry (ConfigError for an unknown one).
        self.parts: list[tuple[str, RewardFn]] = [(p, _import(p) if ":" in p else get(p)(rl)) for p in parts]

    def __call__(self, prompt: str, completion: str, example: dict) -> float:
        """The sum of the rewards of one completion. Raises RewardError naming the failing one."""
        total = 0.0
        for name, fn in self.parts:
            try:
                value = fn(prompt, completion, example)
            except Exception as e:  # the user's code: any failure is reported as one line
                raise RewardError(f"rl.reward: {name} raised {type(e).__name__}: {e} on prompt {prompt!r}") from e
            total += _checked(value, name, prompt)
        return total

    def score(self, prompts: Sequence[str], completions: Sequence[str], examples: Sequence[dict]) -> np.ndarray:
        """float32 [completions]: each completion's reward (its prompt and example alongside)."""
        return np.array([self(p, c, e) for p, c, e in zip(prompts, completions, examples)], np.float32)


def _checked(value: Any, name: str, prompt: str) -> float:
    """A reward's value as a finite float. Raises RewardError for anything else."""
    # numbers.Real: Python and NumPy ints, floats and bools (a comparison is a fine reward).
    if not isinstance(value, numbers.Real):
        raise RewardError(f"rl.reward: {name} returned {type(value).__name__} {value!r}, not a number, "
                          f"on prompt {prompt!r}")
    if not math.isfinite(float(value)):
        raise RewardError(f"rl.reward: {name} returned {float(value)} on prompt {prompt!r}")
    return float(value)


def build(rl: RLConfig) -> Rewards:
    """The run's rewards, every name and path resolved. Raises ConfigError naming rl.reward."""
    return Rewards(rl)
