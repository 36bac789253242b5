"""Oracle tests of model/hf.py (and the `hf.py` command) against `transformers`: the same Llama gives the same logits.

A small random LlamaForCausalLM (torch, CPU, float32) is saved with `save_pretrained`, read
into our parameters, and both models score the same tokens; then our parameters are written
back out and loaded by `transformers` again. Tolerance: max |ours - theirs| <= TOL x max |logit|
with TOL = 1e-4 (float32 rounding of two different op orders; observed differences ~1e-6).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from bench.procs import cpu_env
from conftest import ROOT, require, stdlib_glob

torch = require("torch", "hf", lazy=True)
transformers = require("transformers", "hf", lazy=True)
pytestmark = pytest.mark.usefixtures("one_torch_thread")

import trainer  # noqa: E402
from configs import ConfigError, load_config  # noqa: E402
import hf as hf_cli  # noqa: E402
from model import hf, hf_arch  # noqa: E402
from model.decode import generate  # noqa: E402
from model.safetensors_files import write_safetensors  # noqa: E402
from model.transformer import transformer_from_params  # noqa: E402
from trainer.checkpoint import restore_params  # noqa: E402
from trainer.program import abstract_program  # noqa: E402

TOL = 1e-4
VOCAB = 264  # the byte tokenizer's 257 ids, padded: the fine-tuning test trains on bytes
CPU0 = jax.sharding.SingleDeviceSharding(jax.devices()[0])


def make_hf(path: str, *, tied: bool, kv_heads: int, rope_theta: float = 10000.0, head_dim: int | None = None,
            seed: int = 0) -> transformers.LlamaForCausalLM:
    """A random 2-layer Llama saved to `path`. Every weight, norm scales included, is drawn at
    random: with the default init (norms = 1) a swapped norm mapping would go unnoticed."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, head_dim=head_dim or 8, rope_theta=rope_theta, rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def their_logits(model: transformers.LlamaForCausalLM, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def our_logits(cfg, params: dict, tokens: np.ndarray) -> np.ndarray:  # noqa: ANN001 (a Config)
    return np.asarray(transformer_from_params(cfg.model, params)(jax.numpy.asarray(tokens)))


def rel_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def load_exported(path: str) -> transformers.LlamaForCausalLM:
    """from_pretrained, failing on any missing, unexpected or mismatched weight."""
    model, info = transformers.LlamaForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    return model.eval()


TOKENS = np.random.RandomState(0).randint(0, VOCAB, (2, 12))


@pytest.mark.parametrize(
    "tied, kv_heads, rope_theta, head_dim",
    [
        (True, 2, 10000.0, None),  # grouped-query attention, tied head
        (False, 2, 500000.0, 16),  # untied head, Llama-3 rotary base, head_dim != d_model / heads
        (False, 4, 10000.0, None),  # plain multi-head attention
    ],
)
def test_import_matches_transformers_and_export_round_trips(tmp_path, tied, kv_heads, rope_theta, head_dim):
    theirs = make_hf(str(tmp_path / "hf"), tied=tied, kv_heads=kv_heads, rope_theta=rope_theta, head_dim=head_dim)
    cfg = hf_cli.import_config(str(tmp_path / "hf"), str(tmp_path / "run"), "tiny", [])
    assert (cfg.model.num_kv_heads, cfg.model.tie_embeddings, cfg.model.rope_theta) == (kv_heads, tied, rope_theta)
    params = hf.load_params(str(tmp_path / "hf"), cfg.model, CPU0)
    assert ("lm_head" in params) != tied

    ref = their_logits(theirs, TOKENS)
    assert ref.std() > 0.5  # far from a degenerate (all-equal) output
    ours = our_logits(cfg, params, TOKENS)
    assert rel_diff(ours, ref) < TOL
    if rope_theta != 10000.0:  # the test can tell rotary bases apart
        other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, rope_theta=10000.0))
        assert rel_diff(our_logits(other, params, TOKENS), ref) > 100 * TOL

    out = tmp_path / "exported"
    out.mkdir()
    write_safetensors(hf.to_hf_tensors(params, cfg.model), str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(hf_arch.hf_config(cfg.model, {"eos_token_id": 256})))
    assert rel_diff(their_logits(load_exported(str(out)), TOKENS), ref) < TOL


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["umask022", "umask027"])
def test_exported_tensors_get_the_permissions_open_gives(tmp_path, umask):
    """model.safetensors gets the mode config.json gets (0666 less the umask), not a private 0600."""
    old = os.umask(umask)
    try:
        write_safetensors({"w": np.ones((2, 3), np.float32)}, str(tmp_path / "model.safetensors"))
        (tmp_path / "config.json").write_text("{}")
    finally:
        os.umask(old)
    mode = lambda name: os.stat(tmp_path / name).st_mode & 0o777  # noqa: E731
    assert mode("model.safetensors") == mode("config.json") == 0o666 & ~umask
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]  # no temporary file left


