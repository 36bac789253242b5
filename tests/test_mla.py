"""Multi-head latent attention (model/mla.py) against transformers' DeepseekV3Attention on the same
weights (torch, float64): values and gradients, with and without packed documents; decoding keeps
only the latent and the rotary key per token; the train step's loss and gradients on the
fsdp x tensor, context and pipeline layouts equal one device's."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import require
from configs import ConfigError, load_config
from configs.mla import MLAConfig
from configs.schema import ModelConfig
from model import TokenInputs, Transformer
from model.decode import LatentCache, forward, generate, init_cache
from model.mla import MLAttention

torch = require("torch", "hf", lazy=True)
transformers = require("transformers", "hf", lazy=True)

B, T, D, H = 2, 12, 32, 4
MLA = MLAConfig(q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6)
CFG = ModelConfig(d_model=D, num_heads=H, num_kv_heads=H, rope_theta=500.0, attention_type="mla", mla=MLA)
# The same shapes in transformers' names (its q_lora_rank None: no query compression).
HF_SHAPE = dict(hidden_size=D, num_attention_heads=H, num_key_value_heads=H, kv_lora_rank=8, qk_rope_head_dim=4,
                qk_nope_head_dim=8, v_head_dim=6, rope_theta=500.0)
VARIANTS = {"q_lora": (16, True), "no q_lora": (0, True), "half-split rope": (16, False)}


def packed(documents: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """Positions [B, T] and segment ids (None: one document per row); packed rows hold two or
    three documents and end in padding (segment 0)."""
    if not documents:
        return np.broadcast_to(np.arange(T), (B, T)).astype(np.int32), None
    seg = np.array([[1] * 5 + [2] * 5 + [0] * 2, [1] * 3 + [2] * 4 + [3] * 5], np.int32)
    pos = np.array([list(range(5)) * 2 + [0, 1], list(range(3)) + list(range(4)) + list(range(5))], np.int32)
    return pos, seg


def hf_attention(q_lora_rank: int, interleave: bool, seed: int = 0):  # noqa: ANN201 (a torch module)
    config = transformers.DeepseekV3Config(q_lora_rank=q_lora_rank or None, rope_interleave=interleave, **HF_SHAPE)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    module = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention(config, 0).double()
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "layernorm" in name else 0.3 * torch.randn_like(p))
    return module, transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RotaryEmbedding(config).double()


def ours_from_hf(module) -> dict:  # noqa: ANN001 (a DeepseekV3Attention)
    """Their weights in our layout: [out, in] transposed, then split into named dims."""
    w = {n: p.detach().numpy() for n, p in module.named_parameters()}
    heads = lambda a, width: a.T.reshape(a.shape[1], H, width)  # noqa: E731
    out = {"kv_a": w["kv_a_proj_with_mqa.weight"].T, "kv_norm": {"scale": w["kv_a_layernorm.weight"]},
           "kv_b": heads(w["kv_b_proj.weight"], 8 + 6), "o": w["o_proj.weight"].T.reshape(H, 6, D)}
    if "q_proj.weight" in w:
        out["q"] = heads(w["q_proj.weight"], 12)
    else:
        out.update(q_a=w["q_a_proj.weight"].T, q_norm={"scale": w["q_a_layernorm.weight"]},
                   q_b=heads(w["q_b_proj.weight"], 12))
    return jax.tree.map(lambda a: np.asarray(a, np.float32), out)


def theirs(module, rope, x: np.ndarray, documents: bool, cotangent: np.ndarray):  # noqa: ANN001
    """transformers' output and the gradients of <output, cotangent> for x and the weights (in our layout)."""
    pos, seg = packed(documents)
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    visible = pos[:, :, None] >= pos[:, None, :]  # the same mask, built here in NumPy
    if seg is not None:
        visible &= seg[:, :, None] == seg[:, None, :]
    mask = torch.tensor(np.where(visible, 0.0, -np.inf)[:, None])
    out = module(xt, rope(xt, torch.tensor(pos, dtype=torch.long)), mask)[0]
    module.zero_grad()
    (out * torch.tensor(cotangent, dtype=torch.float64)).sum().backward()
    grads = ours_from_hf(_GradView(module))
    return out.detach().numpy(), xt.grad.numpy(), grads


