"""Oracle tests of the Mixtral and Qwen3-MoE mappings (model/hf_arch.py, model/hf.py, `hf.py`) against `transformers`.

As tests/test_hf.py for Llama: random tiny MixtralForCausalLM and Qwen3MoeForCausalLM (torch,
CPU, float32, every weight random, norm scales included) are saved with `save_pretrained`
(which writes the per-expert layout of published checkpoints), read into our parameters and
scored on the same tokens; our parameters (imported, fine-tuned, or our own random init) are
written back and loaded by `transformers` strictly. Routing is dropless (capacity_factor 0,
the default), as theirs is. Same tolerance as test_hf.py: max |ours - theirs| <= TOL x max |logit|.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import require, stdlib_glob

torch = require("torch", "hf", lazy=True)
transformers = require("transformers", "hf", lazy=True)
pytestmark = pytest.mark.usefixtures("one_torch_thread")

import trainer  # noqa: E402
import hf as hf_cli  # noqa: E402
from configs import ConfigError, load_config  # noqa: E402
from model import hf, hf_arch  # noqa: E402
from model.safetensors_files import write_safetensors  # noqa: E402
from model.transformer import Transformer, transformer_from_params  # noqa: E402
from trainer.checkpoint import restore_params  # noqa: E402
from test_hf import (CPU0, TOKENS, TOL, VOCAB, assert_greedy_matches, load_sharded,  # noqa: E402
                     rel_diff, their_logits)


def logits(cfg, params: dict) -> np.ndarray:  # noqa: ANN001 (a ModelConfig)
    """Our logits of TOKENS, jitted: op by op, the routed experts' many small ops cost more."""
    return np.asarray(jax.jit(lambda p, t: transformer_from_params(cfg, p)(t))(params, jax.numpy.asarray(TOKENS)))

CLASSES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}  # transformers classes, looked up at use