def test_sharded_load_reads_each_block(tmp_path):
    """load_params into pipeline=2 x fsdp=2 x tensor=2 shardings gives the one-device arrays."""
    make_hf(str(tmp_path / "hf"), tied=False, kv_heads=2)
    cfg = hf_cli.import_config(str(tmp_path / "hf"), str(tmp_path / "run"), "tiny",
                           ["mesh.pipeline=2", "mesh.fsdp=2", "mesh.tensor=2", "mesh.data=1"])
    q = load_sharded(str(tmp_path / "hf"), cfg)["layers"]["attn"]["q"]
    assert q.sharding.spec[:3] == ("pipeline", "fsdp", "tensor") and len(q.addressable_shards) == 8


def load_sharded(hf_dir: str, cfg) -> dict:  # noqa: ANN001 (a Config)
    """load_params into the run's parameter shardings; each array is placed as the shardings
    say and equals the one-device load."""
    shardings = abstract_program(cfg).state_sh.params
    sharded = hf.load_params(hf_dir, cfg.model, shardings)
    whole = hf.load_params(hf_dir, cfg.model, CPU0)
    for a, sh, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(shardings), jax.tree.leaves(whole), strict=True):
        assert a.sharding == sh
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    return sharded


def test_unsupported_options_name_themselves(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        rope_scaling={"rope_type": "linear", "factor": 2.0}, attention_bias=True,
    )
    config.save_pretrained(str(tmp_path / "v5"))
    with pytest.raises(ConfigError, match=r"cannot express: rope_parameters.rope_type='linear', attention_bias=True"):
        hf_cli.import_config(str(tmp_path / "v5"), str(tmp_path / "run"), "tiny", [])
    # transformers 4.x files name rope scaling differently
    legacy = json.loads((tmp_path / "v5" / "config.json").read_text())
    legacy.update(rope_parameters=None, attention_bias=False, rope_theta=10000.0, hidden_act="gelu",
                  rope_scaling={"type": "dynamic", "factor": 2.0})
    (tmp_path / "v4").mkdir()
    (tmp_path / "v4" / "config.json").write_text(json.dumps(legacy))
    with pytest.raises(ConfigError, match=r"hidden_act='gelu', rope_scaling=\{'type': 'dynamic'"):
        hf_cli.import_config(str(tmp_path / "v4"), str(tmp_path / "run"), "tiny", [])


def test_a_config_that_does_not_fit_the_checkpoint_names_the_key(tmp_path, tiny):
    make_hf(str(tmp_path / "hf"), tied=True, kv_heads=2)
    with pytest.raises(ConfigError, match=r"model.num_layers=4 but the Hugging Face checkpoint init.from_hf=.* has 2"):
        hf.check_compatible(tiny().model, str(tmp_path / "hf"))
    with pytest.raises(ConfigError, match=r"^model.moe.num_experts=4 but the Hugging Face checkpoint .* has 0; "):
        hf.check_compatible(tiny("model.moe.num_experts=4").model, str(tmp_path / "hf"))
    with pytest.raises(ConfigError, match="model.num_layers=4"):  # train.py refuses before writing anything
        trainer.run(tiny(f"init.from_hf={tmp_path / 'hf'}", "train.steps=1"))
    assert not os.path.exists(tiny().run.dir)