class _GradView:
    """A module whose `named_parameters` are another's gradients (so ours_from_hf maps them too)."""

    def __init__(self, module) -> None:  # noqa: ANN001
        self.module = module

    def named_parameters(self):  # noqa: ANN201
        return ((n, p.grad) for n, p in self.module.named_parameters())


def ours(cfg: ModelConfig, params: dict, x: np.ndarray, documents: bool, cotangent: np.ndarray):  # noqa: ANN201
    graphdef, state = nnx.split(MLAttention(cfg, rngs=nnx.Rngs(0)))
    pos, seg = packed(documents)
    seg = None if seg is None else jnp.asarray(seg)

    def f(p: dict, x: jax.Array) -> jax.Array:
        st = jax.tree.map(lambda a: a, state)
        nnx.replace_by_pure_dict(st, p)
        return nnx.merge(graphdef, st)(x, TokenInputs(jnp.asarray(pos), seg))

    out, vjp = jax.vjp(jax.jit(f), params, jnp.asarray(x))
    g_params, g_x = vjp(jnp.asarray(cotangent, jnp.float32))
    return np.asarray(out), np.asarray(g_x), jax.tree.map(np.asarray, g_params)


def close(ours: np.ndarray, ref: np.ndarray, what: str) -> None:
    """float32 against float64: within 1e-5 of the reference's largest magnitude."""
    err = np.max(np.abs(ours - ref))
    assert err <= 1e-5 * np.max(np.abs(ref)), f"{what}: max |ours - theirs| = {err:.3g}, max |theirs| = {np.max(np.abs(ref)):.3g}"


@pytest.mark.parametrize("documents", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mla_matches_transformers_values_and_gradients(variant, documents):
    q_lora, interleave = VARIANTS[variant]
    module, rope = hf_attention(q_lora, interleave)
    rng = np.random.default_rng(1)
    x, cotangent = rng.normal(size=(B, T, D)), rng.normal(size=(B, T, D))
    ref_out, ref_gx, ref_gp = theirs(module, rope, x, documents, cotangent)
    cfg = dataclasses.replace(CFG, mla=dataclasses.replace(MLA, q_lora_rank=q_lora, rope_interleave=interleave))
    out, gx, gp = ours(cfg, ours_from_hf(module), x.astype(np.float32), documents, cotangent)
    close(out, ref_out, "output")
    close(gx, ref_gx, "d output / d x")
    for (path, r), g in zip(jax.tree_util.tree_leaves_with_path(ref_gp), jax.tree.leaves(gp)):
        close(g, r, f"gradient of {jax.tree_util.keystr(path)}")
    if documents:  # the packed case must test something the plain one does not
        plain = theirs(module, rope, x, False, cotangent)[0]
        assert np.max(np.abs(plain - ref_out)) > 1e-2


def test_the_rope_layouts_really_differ():
    """Interleaved pairs and half splits give different outputs on the same weights (else the
    variants above would check one thing twice)."""
    module, rope = hf_attention(16, True)
    x = np.random.default_rng(1).normal(size=(B, T, D))
    a = theirs(module, rope, x, False, x)[0]
    module.config.rope_interleave = False
    b = theirs(module, rope, x, False, x)[0]
    assert np.max(np.abs(a - b)) > 1e-2


DECODE_CFG = dataclasses.replace(CFG, num_layers=2, d_ff=64, vocab_size=264, init_std=0.3)


def test_decoding_caches_the_latent_and_matches_the_full_forward():
    model = Transformer(DECODE_CFG, rngs=nnx.Rngs(0))
    prompt = jnp.asarray(np.random.RandomState(0).randint(0, 256, (B, 5)), jnp.int32)
    cache = init_cache(model, B, 16)
    assert isinstance(cache, LatentCache)
    # One latent and one rotary key per token and layer, no per-head keys or values: 12 numbers
    # per token and layer here against 2 x 4 x (12 + 6) = 144 expanded (DeepSeek-V3: 576 against 40,960).
    assert cache.latent.shape == (2, B, 16, 1, MLA.kv_lora_rank)
    assert cache.rope.shape == (2, B, 16, 1, MLA.qk_rope_head_dim)
    assert sum(a.size for a in cache) == 2 * B * 16 * (8 + 4)
    logits, cache = jax.jit(forward)(model, prompt, cache, 0)
    full = jax.jit(lambda m, t: m(t))(model, prompt)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(full), rtol=1e-5, atol=1e-5 * float(jnp.abs(full).max()))
    assert float(jnp.abs(cache.latent[:, :, 5:]).max()) == 0 and float(jnp.abs(cache.latent[:, :, :5]).min()) >= 0
    assert float(jnp.abs(cache.latent[:, :, :5]).max()) > 0
    # Greedy decoding with the cache (the latent absorbed into the queries) picks the tokens the
    # full forward, recomputed on the whole sequence at every step, picks.
    new = np.asarray(generate(model, prompt, 6))
    seq = np.asarray(prompt)
    for _ in range(6):
        seq = np.concatenate([seq, np.asarray(jnp.argmax(model(jnp.asarray(seq))[:, -1], -1))[:, None]], 1)
    np.testing.assert_array_equal(new, seq[:, 5:])
    # A row left-padded by 2 (`pad`) decodes as its unpadded prompt does.
    padded = jnp.concatenate([jnp.full((B, 2), 99, jnp.int32), prompt], axis=1)
    np.testing.assert_array_equal(np.asarray(generate(model, padded, 6, pad=np.full(B, 2))), new)


