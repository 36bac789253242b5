"""The optimizers, all from optax, behind one config key (`optim.name`), with linear warmup, a
decay schedule, global-norm clipping and the weight-decay mask shared by all of them.

- `adamw` (default): decoupled weight decay on matrices.
- `muon`: Muon (optax.contrib) on the block matrices, AdamW on the embedding, output head and
  norms, as its authors use it; two learning rates on one schedule shape: `optim.muon_lr` for the
  matrices, `optim.lr` for the rest. Which dims Muon orthogonalizes comes from the logical axis
  names (`muon_dims`), so a matrix stacked over `layers` is orthogonalized layer by layer.
- `adafactor`: factored second moments (rows and columns of each matrix: far smaller state than
  AdamW's) with optax's defaults, including update sizes relative to each parameter's RMS (so
  `optim.lr` is a relative step: about 1e-2); weight decay decoupled as in AdamW (lr x decay x
  parameter), not optax's own, which is added after the learning rate.
- `lion`: the sign of an interpolated momentum; its steps are larger, so it wants an `optim.lr`
  3-10x below AdamW's.

An MoE with the sigmoid router keeps a per-expert routing bias among its parameters
(model/router.py): its gradient is the experts' load above the mean, and its update is the sign
of that times `model.moe.router_bias_update_rate`, apart from the optimizer, its clipping and
its weight decay.

The optimizer state is sharded by the rules like AdamW's: every moment shaped like its parameter
shards like it (trainer/state.py); adafactor's row and column statistics, whose shapes differ,
are replicated (they are a vector per matrix).
"""

from __future__ import annotations

from typing import Callable

import jax
import optax
from optax.contrib import MuonDimensionNumbers

from configs.schema import OptimConfig
from model.router import BIAS_NAME

STACK_DIMS = ("layers", "sublayers", "expert")  # dims that stack independent matrices: Muon's batch dims


def lr_schedule(cfg: OptimConfig, total_steps: int, peak: float | None = None) -> optax.Schedule:
    """Linear warmup to `peak` (default `lr`), then the named decay down to `peak *
    min_lr_ratio` at step `optim.decay_steps` (0: `total_steps`), where it stays. The update at
    step s uses the rate at s + 1, so the first update is not wasted on lr = 0."""
    peak = cfg.lr if peak is None else peak
    warmup = optax.linear_schedule(0.0, peak, max(cfg.warmup_steps, 1))
    decay_steps = max((cfg.decay_steps or total_steps) - cfg.warmup_steps, 1)
    end = peak * cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.min_lr_ratio)
    elif cfg.schedule == "linear":
        decay = optax.linear_schedule(peak, end, decay_steps)
    else:
        decay = optax.constant_schedule(peak)
    joined = optax.join_schedules([warmup, decay], [cfg.warmup_steps])
    return lambda step: joined(step + 1)


def schedule_count(opt_state: optax.OptState) -> jax.Array:
    """The number of updates the optimizer has applied: the step optax evaluates the learning
    rate schedule at for the next update. A skipped (non-finite) step keeps the old optimizer
    state, so this count stops while `TrainState.step` moves on. (Muon's parameter groups each
    keep one; they count the same updates.)"""
    is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731
    return [s for s in jax.tree.leaves(opt_state, is_leaf=is_schedule) if is_schedule(s)][0].count


def _tree(axes: dict, fn: Callable) -> dict:
    return jax.tree.map(fn, axes, is_leaf=lambda x: isinstance(x, tuple))


def decay_mask(axes: dict) -> dict:
    """Weight decay on matrices only; norm scales (one dim besides `layers`) are left alone."""
    return _tree(axes, lambda names: len([n for n in names if n not in ("layers", "sublayers")]) >= 2)


