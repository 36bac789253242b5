"""LoRA (`model.lora`): a trainable low-rank adapter beside a frozen block projection.

A projection `y = einsum(spec, x, W)` with an adapter computes
`y + alpha / rank * einsum(einsum(x, A), B)`: A [W's input dims..., lora_rank], B [lora_rank,
W's output dims...]. Each adapter takes its logical names from its base weight (the input dims'
names on A, the output dims' on B, `lora_rank` whole), so it shards with it on every layout. B
starts at zero: a new adapter leaves the model's output exactly as it was.

The adapters are parameters named `<target>_lora_a` / `<target>_lora_b` beside their weight in
the module (`attn/q_lora_a`). `split` and `join` separate them from the base weights in the pure
parameter dict: the trainer differentiates and optimizes the adapters only (trainer/state.py,
trainer/step.py). `merged` folds them into their weights for export (hf.py).

Dropout (`model.lora.dropout` = p, PEFT's semantics: y + alpha / rank * B(A(dropout(x)))) runs
only where a training step hands the layers *noise*: one uint32 per token of the step,
`token_noise(seed, step, shape)` over the step's whole logical batch. Each layer mixes its global
index in (`for_layer`), each adapter its target, and each element of x its feature index
(`keep_mask`): the mask is a pure function of (seed, step, layer, target, row, position,
feature), so no layout, micro-batch split or sequence order changes it. Without noise (eval,
generation, export) an adapter sees x whole.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs.lora import LORA_TARGETS
from configs.schema import ModelConfig

Array = jax.Array
SUFFIXES = ("_lora_a", "_lora_b")
# How many leading dims of each target's weight its input fills (q [embed, heads, head_dim]: one;
# o [heads, head_dim, embed]: two).
INPUT_DIMS = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1}


# Odd constants of the murmur3 finalizer and the golden ratio, for `mix`.
_M1, _M2, _GOLDEN = 0x85EBCA6B, 0xC2B2AE35, 0x9E3779B9


def mix(h: Array) -> Array:
    """murmur3's 32-bit finalizer: every input bit flips about half of the output bits."""
    h = h.astype(jnp.uint32)
    h = (h ^ (h >> 16)) * jnp.uint32(_M1)
    h = (h ^ (h >> 13)) * jnp.uint32(_M2)
    return h ^ (h >> 16)


def token_noise(seed: int, step: Array, shape: tuple[int, ...]) -> Array:
    """One uint32 per token of a step's batch, `shape` [rows..., length]: threefry bits of the
    key (seed, step) over the whole logical shape (partitionable threefry: a sharded draw gives
    the same values)."""
    return jax.random.bits(jax.random.fold_in(jax.random.key(seed), step), shape, jnp.uint32)


def for_layer(noise: Array | None, layer: Array | int) -> Array | None:
    """The noise of layer `layer` (a global index, or a sublayer's within its group)."""
    if noise is None:
        return None
    index = jnp.asarray(layer, jnp.int32).astype(jnp.uint32)  # a negative index wraps, apart from the rest
    return mix(noise ^ mix(index * jnp.uint32(_GOLDEN) + jnp.uint32(1)))


def keep_mask(noise: Array, target: str, shape: tuple[int, ...], rate: float) -> Array:
    """Which elements of an adapter's input x (`shape` [b, l, features...]) dropout keeps, each
    with probability 1 - rate, from the layer's noise [b, l] and the adapter's target."""
    salted = mix(noise ^ jnp.uint32((LORA_TARGETS.index(target) + 1) * _GOLDEN % 2**32))
    feature = jnp.arange(math.prod(shape[2:]), dtype=jnp.uint32).reshape(shape[2:])
    h = mix(salted.reshape(*shape[:2], *(1,) * (len(shape) - 2)) + feature * jnp.uint32(_M1))
    return h >= jnp.uint32(round(rate * 2**32))


def scale(cfg: ModelConfig) -> float:
    return cfg.lora.alpha / cfg.lora.rank


def add_adapters(module: nnx.Module, names: Sequence[str], cfg: ModelConfig, rngs: nnx.Rngs) -> None:
    """Gives `module` an adapter beside each weight `names` lists (those `model.lora.targets` names).
    A is uniform in +-1/sqrt(fan_in) (PEFT's default, Kaiming-uniform with a = sqrt(5)), B zero."""
    for name in names:
        if name not in cfg.lora.targets:
            continue
        w = getattr(module, name)
        n_in = INPUT_DIMS[name]
        shape, axes = w.shape, w.get_metadata()["out_sharding"]
        bound = 1.0 / math.sqrt(math.prod(shape[:n_in]))
        a = jax.random.uniform(rngs.params(), (*shape[:n_in], cfg.lora.rank), jnp.float32, -bound, bound)
        b = jnp.zeros((cfg.lora.rank, *shape[n_in:]), jnp.float32)
        a_axes, b_axes = (*axes[:n_in], "lora_rank"), ("lora_rank", *axes[n_in:])
        setattr(module, name + SUFFIXES[0], nnx.Param(a, eager_sharding=False, out_sharding=a_axes))
        setattr(module, name + SUFFIXES[1], nnx.Param(b, eager_sharding=False, out_sharding=b_axes))


