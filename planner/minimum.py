"""The least communication a layout needs per step and device, to hold a compiled program's
traffic against (bytes each device sends, ring algorithm, as planner.hlo counts them).

Per mesh axis of size n > 1 (G: the parameter bytes one device's gather group gathers, each
parameter in the dtype it is gathered in: matmul weights in the compute dtype, norm scales in
float32; A: one layer's activations [local batch, length, embed] in the compute dtype):

    fsdp      parameters gathered for the forward and again for the backward, gradients
              reduce-scattered once:                    3 x (n-1)/n x G
              (an untied embedding table is not needed by the backward, and its lookup may
              instead trade the looked-up rows, A, by an all-to-all forward and back: the
              table counts 2 x min(table, A), not 3 x table)
    data      one all-reduce of the gradient shard:     2 x (n-1)/n x G / fsdp
    tensor    per layer two activation all-reduces forward and two backward (under `remat:
              full` one more: the recomputed attention output; the MLP output is not needed
              by the backward), plus the embedding lookup's and the output head's input
              gradient:                                 (4 L [+ L] + 2) x 2 x (n-1)/n x A
    pipeline  each microbatch's activations across each stage boundary and its gradient back,
              once per repeat:                          2 x R x M x A_microbatch
    expert    the weights outside the experts are stored over it as over fsdp
              (sharding.stored_rules), so they cost what fsdp costs, over the group fsdp x
              expert (`fsdp+expert` where both split); the experts' own weights over fsdp alone.
              The expert dispatch's all-to-alls depend on the routing and are not counted.
    context   the parameters are sharded over it as over fsdp (trainer/layout.py), so it costs
              what fsdp costs, over the group fsdp x context (`fsdp+context` where both split);
              and per layer each device receives the other devices' keys and values forward and
              sends their gradients back (all-gather and reduce-scatter, or the ring's C - 1
              permutes):                                2 L x (n-1)/n x KV
              (KV: one layer's whole-sequence keys and values of the local rows, kv heads split
              by tensor; multi-head latent attention's are not counted)

The loss's scalar reductions are left out (bytes, not megabytes).

With LoRA adapters (model/lora.py) only the adapters have gradients: the reduce-scatter and the
data all-reduce move the adapters' bytes (G_a), the gathers still every parameter:
fsdp (n-1)/n x (2 x G + G_a) (an untied table, frozen, counts min(table, A) once in place of
2 x table), data 2 x (n-1)/n x G_a / fsdp.
"""

from __future__ import annotations

import math
import jax
import numpy as np

from configs import Config
from configs.schema import RECOMPUTES_ALL
from model import lora
from sharding.cast import is_matmul_weight
from sharding.rules import as_axes, axes_size, logical_to_spec, mesh_axes, stored_rules, to_rules


# The axes whose groups gather a stored weight's shards (trainer/layout.py, sharding.stored_rules),
# in mesh order: a weight's gather group is the ones its stored spec splits it over.
GATHER_AXES = ("fsdp", "expert", "context")


def gathered_bytes(shapes: dict, axes: dict, cfg: Config, sizes: dict[str, int]) -> dict[tuple[str, ...], float]:
    """Bytes of the parameters one device holds once gathered, by the group of mesh axes that
    gathers them: the axes of GATHER_AXES above 1 that each weight's stored spec splits it over.
    An expert dim stays split over its own `expert` axis; a weight split over none (a norm's
    scale) is under the empty group."""
    compute = np.dtype(cfg.model.dtype).itemsize
    rules = stored_rules(cfg.sharding.params, sizes)
    out: dict[tuple[str, ...], float] = {}
    for shape, names in zip(jax.tree.leaves(shapes), jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))):
        group, split = set(), 1
        for name, entry in zip(names, logical_to_spec(names, rules)):
            for a in as_axes(entry):
                if a in GATHER_AXES and not (a == "expert" and name == "expert"):
                    group.add(a)
                else:
                    split *= sizes[a]
        key = tuple(a for a in GATHER_AXES if a in group and sizes[a] > 1)
        out[key] = out.get(key, 0.0) + math.prod(shape.shape) / split * (compute if is_matmul_weight(names) else 4)
    return out


def minimum(cfg: Config, sizes: dict[str, int], shapes: dict, axes: dict) -> dict[str, float]:
    """Axis -> the least bytes each device sends over it per step (axes of size 1 left out)."""
    m = cfg.model
    ring = lambda n: (n - 1) / n  # noqa: E731
    g = gathered_bytes(shapes, axes, cfg, sizes)
    adapters = lora.split(shapes)[0]
    grads = gathered_bytes(adapters, lora.split(axes)[0], cfg, sizes) if adapters else g
    table = {} if m.tie_embeddings else gathered_bytes({"e": shapes["embedding"]}, {"e": axes["embedding"]}, cfg, sizes)
    batch_shards = axes_size(mesh_axes("batch", to_rules(cfg.sharding.activations)), sizes)
    act = cfg.train.global_batch / batch_shards * m.seq_len * m.d_model * np.dtype(m.dtype).itemsize
    out: dict[str, float] = {}
    for group, held in g.items():
        if not group:
            continue
        # The untied table is gathered, or its looked-up rows traded (the cheaper), once forward
        # and, when it trains, once more for its gradient; the other weights twice (forward,
        # backward) and their gradients reduced once.
        trains_table = not adapters
        t = table.get(group, 0.0)
        table_cost = (2 if trains_table else 1) * min(t, act)
        reduced = held - t if trains_table else grads.get(group, 0.0)
        key = "+".join(group)
        out[key] = out.get(key, 0.0) + ring(axes_size(group, sizes)) * (2 * (held - t) + reduced + table_cost)
    if sizes["data"] > 1:
        out["data"] = 2 * ring(sizes["data"]) * sum(b / axes_size(k, sizes) for k, b in grads.items())
    if sizes["context"] > 1 and m.attention_type == "gqa":
        kv = act / m.d_model * 2 * m.num_kv_heads * m.resolved_head_dim / sizes["tensor"]
        out["context"] = out.get("context", 0.0) + 2 * m.num_layers * ring(sizes["context"]) * kv
    if sizes["tensor"] > 1:
        per_layer = 4 + (1 if m.remat in RECOMPUTES_ALL else 0)
        out["tensor"] = (per_layer * m.num_layers + 2) * 2 * ring(sizes["tensor"]) * act
    if sizes["pipeline"] > 1:
        out["pipeline"] = 2 * cfg.pipeline.repeats * act  # M microbatches of act / M each
    return out