def test_mla_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="model.num_kv_heads: 4 must equal model.num_heads=8"):
        load_config("tiny", ["model.attention_type=mla", "model.num_heads=8", "model.num_kv_heads=4"])
    with pytest.raises(ConfigError, match="model.mla.qk_rope_head_dim: must be even"):
        load_config("tiny", ["model.attention_type=mla", "model.num_kv_heads=16", "model.mla.qk_rope_head_dim=3"])
    with pytest.raises(ConfigError, match="model.rope_scaling.type: yarn is built for multi-head latent attention"):
        load_config("tiny", ["model.rope_scaling.type=yarn"])


MLA_TINY = ["model.attention_type=mla", "model.num_kv_heads=16", "model.mla.q_lora_rank=16", "model.mla.kv_lora_rank=16",
            "model.mla.qk_rope_head_dim=4", "model.mla.qk_nope_head_dim=8", "model.mla.v_head_dim=6"]
MLA_LAYOUTS = {
    "fsdp=2 x tensor=2 x context=2, ring": ["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", "mesh.context=2",
                                            "context.strategy=ring"],
    "pipeline=2 x data=2 x context=2, allgather": ["mesh.pipeline=2", "mesh.data=2", "mesh.context=2",
                                                   "pipeline.microbatches=4"],
}


@pytest.fixture(scope="module")
def one_device() -> tuple[float, dict]:
    from test_context import loss_and_grads

    return loss_and_grads(["mesh.data=1", *MLA_TINY], jax.devices()[:1], documents=True)


@pytest.mark.parametrize("layout", list(MLA_LAYOUTS))
def test_mla_layouts_give_the_loss_and_gradients_of_one_device(one_device, layout):
    """Packed documents; the tensor axis splits the heads of q_b, kv_b and o, fsdp the latent
    dims of q_b and kv_b, context the sequence (the rotary key and the latent too)."""
    from test_context import loss_and_grads

    loss, grads = loss_and_grads(MLA_LAYOUTS[layout] + MLA_TINY, jax.devices(), documents=True)
    ref_loss, ref_grads = one_device
    assert "kv_b" in ref_grads["layers"]["attn"] and "k" not in ref_grads["layers"]["attn"]  # really MLA
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for (path, r), g in zip(jax.tree_util.tree_leaves_with_path(ref_grads), jax.tree.leaves(grads)):
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))


