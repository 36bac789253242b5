"""The Llama-style decoder: embedding, a stack of identical blocks, final norm, output head.

The blocks are created once with `nnx.vmap` as one stacked module (every parameter gains a
leading `layers` axis) and applied by a *layer runner*. With `model.moe.every` = k > 1 the
stacked unit is a `BlockGroup` of k layers (k - 1 dense ones stacked on `sublayers`, then an
MoE one), so the stack stays one scan over num_layers / k identical groups. With
`model.moe.first_k_dense_replace` = k the first k layers are dense: a second, smaller stack
(`dense_layers`, stacked on `sublayers`) applied by its own scan before the layer runner, as a
prefix of the embedding (the pipeline stages split the MoE stack only). The default runner scans over the
stack, so compile time stays flat in depth; the trainer may hand in another one (a pipeline
schedule) without the model knowing about meshes or devices. A runner returns the hidden states
and the layers' router statistics (model/router.py `STATS`), summed over the layers (and averaged
over the microbatches a pipeline splits the batch into); dense layers add zeros. With
`model.mtp_depth` > 0 the model also holds multi-token prediction modules (`mtp`, model/mtp.py),
which only the training loss runs.
"""

from __future__ import annotations

import functools
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from configs.schema import ModelConfig
from model import kernels
from model.block import Block
from model.flops import moe_layer_count, stack_layers
from model.inputs import TokenInputs
from model.layers import RMSNorm, constrain, param, remat
from model.mtp import MTPModule
from model.router import STATS

Array = jax.Array


class LayerRunner(Protocol):
    def __call__(self, layers: Block, x: Array, inputs: TokenInputs) -> tuple[Array, Array]: ...


def scan_layers(
    layers: Block, x: Array, inputs: TokenInputs, *, remat_policy: str, first: Array | int = 0,
) -> tuple[Array, Array]:
    """Applies the stacked blocks in order with one `lax.scan` (one compiled layer body, so
    compile time stays flat in depth); returns the output and the router statistics summed over
    the layers. Each layer sees `inputs.for_layer` of its global index, `first` + its place in
    this stack (its own LoRA dropout noise, model/inputs.py)."""
    graphdef, stacked = nnx.split(layers)

    def body(carry: tuple[Array, Array], xs: tuple[nnx.State, Array]) -> tuple[tuple[Array, Array], None]:
        (h, total), (layer_state, i) = carry, xs
        h, stats = nnx.merge(graphdef, layer_state)(h, inputs.for_layer(i))
        return (h, total + stats), None

    init = (x, jnp.zeros(len(STATS), jnp.float32))
    index = first + jnp.arange(jax.tree.leaves(stacked)[0].shape[0], dtype=jnp.int32)
    (x, stats), _ = jax.lax.scan(remat(body, remat_policy), init, (stacked, index))
    return x, stats


