"""The model alone: shapes, causal and document masking, attention kernels, remat, FLOPs."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from jax.extend import core as jcore

from configs import ModelConfig, load_config
from configs.mla import MLAConfig
from configs.schema import MoEConfig
from configs.lora import LoraConfig
from configs.schema import LOGICAL_AXES
from model import Transformer, flops_per_token, matmul_params
from model.transformer import abstract_transformer
from model.attention import fused_attention, xla_attention
from sharding import logical_axes


def small(**changes) -> ModelConfig:
    return dataclasses.replace(load_config("tiny").model, **changes)


def build(cfg: ModelConfig, seed: int = 0) -> Transformer:
    return Transformer(cfg, rngs=nnx.Rngs(seed))


def jitted(model: Transformer):
    """The model's forward as one compiled function (eager op-by-op dispatch is slow)."""
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda st, x, pos, seg: nnx.merge(graphdef, st)(x, positions=pos, segment_ids=seg))
    return lambda x, positions=None, segment_ids=None: fn(state, x, positions, segment_ids)


def tokens(batch: int, length: int, vocab: int, seed: int = 1) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (batch, length), 0, vocab)


def test_logits_shape_and_dtype():
    cfg = small()
    logits = jitted(build(cfg))(tokens(3, cfg.seq_len, cfg.vocab_size))
    assert logits.shape == (3, cfg.seq_len, cfg.vocab_size)
    assert logits.dtype == jnp.float32


def test_parameter_shapes_and_logical_axes():
    cfg = small(tie_embeddings=False)
    state = nnx.state(build(cfg))
    shapes = jax.tree.map(lambda x: x.shape, nnx.to_pure_dict(state))
    axes = logical_axes(state)
    L, d, h, kv, hd, f, v = cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim, cfg.d_ff, cfg.vocab_size
    assert shapes["embedding"] == (v, d) and axes["embedding"] == ("vocab", "embed")
    assert shapes["lm_head"] == (d, v) and axes["lm_head"] == ("embed", "vocab")
    assert shapes["layers"]["attn"]["q"] == (L, d, h, hd)
    assert axes["layers"]["attn"]["q"] == ("layers", "embed", "heads", "head_dim")
    assert shapes["layers"]["attn"]["k"] == (L, d, kv, hd)
    assert axes["layers"]["attn"]["k"] == ("layers", "embed", "kv_heads", "head_dim")
    assert shapes["layers"]["mlp"]["down"] == (L, f, d)
    assert axes["layers"]["mlp"]["down"] == ("layers", "mlp", "embed")
    assert axes["layers"]["attn_norm"]["scale"] == ("layers", "norm")  # replicated: no default rule
    # Every parameter is annotated, and with as many names as it has dims.
    for shape, names in zip(jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple)),
                            jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))):
        assert len(shape) == len(names) and all(isinstance(n, str) for n in names)


def test_the_model_names_exactly_the_logical_axes_a_rules_table_may_use(monkeypatch):
    """configs.schema.LOGICAL_AXES, the names `sharding.params/activations` accept, are the names
    the parameters and the constrained activations carry: a name the model adds must be accepted,
    and a name it no longer uses must not be (a rule for it would match nothing)."""
    seen: set[str] = set()
    constrain = nn.with_logical_constraint

    def recording(x, names, *args, **kwargs):
        seen.update(n for n in names if n is not None)
        return constrain(x, names, *args, **kwargs)

    monkeypatch.setattr(nn, "with_logical_constraint", recording)
    param_names: set[str] = set()
    # A dense model and mixtures of experts (expert weights name the `expert` dim; groups of
    # `moe.every` layers stack their dense layers on `sublayers`); latent attention names `latent`;
    # one with LoRA adapters (`lora_rank`).
    for cfg in (small(tie_embeddings=False), small(moe=MoEConfig(num_experts=4, shared_experts=1)),
                small(qk_norm=True, moe=MoEConfig(num_experts=4, every=2)),
                small(attention_type="mla", num_kv_heads=small().num_heads, mla=MLAConfig(q_lora_rank=8)),
                small(lora=LoraConfig(rank=2))):
        graphdef, state = nnx.split(abstract_transformer(cfg))
        x = jax.ShapeDtypeStruct((2, cfg.seq_len), jnp.int32)
        jax.eval_shape(lambda st, t: nnx.merge(graphdef, st)(t), state, x)
        param_names |= {n for names in jax.tree.leaves(logical_axes(state), is_leaf=lambda a: isinstance(a, tuple))
                        for n in names if n is not None}
    activation_names = set(seen)
    assert {"batch", "length"} <= activation_names and "layers" in param_names  # both really recorded
    assert activation_names | param_names == set(LOGICAL_AXES)


