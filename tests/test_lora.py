"""LoRA (model/lora.py): adapters that start as a no-op, train alone on a frozen base, on every
layout, resume bitwise and export as merged weights or a PEFT adapter that `transformers` and
`peft` load with our logits.

The base model is a random 2-layer Llama saved by `transformers`, fine-tuned from `init.from_hf`
with adapters on every projection; the oracles are `transformers` (the merged export), `peft`
on the original Hugging Face model (the adapter export) and the base weights as saved.
Tolerance as tests/test_hf.py: max |ours - theirs| <= 1e-4 x max |logit|.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT, require, stdlib_glob, stopped_at

torch = require("torch", "hf", lazy=True)
transformers = require("transformers", "hf", lazy=True)
peft = require("peft", "hf", lazy=True)
pytestmark = pytest.mark.usefixtures("one_torch_thread")

import hf as hf_cli  # noqa: E402
import trainer  # noqa: E402
from configs import ConfigError, load_config  # noqa: E402
from configs.lora import LORA_TARGETS, LoraConfig  # noqa: E402
from flax import nnx  # noqa: E402
from model import Transformer, hf, lora  # noqa: E402
from model.transformer import transformer_from_params  # noqa: E402
from sharding import logical_axes  # noqa: E402
from trainer.checkpoint import restore_params  # noqa: E402
from test_hf import CPU0, TOKENS, TOL, make_hf, rel_diff, their_logits  # noqa: E402

STEPS = 4
LORA = ["model.lora.rank=4", "model.lora.alpha=8", f"model.lora.targets=[{','.join(LORA_TARGETS)}]"]
TRAIN = ["train.log_every=1", f"train.steps={STEPS}", f"optim.decay_steps={STEPS}", "optim.warmup_steps=1", "optim.lr=1e-2",
         "checkpoint.every=2"]
COMMON = [*TRAIN, *LORA]
LAYOUT = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]


def logits(model_cfg, params: dict) -> np.ndarray:  # noqa: ANN001 (a ModelConfig)
    return np.asarray(transformer_from_params(model_cfg, params)(jnp.asarray(TOKENS)))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random 2-layer Llama (every weight random, norms included) saved by transformers."""
    path = str(tmp_path_factory.mktemp("hf"))
    make_hf(path, tied=False, kv_heads=2)
    return path


def lora_config(hf_dir: str, run_dir: str, *overrides: str):  # noqa: ANN201 (a Config)
    return hf_cli.import_config(hf_dir, run_dir, os.path.join(ROOT, "configs", "tiny.yaml"),
                                [f"data.path={stdlib_glob('json')}", *COMMON, *overrides])


