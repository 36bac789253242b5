"""The train state (step, parameters, optimizer state), created directly sharded.

eval_shape gives every parameter's shape and logical axes; the rules turn those into
NamedShardings; `jit(init, out_shardings=...)` then materializes each shard on its device, so
no host ever holds the whole model. Parameters are a pure nested dict of arrays: the one
canonical form that checkpoints store and every layout restores. With LoRA adapters
(model/lora.py) the optimizer state covers the adapters only, and checkpoints hold the adapters
alone: the frozen base is read again from where the run started (`frozen_base`).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from configs.schema import ModelConfig
from model import Transformer, abstract_transformer, hf
from model.lora import join, split, trainable
from sharding import logical_axes


class TrainState(struct.PyTreeNode):
    step: jax.Array  # int32 scalar: the number of updates applied
    params: dict
    opt_state: optax.OptState
    # The objective's frozen weights (trainer/objectives Frozen), sharded by the parameter rules: DPO's
    # starting weights without LoRA, distillation's teacher.
    ref_params: dict | None = None


class AbstractModel(NamedTuple):
    """The model without allocating anything: what a program is built from."""

    graphdef: nnx.GraphDef
    shapes: dict  # each parameter's ShapeDtypeStruct, as the pure dict checkpoints store
    axes: dict  # each parameter's logical axis names, same tree


def abstract_model(cfg: ModelConfig) -> AbstractModel:
    graphdef, state = nnx.split(abstract_transformer(cfg))
    return AbstractModel(graphdef, nnx.to_pure_dict(state), logical_axes(state))


def state_shardings(tx: optax.GradientTransformation, shapes: dict, param_sh: dict, mesh: Mesh,
                    ref_sh: dict | None = None) -> TrainState:
    """Optimizer moments shard like their parameters; counters, and statistics not shaped like
    their parameter (adafactor's row and column second moments), are replicated; `ref_sh`: the
    shardings of the objective's frozen weights, if it holds any (DPO's copy of the parameters,
    a teacher). A moment is
    found by its key path: optax keeps each moment tree shaped like the parameters' dict, so the
    path's trailing dict keys name the parameter (optax.tree_map_params cannot be used: Muon's
    parameter labels need the real tree)."""
    replicated = NamedSharding(mesh, PartitionSpec())
    train_sh = trainable(param_sh)
    params = {path: (leaf, sh) for (path, leaf), sh in zip(jax.tree_util.tree_flatten_with_path(trainable(shapes))[0],
                                                           jax.tree.leaves(train_sh))}

    def sharding(path: tuple, moment: jax.ShapeDtypeStruct) -> NamedSharding:
        for start in range(len(path)):
            found = params.get(path[start:])
            if found is not None and all(isinstance(k, jax.tree_util.DictKey) for k in path[start:]):
                leaf, sh = found
                return sh if moment.shape == leaf.shape else replicated
        return replicated

    opt_sh = jax.tree_util.tree_map_with_path(sharding, jax.eval_shape(tx.init, trainable(shapes)))
    return TrainState(step=replicated, params=param_sh, opt_state=opt_sh, ref_params=ref_sh)


def abstract_state(tx: optax.GradientTransformation, shapes: dict, shardings: TrainState,
                   ref_shapes: dict | None = None) -> TrainState:
    """ShapeDtypeStructs with concrete shardings: the target for restoring a checkpoint.
    `ref_shapes`: the frozen weights' shapes where they are not a copy of the parameters (a teacher)."""
    abstract = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=shapes,
                          opt_state=jax.eval_shape(tx.init, trainable(shapes)),
                          ref_params=None if shardings.ref_params is None else ref_shapes or shapes)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def _step_zero(params: dict, tx: optax.GradientTransformation, reference: bool) -> TrainState:
    # The reference is a copy: the step donates the parameters' buffers and keeps the reference's.
    ref = jax.tree.map(lambda p: p + jnp.zeros((), p.dtype), params) if reference else None
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(trainable(params)), ref_params=ref)


def _holds_reference(shardings: TrainState | None) -> bool:
    """Whether the state starts with a copy of its parameters as its frozen weights (DPO's
    reference); weights loaded from elsewhere (a teacher) join after (`Program.with_frozen`).
    None shardings: let jit place a plain state."""
    return shardings is not None and shardings.ref_params is not None


def _random_init(cfg: ModelConfig, seed: int) -> dict:
    """The model's random parameters (`seed`) as a pure dict; traced inside a jit, so each caller's
    out_shardings create every shard on its device and XLA drops the parts it does not return."""
    return nnx.to_pure_dict(nnx.state(Transformer(cfg, rngs=nnx.Rngs(seed))))


def _drawn(cfg: ModelConfig, seed: int, pick: Callable[[dict], dict], shardings: Any) -> dict:
    """`pick` of the random init, placed by `shardings`."""
    return jax.jit(lambda: pick(_random_init(cfg, seed)), out_shardings=shardings)()


def init_state(cfg: ModelConfig, tx: optax.GradientTransformation, seed: int, shardings: TrainState) -> TrainState:
    """Step 0 with random parameters (`seed`), each shard created on its device."""

    def init() -> TrainState:
        return _step_zero(_random_init(cfg, seed), tx, _holds_reference(shardings))

    return jax.jit(init, out_shardings=shardings)()


def random_params(cfg: ModelConfig, seed: int, shardings: dict, part: str) -> dict:
    """The random init (`seed`) of one top-level part of the parameters (`mtp`: what a Hugging Face
    checkpoint lacks), each shard created on its device; XLA drops the rest of the init."""
    return _drawn(cfg, seed, lambda params: params[part], shardings[part])


def state_from_params(params: dict, tx: optax.GradientTransformation, shardings: TrainState,
                      cfg: ModelConfig | None = None, seed: int = 0) -> TrainState:
    """Step 0 with the given (already sharded) parameters, e.g. imported ones, and a new optimizer
    state. Parameters without the adapters `cfg` asks for get new ones, initialized from `seed` as
    `init_state` does (the base weights' random init is left to the compiler to drop)."""
    if cfg is not None and cfg.lora.enabled and not split(params)[0]:
        params = join(_drawn(cfg, seed, lambda init: split(init)[0], split(shardings.params)[0]), params)
    return jax.jit(lambda p: _step_zero(p, tx, _holds_reference(shardings)), out_shardings=shardings)(params)


def frozen_base(cfg: ModelConfig, from_hf: str, seed: int, shardings: jax.sharding.Sharding | dict) -> dict:
    """The frozen base weights of a LoRA run, which its checkpoints do not hold: read from the
    Hugging Face directory `from_hf` (init.from_hf), or else drawn again from `seed` (run.seed) as
    `init_state` drew them; placed by `shardings` (one for all, or a tree like the parameters)."""
    if from_hf:
        return hf.load_params(from_hf, cfg, shardings)
    sh = split(shardings)[1] if isinstance(shardings, dict) else shardings
    return _drawn(cfg, seed, lambda init: split(init)[1], sh)


def param_count(shapes: dict) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(shapes))


def tree_bytes(tree: Any) -> int:
    return sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
