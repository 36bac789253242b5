"""AdamW with linear warmup, a decay schedule and global-norm clipping (optax)."""

from __future__ import annotations

import jax
import optax

from configs.schema import OptimConfig


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup to `lr`, then the named decay down to `lr * min_lr_ratio` at step
    `optim.decay_steps` (0: `total_steps`), where it stays. The update at step s uses the rate at
    s + 1, so the first update is not wasted on lr = 0."""
    warmup = optax.linear_schedule(0.0, cfg.lr, max(cfg.warmup_steps, 1))
    decay_steps = max((cfg.decay_steps or total_steps) - cfg.warmup_steps, 1)
    end = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        decay = optax.cosine_decay_schedule(cfg.lr, decay_steps, alpha=cfg.min_lr_ratio)
    elif cfg.schedule == "linear":
        decay = optax.linear_schedule(cfg.lr, end, decay_steps)
    else:
        decay = optax.constant_schedule(cfg.lr)
    joined = optax.join_schedules([warmup, decay], [cfg.warmup_steps])
    return lambda step: joined(step + 1)


def schedule_count(opt_state: optax.OptState) -> jax.Array:
    """The number of updates the optimizer has applied: the step optax evaluates the learning
    rate schedule at for the next update. A skipped (non-finite) step keeps the old optimizer
    state, so this count stops while `TrainState.step` moves on."""
    is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731
    (state,) = [s for s in jax.tree.leaves(opt_state, is_leaf=is_schedule) if is_schedule(s)]
    return state.count


def decay_mask(axes: dict) -> dict:
    """Weight decay on matrices only; norm scales (one dim besides `layers`) are left alone."""
    return jax.tree.map(
        lambda names: len([n for n in names if n != "layers"]) >= 2, axes, is_leaf=lambda x: isinstance(x, tuple)
    )


def make_optimizer(cfg: OptimConfig, total_steps: int, axes: dict) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = lr_schedule(cfg, total_steps)
    adamw = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask(axes))
    tx = optax.chain(optax.clip_by_global_norm(cfg.clip), adamw) if cfg.clip > 0 else adamw
    return tx, schedule