def test_import_cli_fine_tune_on_a_pipeline_then_export(tmp_path, capsys):
    """import -> step-0 checkpoint; fine-tune 2 steps on pipeline=2 x tensor=2 x data=2;
    export in a process with one device; transformers reproduces the fine-tuned logits."""
    hf_dir, run = str(tmp_path / "hf"), str(tmp_path / "run")
    theirs = make_hf(hf_dir, tied=False, kv_heads=2)
    args = ["import", "--hf-dir", hf_dir, "--run-dir", run, "--config", "tiny", f"data.path={stdlib_glob('json')}",
            "train.steps=2", "checkpoint.every=2", "train.log_every=1"]
    assert hf_cli.main(args) == 0
    cfg, step, imported = restore_params(run, device=jax.devices()[0])
    assert step == 0 and cfg.init.from_hf == hf_dir and cfg.mesh.data == -1
    assert rel_diff(our_logits(cfg, imported, TOKENS), their_logits(theirs, TOKENS)) < TOL

    history = trainer.run(load_config(os.path.join(run, "config.yaml"), ["mesh.pipeline=2", "mesh.tensor=2"]))
    assert "resumed from step 0" in capsys.readouterr().out
    # The same start without the import step: init.from_hf read straight into another sharded layout.
    direct = load_config(os.path.join(run, "config.yaml"), [f"run.dir={tmp_path / 'direct'}", "train.steps=1",
                                                            "mesh.fsdp=2", "mesh.tensor=2"])
    first = trainer.run(direct)[0]
    assert "initialized the parameters from" in capsys.readouterr().out
    assert first["step"] == history[0]["step"] == 1
    assert abs(first["loss"] - history[0]["loss"]) < 1e-5 * history[0]["loss"]
    cfg, step, tuned = restore_params(run)
    assert step == 2
    tuned_logits = our_logits(cfg, tuned, TOKENS)
    assert rel_diff(tuned_logits, our_logits(cfg, imported, TOKENS)) > 100 * TOL  # training moved the weights

    out = str(tmp_path / "exported")
    proc = subprocess.run([sys.executable, "hf.py", "export", "--run-dir", run, "--out", out],
                          cwd=ROOT, env=cpu_env(1), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "exported step 2" in proc.stdout
    modes = {name: os.stat(os.path.join(out, name)).st_mode & 0o777 for name in os.listdir(out)}
    assert len(set(modes.values())) == 1, modes  # every exported file alike (the umask's)
    exported = load_exported(out)
    assert exported.config.eos_token_id == theirs.config.eos_token_id  # carried over from the import
    assert rel_diff(their_logits(exported, TOKENS), tuned_logits) < TOL

    # --dtype bfloat16: half the bytes, BF16 tensors; transformers (upcast to float32) gives the
    # logits of our model with its weights rounded to bfloat16, within TOL; not the exact ones.
    half = str(tmp_path / "exported-bf16")
    assert hf_cli.main(["export", "--run-dir", run, "--out", half, "--dtype", "bfloat16"]) == 0
    assert safetensors_dtypes(half) == {"BF16"} and safetensors_dtypes(out) == {"F32"}
    size = lambda d: os.path.getsize(os.path.join(d, "model.safetensors"))  # noqa: E731
    assert size(half) < 0.51 * size(out)
    rounded = jax.tree.map(lambda a: np.asarray(a).astype(jax.numpy.bfloat16).astype(np.float32), tuned)
    from_bf16 = their_logits(load_exported(half).float(), TOKENS)
    assert rel_diff(from_bf16, our_logits(cfg, rounded, TOKENS)) < TOL
    assert rel_diff(from_bf16, tuned_logits) > 10 * TOL  # the rounding really happened
    # A non-empty --out is left alone unless --overwrite.
    before = open(os.path.join(half, "model.safetensors"), "rb").read()
    assert hf_cli.main(["export", "--run-dir", run, "--out", half]) == 2
    assert "is not empty; give --overwrite" in capsys.readouterr().err
    assert open(os.path.join(half, "model.safetensors"), "rb").read() == before
    assert hf_cli.main(["export", "--run-dir", run, "--out", half, "--overwrite"]) == 0
    assert safetensors_dtypes(half) == {"F32"}


def safetensors_dtypes(directory: str) -> set[str]:
    with open(os.path.join(directory, "model.safetensors"), "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return {meta["dtype"] for name, meta in header.items() if name != "__metadata__"}


def test_greedy_generation_matches_transformers(tmp_path):
    theirs = make_hf(str(tmp_path / "hf"), tied=True, kv_heads=2, seed=1)
    cfg = hf_cli.import_config(str(tmp_path / "hf"), str(tmp_path / "run"), "tiny", [])
    assert_greedy_matches(transformer_from_params(cfg.model, hf.load_params(str(tmp_path / "hf"), cfg.model, CPU0)),
                          theirs)


def assert_greedy_matches(model, theirs) -> None:  # noqa: ANN001 (our Transformer, a transformers model)
    """10 greedy tokens after a 6-token prompt: ours (KV-cached decoding) equal theirs, and vary."""
    ours = np.asarray(generate(model, TOKENS[:1, :6], 10))
    with torch.no_grad():  # no end-of-sequence id: both must produce all 10 tokens
        ref = theirs.generate(torch.tensor(TOKENS[:1, :6]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[:, 6:].numpy()
    assert ref.shape == (1, 10) and len(set(ref[0].tolist())) > 1
    np.testing.assert_array_equal(ours, ref)