class Runs:
    """name -> (config, history) of a LoRA fine-tune from `hf_dir`, each trained once per module."""

    def __init__(self, hf_dir: str, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.hf_dir, self.tmp = hf_dir, tmp_path_factory
        self.runs: dict[str, tuple] = {}

    def __call__(self, name: str, *overrides: str, devices: int = 8) -> tuple:
        if name not in self.runs:
            cfg = lora_config(self.hf_dir, str(self.tmp.mktemp(name) / "run"), *overrides)
            self.runs[name] = cfg, trainer.run(cfg, devices=jax.devices()[:devices])
        return self.runs[name]


@pytest.fixture(scope="module")
def runs(hf_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(hf_dir, tmp_path_factory)


def losses(history: list[dict]) -> np.ndarray:
    return np.array([r["loss"] for r in history])


def test_zero_b_adapters_give_the_base_logits_exactly():
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml")).model
    with_lora = dataclasses.replace(cfg, lora=LoraConfig(rank=4, targets=list(LORA_TARGETS)))
    params = nnx.to_pure_dict(nnx.state(Transformer(with_lora, rngs=nnx.Rngs(0))))
    adapters, base = lora.split(params)
    assert len(jax.tree.leaves(adapters)) == 2 * len(LORA_TARGETS)
    assert all(not np.any(b) for b in jax.tree.leaves(adapters) if b.shape[1] == 4)  # every B [layers, 4, ...] zero
    # The base weights are those of the model without adapters: LoRA draws its A last.
    plain = nnx.to_pure_dict(nnx.state(Transformer(cfg, rngs=nnx.Rngs(0))))
    jax.tree.map(np.testing.assert_array_equal, plain, base)
    ref = logits(cfg, base)
    np.testing.assert_array_equal(logits(with_lora, params), ref)
    # With B nonzero the same model really computes something else.
    bumped = lora.join(jax.tree.map(lambda a: a + 0.1, adapters), base)
    assert rel_diff(logits(with_lora, bumped), ref) > 100 * TOL


def test_adapters_carry_their_weights_logical_axes():
    cfg = dataclasses.replace(load_config(os.path.join(ROOT, "configs", "tiny.yaml")).model,
                              lora=LoraConfig(rank=4, targets=list(LORA_TARGETS)))
    axes = logical_axes(nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))))
    attn, mlp = axes["layers"]["attn"], axes["layers"]["mlp"]
    assert attn["q_lora_a"] == ("layers", "embed", "lora_rank") and attn["q_lora_b"] == ("layers", "lora_rank", "heads", "head_dim")
    assert attn["o_lora_a"] == ("layers", "heads", "head_dim", "lora_rank") and attn["o_lora_b"] == ("layers", "lora_rank", "embed")
    assert mlp["down_lora_a"] == ("layers", "mlp", "lora_rank") and mlp["gate_lora_b"] == ("layers", "lora_rank", "mlp")


def test_model_flops_count_no_weight_gradient_for_the_base():
    """A LoRA step's model FLOPs: 4 per frozen matmul parameter (forward and input gradient), 6 per
    adapter parameter, counted here from the model's own adapter arrays."""
    from model.flops import flops_per_token, matmul_params

    base = load_config(os.path.join(ROOT, "configs", "tiny.yaml")).model
    cfg = dataclasses.replace(base, lora=LoraConfig(rank=4, targets=list(LORA_TARGETS)))
    shapes = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))))
    adapters = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(lora.split(shapes)[0]))
    attention = 6.0 * base.num_layers * base.seq_len * base.d_model
    assert flops_per_token(base) == 6.0 * matmul_params(base) + attention
    assert flops_per_token(cfg) == 4.0 * matmul_params(base) + 6.0 * adapters + attention


