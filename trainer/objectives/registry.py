"""The objective registry: what a run trains, one module per objective, looked up by
`train.objective`.

An `Objective` owns everything that differs between objectives: its corpus format (the data
side, data/corpus_format/), its config checks, the frozen weights the state holds beside the
parameters (`Frozen`: DPO's copy of the starting weights, distillation's teacher),
what joins a batch before the step (a reference's log-probs), its loss and eval functions (both
on the one forward pass, trainer/forward.py), the names and console text of its metrics, and,
for an objective that makes its batches on the host (GRPO's rollouts), that `stage`. The step,
the program, the loop, the hooks and the metrics logger ask it; none of them compares a name.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import jax
import numpy as np
from flax import nnx

from configs import Config, ConfigError
from configs.registry import Registry, api
from configs.schema import ModelConfig
from model.loss import LossFn
from trainer.compute import Compute

Array = jax.Array
# (params, reference params or None, batch) -> the held-out sums (leaves add up over batches)
EvalFn = Callable[[dict, Any, dict], Any]
# (params, reference params or None, batch) -> the batch with what the objective adds before its loss
BatchFn = Callable[[dict, Any, dict], dict]
# A batch an objective's stage made, with the host's metrics of making it.
Made = tuple[dict, dict[str, float]]


class Stage:
    """An objective that makes its batches on the host between steps (reinforcement learning's
    rollouts and rewards), taking data when it needs it. A batch made for several steps is part
    of the run's state between them: a checkpoint holds it (`carried`) and a resumed run takes
    it back (`resume`), so the steps after a resume are the ones the run would have made."""

    def __call__(self, state: Any, next_batch: Callable[[], dict], step: int) -> Made:
        """(the train state, the data's next batch when asked, the step about to run) -> (the
        batch the step trains on, the host's metrics of making it)."""
        raise NotImplementedError

    def makes_batch(self, step: int) -> bool:
        """Whether step `step` makes its batch from the train state it is given (a new rollout),
        rather than training on one made before: the loop then waits for that state first."""
        return True

    def carried(self, step: int) -> Made | None:
        """What a checkpoint of `step` must hold for the steps after it: a batch made before and
        still to be trained on, with its metrics. None: nothing (the next step makes its own)."""
        return None

    def resume(self, made: Made | None) -> None:
        """Takes back what a checkpoint held (`carried`; None: it held nothing)."""


@dataclasses.dataclass(frozen=True)
class Frozen:
    """Frozen weights the train state holds beside the parameters (`TrainState.ref_params`):
    sharded by the run's parameter rules (a network of its own with its layer stack whole on every
    pipeline stage: trainer.spec.frozen_rules), out of the optimizer, saved and restored with the state."""

    model: ModelConfig  # their network: its shapes and logical axes
    # Their shardings -> the weights, placed; None: a copy of the starting weights (same shapes).
    load: Callable[[dict], dict] | None = None
    key: str = "train.objective"  # the config key an error about them names


class Objective:
    """One training objective, built from the run's config."""

    name: ClassVar[str]
    data_format: ClassVar[str]  # the corpus format its batches come in (data/corpus_format/)
    rows_per_example: ClassVar[int] = 1  # sequences one example (a row of train.global_batch) holds
    # Its loss is the per-token next-token loss, which a 1F1B-family schedule computes itself.
    token_loss: ClassVar[bool] = True
    # The held-out eval also runs before the first update (logged at step 0): a metric whose
    # starting value is the baseline a run is judged against (GRPO's accuracy).
    eval_before_training: ClassVar[bool] = False

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def check(self) -> None:
        """Rules between `train.objective` and other keys (no devices needed). Raises ConfigError."""

    def check_schedule(self, computes_grads: bool) -> None:
        """A 1F1B-family schedule's own gradient code has the next-token loss only."""
        if computes_grads and not self.token_loss:
            raise ConfigError(f"pipeline.schedule={self.cfg.pipeline.schedule} computes the language-model loss "
                              f"itself; train.objective={self.name} pipelines with pipeline.schedule=gpipe")

    # The keys `holds_reference` reads: a resumed run that changes one is named by it.
    reference_keys: tuple[str, ...] = ()

    @property
    def holds_reference(self) -> bool:
        """Whether the train state holds a frozen copy of the starting weights (`ref_params`)."""
        return False

    @property
    def frozen(self) -> Frozen | None:
        """The frozen weights the state holds (None: none); by default the copy of the starting
        weights `holds_reference` asks for."""
        return Frozen(self.cfg.model) if self.holds_reference else None

    @property
    def noise_seed(self) -> int | None:
        """LoRA dropout's seed (`run.seed`), the one randomness of a step; None: no dropout."""
        lora = self.cfg.model.lora
        return self.cfg.run.seed if lora.enabled and lora.dropout > 0 else None

    def batch_fn(self, graphdef: nnx.GraphDef, compute: Compute) -> BatchFn | None:
        """What joins a batch at the start of each step, before its dropout noise (None: nothing)."""
        return None

    def stage(self, graphdef: nnx.GraphDef, compute: Compute) -> Stage | None:
        """What makes each step's batch from the data's on the host, between steps (None: the
        data's batch is the step's)."""
        return None

    def side_program(self, graphdef: nnx.GraphDef, compute: Compute) -> tuple[Callable, tuple] | None:
        """A program the objective runs on the devices besides the step (GRPO's decoding of its
        rollouts), for the planner to compile: (fn(params, *args), the args' abstract values, each
        an array of the data batch's rows or a scalar). None: none."""
        return None

    def step_batch(self, data: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.ShapeDtypeStruct]:
        """The batch the step compiles for, from the data's (the same unless a `stage` remakes it);
        every array [rows, ...] with the data batch's sharding."""
        return data

    def loss_fn(self, graphdef: nnx.GraphDef, compute: Compute) -> LossFn:
        """loss(params, batch) -> (loss sum, aux): aux's leaves add up over micro-batches, its
        first the count the sum is divided by (targets, or pairs)."""
        raise NotImplementedError

    def eval_fn(self, graphdef: nnx.GraphDef, compute: Compute) -> EvalFn:
        """The held-out evaluation: no model loss terms and no dropout."""
        raise NotImplementedError

    def step_metrics(self, aux: Any) -> dict[str, Array]:
        """The step's metrics by name from its loss function's aux summed over micro-batches."""
        raise NotImplementedError

    def eval_metrics(self, sums: np.ndarray) -> tuple[float, dict[str, float], str]:
        """(mean loss, other means by name, their console text) from the held-out sums, flattened
        and added over batches in float64: [loss sum, count, the eval function's other sums...]."""
        raise NotImplementedError

    def console(self, record: dict[str, float]) -> list[str]:
        """The parts of a logged step's console line after the loss, gradient norm and rate."""
        return []


def require(ok: bool, key: str, message: str) -> None:
    """An objective's config rule: one ConfigError line naming `key` unless `ok`."""
    if not ok:
        raise ConfigError(f"{key}: {message}")


def check_prepared(cfg: Config) -> None:
    """A post-training objective reads one corpus `data.prepare --objective NAME` wrote."""
    name, d = cfg.train.objective, cfg.data
    require(d.source == "prepared", "train.objective", f"{name} reads a corpus that `python -m data.prepare "
            f"--objective {name}` wrote; set data.source=prepared and data.path")
    require(not d.mixture, "train.objective", f"{name} reads one prepared corpus (data.path), not data.mixture")


_OBJECTIVES: Registry[type[Objective]] = Registry("train.objective", instances=False)
register, get, names = api(_OBJECTIVES)  # an Objective subclass decorated with `register`: its `name` selects it


def build(cfg: Config) -> Objective:
    """The objective `cfg` trains, its config checks passed."""
    objective = get(cfg.train.objective)(cfg)
    objective.check()
    return objective