def make_hf(path: str, arch: str, *, norm_topk: bool = False, tied: bool = False, seed: int = 0,
            sparse_step: int = 1) -> torch.nn.Module:
    """A random 2-layer (Qwen3-MoE with a sparse step: 2 x step layers), 4-expert, top-2 model of `arch` saved to `path`."""
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2 * sparse_step, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, num_experts_per_tok=2, rms_norm_eps=1e-6, tie_word_embeddings=tied)
    if arch == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=24, num_local_experts=4, rope_theta=1e6, **common)
    else:
        config = transformers.Qwen3MoeConfig(intermediate_size=40, moe_intermediate_size=24, num_experts=4,
                                             norm_topk_prob=norm_topk, decoder_sparse_step=sparse_step, **common)
    model = getattr(transformers, CLASSES[arch])(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def stored_names(directory: str) -> set[str]:
    with open(os.path.join(directory, "model.safetensors"), "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return set(header) - {"__metadata__"}


def export_and_load(params: dict, cfg, out: str, arch: str) -> torch.nn.Module:  # noqa: ANN001 (a ModelConfig)
    """Our parameters -> a Hugging Face directory -> `transformers`, failing on any missing,
    unexpected or mismatched weight."""
    os.makedirs(out)
    write_safetensors(hf.to_hf_tensors(params, cfg), os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf_arch.hf_config(cfg, {"eos_token_id": 256}), f)
    model, info = getattr(transformers, CLASSES[arch]).from_pretrained(out, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    return model.eval()


@pytest.mark.parametrize("arch, norm_topk, tied, sparse_step", [
    ("mixtral", False, False, 1),
    ("qwen3_moe", False, True, 1),
    ("qwen3_moe", True, False, 1),
    ("qwen3_moe", True, False, 2),  # layers 1 and 3 are MoE, 0 and 2 dense: model.moe.every=2
])
def test_import_matches_transformers_and_export_round_trips(tmp_path, arch, norm_topk, tied, sparse_step):
    theirs = make_hf(str(tmp_path / "hf"), arch, norm_topk=norm_topk, tied=tied, sparse_step=sparse_step)
    cfg = hf_cli.import_config(str(tmp_path / "hf"), str(tmp_path / "run"), "tiny-moe", []).model
    assert (cfg.moe.num_experts, cfg.moe.experts_per_token, cfg.moe.d_ff, cfg.qk_norm) == (4, 2, 24, arch != "mixtral")
    assert cfg.moe.every == sparse_step and cfg.num_layers == 2 * sparse_step
    assert cfg.moe.capacity_factor == 0
    params = hf.load_params(str(tmp_path / "hf"), cfg, CPU0)
    ref = their_logits(theirs, TOKENS)
    assert ref.std() > 0.5
    assert rel_diff(logits(cfg, params), ref) < TOL
    # The test tells the routers apart: without renormalizing the top-k weights (or with it,
    # where Qwen3 does not) the logits move.
    other = dataclasses.replace(cfg.moe, router="topk_softmax", renormalize=not cfg.moe.renormalize
                                if arch == "qwen3_moe" else False)
    assert rel_diff(logits(dataclasses.replace(cfg, moe=other), params), ref) > 100 * TOL

    out = str(tmp_path / "exported")
    exported = export_and_load(params, cfg, out, arch)
    assert stored_names(out) == stored_names(str(tmp_path / "hf"))  # the published per-expert layout
    assert rel_diff(their_logits(exported, TOKENS), ref) < TOL


@pytest.mark.parametrize("arch, every", [("mixtral", 1), ("qwen3_moe", 1), ("qwen3_moe", 2)])
def test_our_random_moe_exports_and_generates_as_transformers(tmp_path, arch, every):
    """Our own random init (norm scales drawn too) -> export -> transformers: logits and greedy
    decoding equal (every=2: layer 0 dense, layer 1 MoE, Qwen3-MoE's decoder_sparse_step=2)."""
    qwen = arch == "qwen3_moe"
    cfg = load_config("tiny-moe", [f"model.moe.every={every}", "model.num_layers=2", "model.d_model=32", "model.num_heads=4", "model.d_ff=40",
                                   "model.moe.num_experts=4", "model.moe.d_ff=24", "model.init_std=0.2",
                                   f"model.qk_norm={qwen}", f"model.tie_embeddings={qwen}",
                                   f"model.moe.router={'topk_softmax' if qwen else 'softmax_topk'}",
                                   "model.moe.renormalize=false"]).model
    params = nnx.to_pure_dict(nnx.state(Transformer(cfg, rngs=nnx.Rngs(every + 2))))
    keys = iter(jax.random.split(jax.random.key(4), 64))
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: 1 + 0.2 * jax.random.normal(next(keys), a.shape) if path[-1].key == "scale" else a, params)
    model = transformer_from_params(cfg, params)
    assert hf_arch.architecture(cfg) == arch
    theirs = export_and_load(params, cfg, str(tmp_path / "out"), arch)
    assert theirs.config.num_experts_per_tok == 2 and theirs.config.num_local_experts == 4
    assert getattr(theirs.config, "decoder_sparse_step", 1) == every
    ours = logits(cfg, params)
    assert rel_diff(their_logits(theirs, TOKENS), ours) < TOL
    assert_greedy_matches(model, theirs)


def test_sharded_load_into_an_expert_layout(tmp_path):
    """load_params into expert=2 x fsdp=2 x tensor=2 shardings gives the one-device arrays,
    each device reading only its experts."""
    make_hf(str(tmp_path / "hf"), "qwen3_moe")
    cfg = hf_cli.import_config(str(tmp_path / "hf"), str(tmp_path / "run"), "tiny-moe",
                               ["mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2", "mesh.data=1"])
    gate = load_sharded(str(tmp_path / "hf"), cfg)["layers"]["mlp"]["gate"]
    assert "expert" in gate.sharding.spec and len(gate.addressable_shards) == 8
    assert gate.addressable_shards[0].data.shape[1] == 2  # half the experts


def test_import_fine_tune_on_expert_layout_then_export(tmp_path, capsys):
    """hf.py import of a Mixtral; 2 steps on expert=2 x data=4; hf.py export; transformers
    reproduces the fine-tuned logits."""
    hf_dir, run = str(tmp_path / "hf"), str(tmp_path / "run")
    make_hf(hf_dir, "mixtral", seed=2)
    assert hf_cli.main(["import", "--hf-dir", hf_dir, "--run-dir", run, "--config", "tiny-moe",
                        f"data.path={stdlib_glob('json')}", "train.steps=2", "checkpoint.every=2",
                        "model.seq_len=32", "train.global_batch=8", "eval.every=0"]) == 0
    _, _, imported = restore_params(run, device=jax.devices()[0])
    trainer.run(load_config(os.path.join(run, "config.yaml"), ["mesh.expert=2"]))
    assert "resumed from step 0" in capsys.readouterr().out
    cfg, step, tuned = restore_params(run)
    assert step == 2
    tuned_logits = logits(cfg.model, tuned)
    assert rel_diff(tuned_logits, logits(cfg.model, imported)) > 100 * TOL  # training moved the weights
    out = str(tmp_path / "exported")
    assert hf_cli.main(["export", "--run-dir", run, "--out", out]) == 0
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert isinstance(model, transformers.MixtralForCausalLM) and not info["missing_keys"], info
    assert rel_diff(their_logits(model.eval(), TOKENS), tuned_logits) < TOL


def test_what_cannot_be_expressed_names_itself(tmp_path, tiny):
    config = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         mlp_only_layers=[0], attention_bias=True)
    config.save_pretrained(str(tmp_path / "q"))
    with pytest.raises(ConfigError, match=r"cannot express: attention_bias=True, mlp_only_layers=\[0\]$"):
        hf_cli.import_config(str(tmp_path / "q"), str(tmp_path / "run"), "tiny-moe", [])
    transformers.MixtralConfig(sliding_window=4096).save_pretrained(str(tmp_path / "m"))
    with pytest.raises(ConfigError, match=r"cannot express: sliding_window=4096$"):
        hf_cli.import_config(str(tmp_path / "m"), str(tmp_path / "run"), "tiny-moe", [])
    make_hf(str(tmp_path / "hf"), "mixtral")  # a dense config given for an MoE checkpoint
    with pytest.raises(ConfigError, match=r"^model.moe.num_experts=0 but the Hugging Face checkpoint .* has 4; "):
        hf.check_compatible(tiny("model.num_layers=2").model, str(tmp_path / "hf"))
    make_hf(str(tmp_path / "qwen"), "qwen3_moe")
    with pytest.raises(ConfigError, match=r"^model.qk_norm=False but .* has True; "):
        hf.check_compatible(tiny("model.moe.num_experts=4").model, str(tmp_path / "qwen"))
    refusals = {"model.moe.shared_experts=1": r"^model.moe.shared_experts=1: neither Mixtral nor Qwen3-MoE",
                "model.moe.router=topk_softmax model.moe.renormalize=false": r"^model.moe.renormalize=false needs",
                "model.qk_norm=true model.moe.num_experts=0": r"^model.qk_norm=true on a dense model",
                "model.moe.every=2": r"^model.moe.every=2: Mixtral has an MoE in every layer"}
    for overrides, message in refusals.items():
        with pytest.raises(ConfigError, match=message):
            hf_arch.architecture(load_config("tiny-moe", overrides.split()).model)
