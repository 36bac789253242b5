"""Config: presets load, overrides are typed, and bad keys or values fail with one clear line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from configs import Config, ConfigError, all_keys, dump_config, load_config
from conftest import ROOT

PRESETS = ["tiny", "lora-tiny", "llama3-1b", "llama3-3b", "llama3-8b", "llama3-70b", "tiny-deepseek", "deepseek-v3",
           "moonlight-16b", "addition-sft-tiny", "grpo-tiny"]


@pytest.mark.parametrize("name", PRESETS)
def test_presets_load_and_start_with_their_command(name):
    path = os.path.join(ROOT, "configs", f"{name}.yaml")
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    with open(path) as f:
        assert "python train.py --config" in f.read(), "each preset documents the command that runs it"


def test_tiny_runs_every_layout_on_8_devices():
    m = load_config("tiny").model
    for size in (m.num_heads, m.num_kv_heads, m.d_ff, m.vocab_size, load_config("tiny").train.global_batch):
        assert size % 8 == 0


def test_llama3_1b_shape():
    m = load_config("llama3-1b").model
    got = (m.num_layers, m.d_model, m.num_heads, m.num_kv_heads, m.d_ff, m.vocab_size, m.seq_len)
    assert got == (16, 2048, 32, 8, 8192, 128256, 4096)
    assert m.tie_embeddings and m.rope_theta == 500000.0 and m.dtype == "bfloat16"


def test_overrides_are_typed():
    cfg = load_config("tiny", ["train.steps=7", "optim.lr=1e-3", "model.tie_embeddings=false", "run.dir=x"])
    assert cfg.train.steps == 7 and isinstance(cfg.train.steps, int)
    assert cfg.optim.lr == pytest.approx(1e-3) and isinstance(cfg.optim.lr, float)
    assert cfg.model.tie_embeddings is False
    assert cfg.run.dir == "x"


def test_overrides_win_over_the_file_and_the_file_over_defaults():
    assert Config().model.d_model != load_config("tiny").model.d_model
    assert load_config("tiny", ["model.d_model=128"]).model.d_model == 128


def test_rules_are_data():
    cfg = load_config("tiny", ["sharding.params.embed=null", "sharding.activations.batch=[data]"])
    assert cfg.sharding.params["embed"] is None
    assert cfg.sharding.activations["batch"] == ["data"]


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config("tiny", ["mesh.fsdp=2", "optim.lr=0.01"])
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(str(path)) == cfg


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.step=3"], "unknown config key 'train.step' (did you mean train.steps?)"),
        (["modle.d_model=3"], "did you mean model.d_model?"),
        # Another stack's name, or a typo of the field, is ranked by the key's last part.
        (["optim.learning_rate=1e-3"], "unknown config key 'optim.learning_rate' (did you mean optim.lr?)"),
        (["learning_rate=1e-3"], "unknown config key 'learning_rate' (did you mean optim.lr?)"),
        (["train.batch_size=8"], "(did you mean train.global_batch?)"),
        (["model.num_hidden_layers=2"], "(did you mean model.num_layers?)"),
        (["data.seq_len=64"], "(did you mean model.seq_len?)"),
        (["optim.weight_decy=0.1"], "(did you mean optim.weight_decay?)"),
        (["train.steps=abc"], "train.steps: expected int, got 'abc'"),
        (["model.tie_embeddings=maybe"], "model.tie_embeddings: expected bool"),
        (["train.steps=-1"], "train.steps: must be >= 0, got -1"),
        (["train.global_batch=0"], "train.global_batch: must be > 0"),
        (["model.remat=sometimes"], "model.remat: 'sometimes' is not one of"),
        (["model.max_documents=-1"], "model.max_documents: must be >= 0 (0: no bound), got -1"),
        (["model.num_kv_heads=3"], "model.num_kv_heads: 3 does not divide model.num_heads=16"),
        (["sharding.params.embed=fsdb"], "sharding.params.embed: 'fsdb' is not a mesh axis"),
        (["sharding.params.embd=fsdp"], "sharding.params.embd: unknown logical name; did you mean 'embed'?"),
        (["sharding.activations.kv_head=tensor"], "sharding.activations.kv_head: unknown logical name; did you mean 'kv_heads'?"),
        (["sharding.params.routing=null"], "sharding.params.routing: unknown logical name; the model's names are batch, "),
        (["model.moe.router=top1"], "model.moe.router: 'top1' is not one of softmax_topk, topk_softmax"),
        (["model.moe.num_experts=-2"], "model.moe.num_experts: must be >= 0 (0: dense), got -2"),
        (["model.moe.every=-1"], "model.moe.every: must be >= 1 (1: every layer is an MoE), got -1"),
        (["steps"], "override 'steps' is not of the form key=value"),
    ],
)
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config("tiny", overrides)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_config_file():
    with pytest.raises(ConfigError, match="config file not found: nope.yaml"):
        load_config("nope.yaml")


def test_an_unknown_preset_gets_the_nearest_one_and_the_list():
    with pytest.raises(ConfigError) as err:
        load_config("tiny-moee")
    assert str(err.value) == ("config file not found: tiny-moee (did you mean tiny-moe?); presets: addition-sft-tiny, "
                              "deepseek-v3, dpo-tiny, grpo-tiny, llama3-1b, llama3-3b, llama3-70b, llama3-8b, "
                              "llama3-8b-128k, llama3-8b-dpo, llama3-8b-sft, lora-tiny, mixtral-8x7b, moonlight-16b, "
                              "sft-tiny, tiny, tiny-deepseek, tiny-moe")
    with pytest.raises(ConfigError, match=r"^config file not found: nope.yaml; presets: addition-sft-tiny, .*, tiny-moe$"):
        load_config("nope.yaml")  # nothing near it: the list alone


def test_a_rules_table_in_yaml_with_an_unknown_logical_name(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("sharding:\n  params:\n    batch: [data, fsdp]\n    embd: fsdp\n")
    with pytest.raises(ConfigError, match="^sharding.params.embd: unknown logical name; did you mean 'embed'\\?$"):
        load_config(str(path))


def test_yaml_with_a_wrong_type_names_the_file_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  steps: lots\n")
    with pytest.raises(ConfigError, match="train.steps: expected int, got 'lots'"):
        load_config(str(path))


# Keys whose type gives no valid non-default value by itself (a choice, a format, a constraint
# between keys): the value to set, and the other overrides it needs.
EXPLICIT: dict[str, tuple[Any, list[str]]] = {
    "train.preempt_exit_code": (0, []),
    "train.objective": ("sft", ["data.source=prepared", "data.path=/a", "data.packing=document"]),
    "dpo.loss": ("ipo", []),
    "rl.top_p": (0.9, []),
    "rl.loss_averaging": ("sequence", []),
    "rl.reward": ("exact_match,length_penalty", []),
    "mesh.data": (2, []),
    "mesh.nodes": (2, ["mesh.data=2"]),
    "mesh.expert": (2, ["model.moe.num_experts=4"]),
    "model.moe.num_experts": (4, []),
    "model.moe.router": ("topk_softmax", []),
    "model.moe.grouped_matmul": ("ragged_dot", []),
    "model.moe.dispatch": ("ragged", []),
    "mesh.across": ("pipeline", ["mesh.pipeline=2"]),
    "model.head_dim": (16, []),
    "model.dtype": ("bfloat16", []),
    "model.remat": ("save_dots", []),
    "model.attention": ("dot_product", []),
    "model.attention_type": ("mla", ["model.num_kv_heads=8"]),
    "model.rope_scaling.type": ("yarn", ["model.attention_type=mla", "model.num_kv_heads=8"]),
    "model.quant": ("fp8", []),
    "model.grad_reduce": ("bfloat16", []),
    "model.gather_dtype": ("fp8", []),
    "model.logits_dtype": ("float32", []),
    "context.strategy": ("ring", []),
    "pipeline.schedule": ("interleaved_1f1b", ["pipeline.repeats=2"]),
    "data.source": ("synthetic", []),
    "data.mixture": ("/a:0.5,/b:0.5", ["data.source=prepared"]),
    "data.packing": ("document", []),
    "optim.schedule": ("linear", []),
    "optim.name": ("muon", []),
    "run.trackers": (["tensorboard", "mlflow"], []),
    "eval.tasks": (["stdlib_words", "hellaswag"], []),
    "model.lora.targets": (["q", "v", "down"], ["model.lora.rank=4"]),
    "model.lora.dropout": (0.1, ["model.lora.rank=4"]),
    "dist.coordinator": ("10.0.0.1:1234", []),
    "checkpoint.local_dir": ("/local/ckpt", ["checkpoint.local_every=10"]),
    "checkpoint.local_every": (10, ["checkpoint.local_dir=/local/ckpt"]),
    "debug.nan_steps": ("3,7", []),
    "profile.steps": ([1, 2], []),
    "sharding.params": ({"embed": None, "heads": "tensor"}, []),
    "sharding.activations": ({"batch": ["data"]}, []),
}


def _other_value(key: str, default: Any) -> Any:
    """A valid value for `key` that differs from its default."""
    if key in EXPLICIT:
        return EXPLICIT[key][0]
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default * 2 if default > 0 else default + 1
    assert isinstance(default, str), (key, default)
    return f"{default}-x" if default else "x"


def _cli_text(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def _get(cfg: Config, key: str) -> Any:
    for name in key.split("."):
        cfg = getattr(cfg, name)
    return cfg


def test_every_key_is_settable():
    """Each key of the schema, set on the command line to a value other than its default, lands
    in the config with that value and type."""
    keys = all_keys()
    assert set(EXPLICIT) <= set(keys), set(EXPLICIT) - set(keys)
    for key in keys:
        default = _get(Config(), key)
        value = _other_value(key, default)
        assert value != default, key
        cfg = load_config(None, [*EXPLICIT.get(key, (None, []))[1], f"{key}={_cli_text(value)}"])
        got = _get(cfg, key)
        assert got == value and type(got) is type(value), (key, got, value)


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.eval_fraction=1", "data.eval_fraction: must be in [0, 1), got 1.0"),
        ("optim.min_lr_ratio=2", "optim.min_lr_ratio: must be in [0, 1], got 2.0"),
        ("run.seed=-1", "run.seed: must be in [0, 2**32), got -1"),
        ("train.step_timeout_s=-1", "train.step_timeout_s: must be >= 0 (0: off), got -1.0"),
        ("run.dir=", "run.dir: must not be empty"),
        ("run.trackers=[tensorboard,wandbb]", "run.trackers: 'wandbb' is not one of tensorboard, wandb, mlflow"),
        ("run.trackers=5", "run.trackers: expected a list of str, got 5"),
    ],
)
def test_declared_ranges_and_choices_word_the_error(override, message):
    """A field's Range or Literal words its error line: the bounds, the hint, the value as the
    field holds it (a float field's -1 reads -1.0) and the choices in declaration order."""
    with pytest.raises(ConfigError) as err:
        load_config("tiny", [override])
    assert str(err.value) == message


def test_every_key_has_a_one_line_docstring():
    from configs.fields import keys

    missing = [k.name for k in keys(Config).values() if not k.doc or "\n" in k.doc]
    assert missing == [], f"give each of these fields a one-line docstring right under it: {missing}"
    assert set(keys(Config)) == set(all_keys())


def test_remat_saves_names_the_remat_choices():
    from configs.schema import REMAT_POLICIES, REMAT_SAVES

    assert tuple(REMAT_SAVES) == REMAT_POLICIES


# The keys a resumed run must keep, as marked `Resume` on the schema's fields (configs/fields.py),
# in schema order (the order trainer/checkpoint.py compares them in). Update this list deliberately,
# in the same change that marks or unmarks a field: each one fixes the shapes of the state, or
# which example comes at which step, and a wrong one lets a resume silently change the run.
FIXED_ON_RESUME = [
    "run.seed", "train.global_batch",
    "model.num_layers", "model.d_model", "model.num_heads", "model.num_kv_heads", "model.head_dim", "model.d_ff",
    "model.vocab_size", "model.seq_len", "model.tie_embeddings", "model.qk_norm", "model.attention_type",
    "model.mtp_depth",
    "model.moe.num_experts", "model.moe.every", "model.moe.first_k_dense_replace", "model.moe.d_ff",
    "model.moe.shared_experts",
    "model.lora.rank", "model.lora.targets",
    "model.mla.q_lora_rank", "model.mla.kv_lora_rank", "model.mla.qk_rope_head_dim", "model.mla.qk_nope_head_dim",
    "model.mla.v_head_dim",
    "data.source", "data.path", "data.mixture", "data.tokenizer", "data.packing", "data.eval_fraction",
    "distill.teacher",
]


def test_the_keys_fixed_on_resume_are_the_marked_ones():
    """`configs.resume_keys()` reads the fields marked `Resume`: exactly FIXED_ON_RESUME, each
    compared as itself except model.head_dim, compared resolved (its 0 means d_model // num_heads)."""
    from configs import resume_keys

    assert list(resume_keys()) == FIXED_ON_RESUME
    assert {k: v for k, v in resume_keys().items() if k != v} == {"model.head_dim": "model.resolved_head_dim"}


def test_docs_config_md_is_fresh():
    from configs.doc import REGENERATE, markdown

    with open(os.path.join(ROOT, "docs", "config.md")) as f:
        assert f.read() == markdown(), f"docs/config.md is stale: regenerate it with `{REGENERATE}`"


def test_help_config_lists_every_key_without_importing_jax():
    script = (
        "import contextlib, io, runpy, sys\n"
        "sys.argv = ['train.py', '--help-config']\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        "    try:\n"
        "        runpy.run_path('train.py', run_name='__main__')\n"
        "    except SystemExit as e:\n"
        "        code = e.code\n"
        "print(code, 'jax' in sys.modules)\n"
        "print(out.getvalue())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    status, listing = done.stdout.split("\n", 1)
    assert status == "0 False", "--help-config exits 0 and never imports JAX"
    for key in all_keys():
        assert f"  {key}: " in listing, key
    assert "  model.quant: none | fp8 | int8 = none\n" in listing
    assert "  model.max_documents: int >= 0 (0: no bound) = 0\n" in listing
    assert "  profile.steps: list of int = []\n" in listing