@pytest.mark.parametrize("targets, message", [
    ("[]", "model.lora.targets: names no projection"),
    ("[q,qkv]", "model.lora.targets: 'qkv' is not one of q, k, v, o, gate, up, down"),
    ("[q,q]", "model.lora.targets: names a projection twice"),
])
def test_bad_targets_name_the_key(targets, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        load_config(os.path.join(ROOT, "configs", "tiny.yaml"), ["model.lora.rank=4", f"model.lora.targets={targets}"])


def test_bad_targets_exit_2_before_anything_is_written(tmp_path, capsys):
    import train

    run_dir = tmp_path / "run"
    assert train.main(["--config", os.path.join(ROOT, "configs", "tiny.yaml"), f"run.dir={run_dir}",
                       "model.lora.rank=4", "model.lora.targets=[]"]) == 2
    assert "model.lora.targets" in capsys.readouterr().err and not run_dir.exists()


def test_training_moves_the_adapters_only(runs):
    cfg, history = runs("one", "mesh.data=1", devices=1)
    assert losses(history)[-1] < losses(history)[0] - 0.1
    _, _, params = restore_params(cfg.run.dir, device=jax.devices()[0])
    adapters = lora.split(params)[0]
    assert all(np.abs(np.asarray(b)).max() > 0 for p, b in jax.tree_util.tree_leaves_with_path(adapters)
               if str(p[-1].key).endswith("_lora_b"))


def test_the_base_weights_leave_the_step_bitwise_as_loaded(hf_dir, tmp_path):
    """Two steps of the 8-device program itself, then the base weights against the Hugging Face
    checkpoint's, bit for bit."""
    from trainer.program import abstract_program
    from trainer.state import state_from_params

    cfg = lora_config(hf_dir, str(tmp_path / "run"), *LAYOUT)
    program = abstract_program(cfg)
    state = state_from_params(hf.load_params(hf_dir, cfg.model, program.state_sh.params), program.tx,
                              program.state_sh, cfg.model, cfg.run.seed)
    rng = np.random.RandomState(0)
    with program.tracing():
        for _ in range(2):
            batch = {k: jax.device_put(rng.randint(0, 264, a.shape).astype(np.int32), a.sharding)
                     for k, a in program.abstract_batch().items()}
            state, metrics = program.step(state, batch)
    assert bool(metrics["finite"])
    adapters, base = lora.split(jax.device_get(state.params))
    assert np.abs(adapters["layers"]["attn"]["q_lora_b"]).max() > 0
    jax.tree.map(np.testing.assert_array_equal, base, jax.device_get(hf.load_params(hf_dir, cfg.model, CPU0)))


def test_checkpoints_hold_the_adapters_alone_and_keep_their_base(runs, hf_dir, tmp_path):
    import orbax.checkpoint as ocp

    cfg, _ = runs("one", "mesh.data=1", devices=1)
    saved = ocp.StandardCheckpointer().restore(os.path.join(cfg.run.dir, "checkpoints", str(STEPS), "state"))
    assert jax.tree.leaves(saved["params"]) and not lora.split(saved["params"])[1]
    # Resuming onto another base would train these adapters on weights they were not trained on.
    other = str(tmp_path / "other")
    import shutil

    shutil.copytree(hf_dir, other)
    moved = dataclasses.replace(cfg, init=dataclasses.replace(cfg.init, from_hf=other),
                                train=dataclasses.replace(cfg.train, steps=STEPS + 2))
    with pytest.raises(ConfigError, match="init.from_hf=.* differs from .*, the frozen base of the LoRA checkpoints"):
        trainer.run(moved, devices=jax.devices()[:1])


def test_the_optimizer_holds_state_for_the_adapters_only(runs):
    cfg, _ = runs("one", "mesh.data=1", devices=1)
    from trainer.program import abstract_program

    state = abstract_program(cfg, jax.devices()[:1]).abstract_state()
    adapter_bytes = sum(x.size for x in jax.tree.leaves(lora.split(state.params)[0]))
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert sum(x.size for x in moments) == 2 * adapter_bytes  # AdamW: mu and nu of each adapter, nothing else


@pytest.mark.parametrize("name, layout, devices", [
    ("layout", LAYOUT, 8),
    ("context", ["mesh.data=2", "mesh.context=2", "mesh.tensor=2"], 8),
    ("gpipe", ["mesh.data=1", "mesh.pipeline=2", "pipeline.microbatches=4"], 2),
    # A schedule that computes every gradient itself; the step keeps the adapters'.
    ("1f1b", ["mesh.data=1", "mesh.pipeline=2", "pipeline.microbatches=4", "pipeline.schedule=1f1b"], 2),
])
def test_other_layouts_agree_with_one_device_step_by_step(runs, name, layout, devices):
    one = losses(runs("one", "mesh.data=1", devices=1)[1])
    other = losses(runs(name, *layout, devices=devices)[1])
    assert one[-1] < one[0] - 0.1, "a comparison of flat curves proves nothing"
    np.testing.assert_allclose(other, one, rtol=2e-5)


def test_an_expert_parallel_moe_agrees_with_one_device(tmp_path):
    """Adapters on the attention of a mixture of experts, its experts split over `mesh.expert`."""
    def run(name: str, devices: int, *layout: str) -> np.ndarray:
        cfg = load_config(os.path.join(ROOT, "configs", "tiny-moe.yaml"), [
            f"run.dir={tmp_path / name}", f"data.path={stdlib_glob('json')}", "model.num_layers=2", "model.seq_len=32",
            *TRAIN, "model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=[q,k,v,o]", *layout])
        return losses(trainer.run(cfg, devices=jax.devices()[:devices]))

    one = run("one", 1, "mesh.data=1")
    assert np.ptp(one) > 0.05, one
    np.testing.assert_allclose(run("ep", 8, "mesh.data=1", "mesh.expert=4", "mesh.fsdp=2"), one, rtol=2e-5)


def test_adapters_shard_with_their_weights(hf_dir, tmp_path):
    from trainer.program import abstract_program

    cfg = lora_config(hf_dir, str(tmp_path / "run"), "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
    sh = abstract_program(cfg).state_sh.params["layers"]
    for module, name in (("attn", "q"), ("attn", "o"), ("mlp", "down")):
        n_in = lora.INPUT_DIMS[name]
        w, a, b = (sh[module][name + s].spec for s in ("", *lora.SUFFIXES))
        assert tuple(a) == tuple(w[: 1 + n_in]) + (None,) and tuple(b) == (w[0], None) + tuple(w[1 + n_in:])
        assert any(w[1:]), (name, w)  # the weight itself is split over the mesh


def test_resume_is_bitwise_exact(runs, tmp_path, capsys):
    """The straight 8-device run's checkpoint at step 2, alone in a copy of its run directory,
    resumed: its last losses, bitwise."""
    cfg, history = runs("layout", *LAYOUT)
    stopped_at(cfg.run.dir, tmp_path / "run", 2)
    capsys.readouterr()
    second = trainer.run(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=str(tmp_path / "run"))))
    assert "resumed from step 2" in capsys.readouterr().out
    np.testing.assert_array_equal(losses(second), losses(history)[2:])