def muon_dims(names: tuple[str, ...]) -> MuonDimensionNumbers | None:
    """Which dims of a parameter Muon orthogonalizes over, from its logical names; None: AdamW.
    Every block matrix reads or writes the residual stream (`embed`): q, k, v, gate and up
    reduce over it, o and down output to it; the stacking dims are batch dims. Multi-head latent
    attention's up-projections (q_b, kv_b) reduce over their `latent` dim instead. The blocks of
    multi-token prediction modules (no `layers` dim) are block matrices too. The embedding, output
    head (`vocab`) and norms (one dim besides the stacking ones) go to AdamW; the dense first
    layers (`first_k_dense_replace`) are stacked on `sublayers` alone."""
    dims = [i for i, n in enumerate(names) if n not in STACK_DIMS]
    stream = "embed" if "embed" in names else "latent"
    if "vocab" in names or stream not in names or len(dims) < 2:
        return None
    embed = names.index(stream)
    others = tuple(d for d in dims if d != embed)
    if dims[0] == embed:
        return MuonDimensionNumbers(reduction_axis=(embed,), output_axis=others)
    return MuonDimensionNumbers(reduction_axis=others, output_axis=(embed,))


def _muon(cfg: OptimConfig, total_steps: int, axes: dict, schedule: optax.Schedule) -> optax.GradientTransformation:
    dims = _tree(axes, muon_dims)
    labels = _tree(axes, lambda names: "muon" if muon_dims(names) else "adamw")
    # optax's muon handles the matrices it is given (the others arrive masked); the rest gets
    # AdamW with our decay mask, which optax's own AdamW group would not apply.
    matrices = optax.contrib.muon(lr_schedule(cfg, total_steps, cfg.muon_lr), beta=0.95, eps=cfg.eps,
                                  weight_decay=cfg.weight_decay, muon_weight_dimension_numbers=dims)
    rest = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask(axes))
    return optax.partition({"muon": matrices, "adamw": rest}, labels)


def _adafactor(cfg: OptimConfig, axes: dict, schedule: optax.Schedule) -> optax.GradientTransformation:
    # learning_rate=None: optax's adafactor then returns the negated, parameter-scaled update;
    # flipping it back lets the decay join it before the learning rate, as in AdamW.
    return optax.chain(
        optax.adafactor(learning_rate=None),
        optax.scale(-1.0),
        optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask(axes)),
        optax.scale_by_learning_rate(schedule),
    )


def is_router_bias(path: tuple) -> bool:
    """Whether a key path names a routing bias (model/router.py)."""
    return bool(path) and getattr(path[-1], "key", None) == BIAS_NAME


def without_router_bias(tree: dict) -> dict:
    """`tree` with the routing biases' leaves zero: the gradients the optimizer trains on."""
    return jax.tree_util.tree_map_with_path(lambda p, x: x * 0 if is_router_bias(p) else x, tree)


def with_router_bias(tx: optax.GradientTransformation, axes: dict, rate: float) -> optax.GradientTransformation:
    """`tx` for every parameter but the routing biases, which move by `rate` against the sign of
    their gradient (the load above the mean: DeepSeek-V3's auxiliary-loss-free balancing)."""
    labels = jax.tree_util.tree_map_with_path(lambda p, _: "bias" if is_router_bias(p) else "rest", axes,
                                              is_leaf=lambda x: isinstance(x, tuple))
    if "bias" not in jax.tree.leaves(labels):
        return tx
    bias = optax.chain(optax.scale_by_sign(), optax.scale(-rate)) if rate > 0 else optax.set_to_zero()
    return optax.partition({"bias": bias, "rest": tx}, labels)


def make_optimizer(cfg: OptimConfig, total_steps: int, axes: dict,
                   router_bias_rate: float = 0.0) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(the optimizer `optim.name` names, with clipping first; the schedule of `optim.lr`);
    a model's routing biases, if any, get their own update at `router_bias_rate`."""
    schedule = lr_schedule(cfg, total_steps)
    if cfg.name == "muon":
        tx = _muon(cfg, total_steps, axes, schedule)
    elif cfg.name == "adafactor":
        tx = _adafactor(cfg, axes, schedule)
    elif cfg.name == "lion":
        tx = optax.lion(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask(axes))
    else:
        tx = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                         mask=decay_mask(axes))
    tx = optax.chain(optax.clip_by_global_norm(cfg.clip), tx) if cfg.clip > 0 else tx
    return with_router_bias(tx, axes, router_bias_rate), schedule