def adapter_specs(spec: str) -> tuple[str, str]:
    """The two einsums of an adapter from its projection's: "bld,dhk->blhk" -> ("bld,dr->blr",
    "blr,rhk->blhk") (r: the rank; the input dims are those of the weight that x also has)."""
    ins, out = spec.split("->")
    x_dims, w_dims = ins.split(",")
    w_in = "".join(c for c in w_dims if c in x_dims)
    w_out = "".join(c for c in w_dims if c not in x_dims)
    rest = "".join(c for c in x_dims if c not in w_in)
    return f"{x_dims},{w_in}r->{rest}r", f"{rest}r,r{w_out}->{out}"


def adapt(module: nnx.Module, name: str, spec: str, x: Array, y: Array, noise: Array | None = None) -> Array:
    """y (the projection `name` of x by `spec`) plus its adapter's output, if it has one; the
    adapter runs in x's dtype, on x under dropout where the layer's `noise` is given. Its rank,
    alpha and dropout are the module's config (`module.cfg`, the ModelConfig it was built with)."""
    a = getattr(module, name + SUFFIXES[0], None)
    if a is None:
        return y
    b = getattr(module, name + SUFFIXES[1])
    cfg: ModelConfig = module.cfg
    rate = cfg.lora.dropout
    if noise is not None and rate > 0:
        keep = keep_mask(noise, name, x.shape, rate)
        x = jnp.where(keep, x / jnp.asarray(1 - rate, x.dtype), jnp.zeros((), x.dtype))
    spec_a, spec_b = adapter_specs(spec)
    low = jnp.einsum(spec_a, x, a[...].astype(x.dtype)) * jnp.asarray(scale(cfg), x.dtype)
    return y + jnp.einsum(spec_b, low, b[...].astype(x.dtype)).astype(y.dtype)


def is_adapter(path: Sequence[str]) -> bool:
    return str(path[-1]).endswith(SUFFIXES)


def _select(tree: dict, keep: bool, path: tuple = ()) -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            sub = _select(v, keep, path + (k,))
            if sub:
                out[k] = sub
        elif is_adapter(path + (k,)) == keep:
            out[k] = v
    return out


def split(params: dict) -> tuple[dict, dict]:
    """(the adapters, the rest) of a pure parameter dict (or any tree shaped like one), each
    keeping the nesting of its leaves; ({}, params) without adapters."""
    return _select(params, True), _select(params, False)


def trainable(params: dict) -> dict:
    """What training updates: the adapters if the model has any, else every parameter."""
    adapters = split(params)[0]
    return adapters or params


def switched_off(params: dict) -> dict:
    """`params` with every adapter's B at zero: the model then computes with its base weights
    alone, exactly (each projection adds an exact zero), as a new adapter does. Under DPO this is
    the frozen reference, so a LoRA run holds no second copy of the weights."""
    return jax.tree_util.tree_map_with_path(
        lambda path, p: jnp.zeros_like(p) if str(getattr(path[-1], "key", "")).endswith(SUFFIXES[1]) else p, params)


def join(adapters: dict, base: dict) -> dict:
    """Inverse of `split`: one dict holding both."""
    out = dict(base)
    for k, v in adapters.items():
        out[k] = join(v, out.get(k, {})) if isinstance(v, dict) else v
    return out


def adapter_pairs(params: dict, path: tuple = ()) -> list[tuple[tuple, str]]:
    """(the module's path, the target name) of every adapter in a pure parameter dict."""
    found = []
    for k, v in params.items():
        if isinstance(v, dict):
            found += adapter_pairs(v, path + (k,))
        elif k.endswith(SUFFIXES[0]):
            found.append((path, k[: -len(SUFFIXES[0])]))
    return found


def _get(tree: dict, path: tuple) -> dict:
    for k in path:
        tree = tree[k]
    return tree


def delta(a: np.ndarray, b: np.ndarray, n_in: int, cfg: ModelConfig) -> np.ndarray:
    """alpha / rank * A B in float64, shaped like the adapted weight: A [stack..., in..., r],
    B [stack..., r, out...] with one matrix product per stacked layer (and sublayer)."""
    stack = a.shape[: a.ndim - n_in - 1]
    n = math.prod(stack)
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    prod = np.matmul(a64.reshape(n, -1, a.shape[-1]), b64.reshape(n, b.shape[len(stack)], -1))
    return scale(cfg) * prod.reshape(*stack, *a.shape[len(stack):-1], *b.shape[len(stack) + 1:])


def merged(params: dict, cfg: ModelConfig) -> dict:
    """The base weights with each adapter folded in (W + alpha / rank * A B, float32 numpy
    arrays), the adapters dropped: the parameters of the plain model that computes the same."""
    adapters, base = split(params)
    out = jax.tree.map(lambda a: np.asarray(jax.device_get(a), np.float32), base)
    for path, name in adapter_pairs(adapters):
        held, module = _get(adapters, path), _get(out, path)
        a, b = (np.asarray(jax.device_get(held[name + s])) for s in SUFFIXES)
        module[name] = (module[name] + delta(a, b, INPUT_DIMS[name], cfg)).astype(np.float32)
    return out