class BlockGroup(nnx.Module):
    """`model.moe.every` = k > 1 layers: k - 1 dense ones (stacked on `sublayers`, applied by an
    inner scan), then one MoE layer. Called like a Block, so every layer runner takes it."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=cfg.moe.every - 1)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "sublayers"})
        def make_dense(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs=rngs, moe=False)

        self.dense = make_dense(rngs)
        self.moe = Block(cfg, rngs=rngs, moe=True)
        self.cfg = cfg

    def __call__(self, x: Array, inputs: TokenInputs) -> tuple[Array, Array]:
        """`inputs`: the group's; its layers see them for their places in it (0 .. k - 1)."""
        graphdef, stacked = nnx.split(self.dense)

        def body(h: Array, xs: tuple[nnx.State, Array]) -> tuple[Array, None]:
            layer_state, i = xs  # dense: no router stats
            return nnx.merge(graphdef, layer_state)(h, inputs.for_layer(i))[0], None

        x, _ = jax.lax.scan(body, x, (stacked, jnp.arange(self.cfg.moe.every - 1, dtype=jnp.int32)))
        return self.moe(x, inputs.for_layer(self.cfg.moe.every - 1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def head_logits(x: Array, w: Array, w_dims: str, tied_grads: bool = True, out_dtype: str = "float32") -> Array:
    """Output-head logits in `out_dtype` from x [batch, length, embed] and the head weight in the
    compute dtype (`w_dims` "dv", or "vd" for the tied embedding table). `tied_grads`: the
    backward pass computes the weight gradient together with the input gradient."""
    return jnp.einsum(f"bld,{w_dims}->blv", x, w, preferred_element_type=jnp.dtype(out_dtype))


def _head_fwd(x: Array, w: Array, w_dims: str, tied_grads: bool, out_dtype: str) -> tuple[Array, tuple[Array, Array]]:
    return head_logits(x, w, w_dims, tied_grads, out_dtype), (x, w)


def _head_bwd(w_dims: str, tied_grads: bool, out_dtype: str, res: tuple[Array, Array], g: Array) -> tuple[Array, Array]:
    # The logit gradient is in the compute dtype before both matmuls (float32 logits' is rounded
    # to it), as every other layer's is: the weight gradient then comes out of its matmul in the
    # compute dtype, so its reduction over the batch shards moves that dtype (autodiff's own
    # transpose of float32 logits emits it in float32 and the partitioner reduces it there: twice
    # the bytes for the largest matrix of the model), and the matmuls run at the compute dtype's rate.
    x, w = res
    g = g.astype(x.dtype)
    dx = jnp.einsum(f"blv,{w_dims}->bld", g, w)
    dw = jnp.einsum(f"bld,blv->{w_dims}", x, g)
    if not tied_grads:
        return dx, dw
    # Both products before dx flows on into the layers: nothing else orders dw, and libtpu
    # schedules it after the layers' whole backward pass, keeping g ([batch, length, vocab],
    # 2.1 GB a device for Llama-3-8B at 8192 tokens) alive through it.
    return jax.lax.optimization_barrier((dx, dw))


head_logits.defvjp(_head_fwd, _head_bwd)


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        init = nnx.initializers.normal(cfg.init_std)
        self.embedding = param(rngs, init, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"))

        grouped = cfg.moe.enabled and cfg.moe.every > 1

        @nnx.split_rngs(splits=stack_layers(cfg) // cfg.moe.every if grouped else stack_layers(cfg))
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_stack(rngs: nnx.Rngs) -> Block | BlockGroup:
            return BlockGroup(cfg, rngs=rngs) if grouped else Block(cfg, rngs=rngs)

        self.layers = make_stack(rngs)
        if cfg.moe.enabled and cfg.moe.first_k_dense_replace:
            @nnx.split_rngs(splits=cfg.moe.first_k_dense_replace)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "sublayers"})
            def make_dense(rngs: nnx.Rngs) -> Block:
                return Block(cfg, rngs=rngs, moe=False)

            self.dense_layers = make_dense(rngs)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs=rngs)
        if not cfg.tie_embeddings:
            self.lm_head = param(rngs, init, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"))
        if cfg.mtp_depth:  # created last, so the other parameters draw what they draw without them
            self.mtp = nnx.List([MTPModule(cfg, rngs=rngs) for _ in range(cfg.mtp_depth)])

    def features(
        self,
        tokens: Array,
        positions: Array | None = None,
        segment_ids: Array | None = None,
        runner: LayerRunner | None = None,
    ) -> Array:
        """tokens [batch, length] int -> final normed hidden states [batch, length, embed]
        (a convenience: `features_and_stats` with the inputs of `TokenInputs.of`)."""
        return self.features_and_stats(tokens, TokenInputs.of(tokens, positions, segment_ids), runner)[0]

    def features_and_stats(
        self, tokens: Array, inputs: TokenInputs | None = None, runner: LayerRunner | None = None,
    ) -> tuple[Array, Array]:
        """tokens [batch, length] int and their per-token inputs (model/inputs.py; None: positions
        0 .. length - 1, one document a row, no LoRA dropout) -> the final normed hidden states and
        the router statistics averaged over the MoE layers ([len(STATS)] float32: model/router.py;
        zeros for a dense model)."""
        if inputs is None:
            inputs = TokenInputs.of(tokens)
        x = self.embed(tokens)
        if hasattr(self, "dense_layers"):  # dense: no router statistics; indices -k .. -1, before the stack's
            x = scan_layers(self.dense_layers, x, inputs, remat_policy=self.cfg.remat,
                            first=-self.cfg.moe.first_k_dense_replace)[0]
        if runner is None:
            x, stats = scan_layers(self.layers, x, inputs, remat_policy=self.cfg.remat)
        else:
            x, stats = runner(self.layers, x, inputs)
        return self.final_norm(x), stats / max(1, moe_layer_count(self.cfg))

    def embed(self, tokens: Array) -> Array:
        """tokens [batch, length] int -> embeddings [batch, length, embed] in the compute dtype
        (its own method: the 1F1B schedules embed one microbatch at a time)."""
        table = self.embedding[...].astype(jnp.dtype(self.cfg.dtype))
        lookup = kernels.current().lookup
        if lookup is not None:  # the layout's own (sharding/lookup.py: FSDP trades rows)
            x = lookup(table, tokens)
        else:
            # Cast, then gather the table's shards over the compute layout of `embed`, so the
            # gather moves the compute dtype and the rows come out batch-sharded.
            x = jnp.take(constrain(table, ("vocab", "embed")), tokens, axis=0)
        return constrain(x, ("batch", "length", "embed"))

    def logits(self, x: Array, tied_grads: bool = True) -> Array:
        """Hidden states [batch, length, embed] -> logits [batch, length, vocab] in
        `model.logits_dtype` (the compute dtype, or float32).
        `tied_grads=False` lets the compiler order the head's two gradients freely: the chunked
        loss, where tying them costs memory on TPU. A tied embedding table's are always left free."""
        dt = x.dtype
        out_dtype = jnp.dtype(dt if self.cfg.logits_dtype == "compute" else jnp.float32).name
        if self.cfg.tie_embeddings:
            # The table's gradient has a second part, the lookup's. Left unordered, the compiler
            # adds the two before reducing them over the batch's shards, once: ordered, it reduces
            # each (libtpu, llama3-1b on data=64: 1.21x the minimum bytes, and more temporaries).
            out = head_logits(x, self.embedding[...].astype(dt), "vd", False, out_dtype)
        else:
            out = head_logits(x, self.lm_head[...].astype(dt), "dv", tied_grads, out_dtype)
        return constrain(out, ("batch", "length", "vocab"))

    def __call__(
        self,
        tokens: Array,
        positions: Array | None = None,
        segment_ids: Array | None = None,
        runner: LayerRunner | None = None,
    ) -> Array:
        return self.logits(self.features(tokens, positions, segment_ids, runner))


def abstract_transformer(cfg: ModelConfig) -> Transformer:
    """The model with ShapeDtypeStruct parameters: every shape and logical axis, nothing allocated."""
    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))


def param_shapes(cfg: ModelConfig) -> dict:
    """The parameters' ShapeDtypeStructs (nested dict, layers stacked), without allocating."""
    return nnx.to_pure_dict(nnx.state(abstract_transformer(cfg)))


def transformer_from_params(cfg: ModelConfig, params: dict) -> Transformer:
    """The Transformer holding `params` (a pure dict of arrays); no random init is materialized."""
    graphdef, state = nnx.split(abstract_transformer(cfg))
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)