def test_a_random_base_is_drawn_again_on_resume(tiny, tmp_path, capsys):
    """Without init.from_hf the frozen base is the seed's: the straight run's checkpoint at step 2,
    alone in a copy of its run directory, resumed, draws it again: its last losses, bitwise."""
    common = [*TRAIN, *LORA, "mesh.data=1"]
    straight = losses(trainer.run(tiny(*common, f"run.dir={tmp_path / 'straight'}"), devices=jax.devices()[:1]))
    stopped_at(tmp_path / "straight", tmp_path / "resumed", 2)
    second = trainer.run(tiny(*common, f"run.dir={tmp_path / 'resumed'}"), devices=jax.devices()[:1])
    assert "resumed from step 2" in capsys.readouterr().out
    assert straight[-1] < straight[0] - 0.1
    np.testing.assert_array_equal(losses(second), straight[2:])


def test_merged_export_loads_in_transformers_with_our_logits(runs, tmp_path):
    cfg, _ = runs("one", "mesh.data=1", devices=1)
    _, _, params = restore_params(cfg.run.dir, device=jax.devices()[0])
    ours = logits(cfg.model, params)
    assert rel_diff(logits(dataclasses.replace(cfg.model, lora=LoraConfig()), lora.split(params)[1]), ours) > 100 * TOL
    hf_cli.export(cfg.run.dir, str(tmp_path / "merged"))
    model, info = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "merged"), output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert rel_diff(their_logits(model.eval(), TOKENS), ours) < TOL


def test_peft_adapter_loads_onto_the_base_with_our_logits(runs, hf_dir, tmp_path):
    cfg, _ = runs("one", "mesh.data=1", devices=1)
    _, _, params = restore_params(cfg.run.dir, device=jax.devices()[0])
    ours = logits(cfg.model, params)
    hf_cli.export(cfg.run.dir, str(tmp_path / "adapter"), form="peft")
    assert sorted(os.listdir(tmp_path / "adapter")) == ["adapter_config.json", "adapter_model.safetensors"]
    base = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
    assert rel_diff(their_logits(base, TOKENS), ours) > 100 * TOL  # the adapters change the logits
    model = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    assert rel_diff(their_logits(model, TOKENS), ours) < TOL


def test_an_unknown_export_format_names_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="--format: 'nope' is not one of merged, peft"):
        hf_cli.export(str(tmp_path), str(tmp_path / "out"), form="nope")