def test_splash_takes_a_value_head_narrower_than_the_query_head():
    """The Pallas splash kernel (interpreted here) with MLA's head dims: values and gradients
    as the reference kernel's."""
    from model.attention import splash_attention, xla_attention

    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q, k = jax.random.normal(kq, (1, 128, 2, 12)), jax.random.normal(kk, (1, 128, 2, 12))
    v = jax.random.normal(kv, (1, 128, 2, 6))
    ref = lambda q, k, v, s: xla_attention(q, k, v, s, None)  # noqa: E731
    np.testing.assert_allclose(jax.jit(splash_attention)(q, k, v, None), jax.jit(ref)(q, k, v, None), rtol=2e-5, atol=2e-5)
    grad = lambda f: jax.jit(jax.grad(lambda *a: (f(*a, None) ** 2).sum(), argnums=(0, 1, 2)))(q, k, v)  # noqa: E731
    for a, b in zip(grad(splash_attention), grad(ref)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)


def test_flops_count_the_latent_projections():
    """matmul_params counts every MLA weight (all but the norm scales), by shapes read off the model."""
    from model import matmul_params
    from model.transformer import param_shapes

    for q_lora in (16, 0):
        cfg = dataclasses.replace(DECODE_CFG, mla=dataclasses.replace(MLA, q_lora_rank=q_lora))
        attn = param_shapes(cfg)["layers"]["attn"]
        weights = sum(int(np.prod(a.shape)) for name, a in attn.items() if not name.endswith("norm"))
        dense = sum(int(np.prod(a.shape)) for a in param_shapes(cfg)["layers"]["mlp"].values())
        assert matmul_params(cfg) == weights + dense + D * 264


def test_muon_takes_every_latent_attention_matrix():
    """Under optim.name=muon every MLA matrix is orthogonalized: the up-projections q_b and kv_b
    (no `embed` dim) over their latent input, the others as any block matrix."""
    from sharding import logical_axes
    from trainer.optimizer import muon_dims
    from model.transformer import abstract_transformer

    axes = logical_axes(nnx.state(abstract_transformer(dataclasses.replace(DECODE_CFG, num_layers=2))))["layers"]["attn"]
    dims = {name: muon_dims(names) for name, names in axes.items() if not name.endswith("norm")}
    assert set(dims) == {"q_a", "q_b", "kv_a", "kv_b", "o"} and all(dims.values()), dims
    assert dims["q_b"].reduction_axis == (1,) and dims["q_b"].output_axis == (2, 3)
    assert dims["kv_a"].reduction_axis == (1,) and dims["o"].output_axis == (3,)


@pytest.mark.real_target
def test_cudnn_runs_mla_with_its_values_padded_on_an_h100(tmp_path):
    """XLA's GPU compiler: DeepSeek-V3's head dims (q and k 192, v 128) on llama3-1b's width run
    cuDNN's fused attention forward and backward, v padded with zeros to 192."""
    import os
    import subprocess
    import sys

    from conftest import ROOT, real_target_env
    from test_targets import _need

    _need("h100")
    overrides = ["model.num_layers=2", "train.global_batch=1", "model.seq_len=1024", "model.attention=cudnn",
                 "model.attention_type=mla", "model.num_kv_heads=32", "model.mla.kv_lora_rank=512",
                 "model.mla.qk_rope_head_dim=64", "model.mla.qk_nope_head_dim=128", "model.mla.v_head_dim=128"]
    done = subprocess.run([sys.executable, "plan.py", "--config", os.path.join(ROOT, "configs", "llama3-1b.yaml"),
                           "--devices", "1", "--hardware", "h100", "--dump-hlo", str(tmp_path), *overrides,
                           "--out", str(tmp_path / "plan.json")],
                          cwd=ROOT, env=real_target_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    (text,) = [f.read_text() for f in tmp_path.glob("*.hlo")]
    calls = [line for line in text.splitlines() if 'custom_call_target="__cudnn$fmhaSoftmax"' in line]
    assert calls and "__cudnn$fmhaSoftmaxBackward" in text
    assert all("operand_layout_constraints={" + ", ".join(["bf16[1,1024,32,192]{3,2,1,0}"] * 3) + "}" in c for c in calls)