def test_tied_model_has_no_output_matrix():
    assert "lm_head" not in nnx.to_pure_dict(nnx.state(build(small(tie_embeddings=True))))


def test_a_future_token_cannot_change_an_earlier_logit():
    cfg = small()
    model = jitted(build(cfg))
    x = tokens(2, cfg.seq_len, cfg.vocab_size)
    j = cfg.seq_len // 2
    y = x.at[:, j].set((x[:, j] + 1) % cfg.vocab_size)
    a, b = model(x), model(y)
    np.testing.assert_array_equal(np.asarray(a[:, :j]), np.asarray(b[:, :j]))
    assert not np.allclose(a[:, j:], b[:, j:]), "the changed token must change later logits"


def test_documents_do_not_see_each_other():
    cfg = small()
    model = jitted(build(cfg))
    t = cfg.seq_len
    x = tokens(1, t, cfg.vocab_size)
    seg = jnp.concatenate([jnp.zeros((1, t // 2), jnp.int32), jnp.ones((1, t - t // 2), jnp.int32)], axis=1)
    pos = jnp.concatenate([jnp.arange(t // 2), jnp.arange(t - t // 2)])[None]
    y = x.at[:, t // 2 + 1].set((x[:, t // 2 + 1] + 7) % cfg.vocab_size)  # a token of document B
    a = model(x, positions=pos, segment_ids=seg)
    b = model(y, positions=pos, segment_ids=seg)
    np.testing.assert_array_equal(np.asarray(a[:, : t // 2 + 1]), np.asarray(b[:, : t // 2 + 1]))
    assert not np.allclose(a[:, t // 2 + 1 :], b[:, t // 2 + 1 :])
    # Document B alone, at positions from 0, gives the same logits as inside the packed row.
    alone = model(x[:, t // 2 :])
    np.testing.assert_allclose(np.asarray(a[:, t // 2 :]), np.asarray(alone), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("segments", [False, True])
def test_attention_kernels_agree(segments):
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    b, t, h, g, d = 2, 16, 8, 2, 16
    q = jax.random.normal(kq, (b, t, h, d))
    k = jax.random.normal(kk, (b, t, h // g, d))
    v = jax.random.normal(kv, (b, t, h // g, d))
    seg = jnp.array([[0] * 5 + [1] * 11, [0] * 16]) if segments else None
    ours = jax.jit(xla_attention)(q, k, v, seg)
    theirs = jax.jit(fused_attention, static_argnums=4)(q, k, v, seg, None)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=2e-5, atol=2e-5)


def test_grouped_query_attention_shares_each_kv_head_with_its_group():
    """16 query heads over 2 kv heads equal plain multi-head attention whose k and v weights are
    the 2 heads repeated for each group of 8 consecutive query heads (query head h reads kv head
    h // 8, as Hugging Face Llama's repeat_kv); repeating them in the other order (h % 2) differs."""
    gqa_cfg, mha_cfg = small(num_kv_heads=2), small(num_kv_heads=16)
    group = gqa_cfg.num_heads // gqa_cfg.num_kv_heads
    gqa = build(gqa_cfg)
    graphdef, mha_state = nnx.split(build(mha_cfg, seed=1))
    x = tokens(2, 16, gqa_cfg.vocab_size)
    expected = np.asarray(jitted(gqa)(x))

    def mha_logits(widen) -> np.ndarray:
        params = nnx.to_pure_dict(nnx.state(gqa))
        attn = params["layers"]["attn"]  # k, v: [layers, embed, kv_heads, head_dim]
        attn["k"], attn["v"] = widen(attn["k"]), widen(attn["v"])
        nnx.replace_by_pure_dict(mha_state, params)
        return np.asarray(jitted(nnx.merge(graphdef, mha_state))(x))

    repeated = mha_logits(lambda w: jnp.repeat(w, group, axis=2))
    tiled = mha_logits(lambda w: jnp.tile(w, (1, 1, group, 1)))
    assert not np.allclose(repeated, tiled, atol=1e-3), "the two head orders must give different models"
    np.testing.assert_allclose(expected, repeated, rtol=1e-5, atol=1e-5)


def _grads(cfg: ModelConfig) -> tuple[dict, str]:
    x = tokens(2, cfg.seq_len, cfg.vocab_size)
    graphdef, params = nnx.split(build(cfg))
    params = nnx.to_pure_dict(params)

    def loss(p):
        return jnp.mean(nnx.merge(graphdef, p)(x) ** 2)

    return jax.jit(jax.grad(loss))(params), str(jax.make_jaxpr(jax.grad(loss))(params))


@pytest.fixture(scope="module")
def grads_without_remat():
    return _grads(small())


@pytest.mark.parametrize("policy", ["full", "save_dots", "save_dots_no_batch"])
def test_remat_policies_give_the_same_gradients(policy, grads_without_remat):
    ref, ref_jaxpr = grads_without_remat
    got, got_jaxpr = _grads(small(remat=policy))
    assert "remat" not in ref_jaxpr and "remat" in got_jaxpr, "the policy must really be applied"
    for r, g in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(r), np.asarray(g), rtol=1e-5, atol=1e-7)


def _matmul_operand_dtypes(jaxpr: jcore.Jaxpr) -> list[set[str]]:
    """The operand dtypes of every dot_general in `jaxpr`, nested jaxprs (scan, remat) included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append({str(v.aval.dtype) for v in eqn.invars})
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(sub, (jcore.Jaxpr, jcore.ClosedJaxpr)):
                    found += _matmul_operand_dtypes(getattr(sub, "jaxpr", sub))
    return found


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compute_dtype_sets_every_matmul_and_parameters_stay_float32(dtype):
    """model.dtype is the dtype of every matmul of the forward (projections, attention, MLP,
    output head), while the parameters are stored in float32; the logits come out in the compute
    dtype (`model.logits_dtype`'s default; tests/test_loss.py checks `float32`)."""
    cfg = small(dtype=dtype)
    model = build(cfg)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(model)))
    graphdef, state = nnx.split(model)
    x = tokens(1, 8, cfg.vocab_size)
    jaxpr = jax.make_jaxpr(lambda st, t: nnx.merge(graphdef, st)(t))(state, x)
    # Per layer q, k, v, scores, weighted values, out, gate, up, down; then the head.
    assert _matmul_operand_dtypes(jaxpr.jaxpr) == [{dtype}] * 10
    logits = jitted(model)(x)
    assert logits.dtype == jnp.dtype(dtype) and bool(jnp.all(jnp.isfinite(logits)))


def test_matmul_parameters_of_llama_3_2_1b():
    # Llama-3.2-1B has 1,235,814,400 parameters; less its 33 RMSNorm scales of 2048 that are
    # not matmul weights, the tied embedding counted once as the output head.
    cfg = load_config("llama3-1b").model
    assert matmul_params(cfg) == 1_235_814_400 - 33 * 2048
    assert flops_per_token(cfg) == 6 * matmul_params(cfg) + 6 * 16 * 4096 * 2048
