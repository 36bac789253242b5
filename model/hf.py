"""Hugging Face Llama checkpoints in and out: `python -m model.hf import|export`.

    python -m model.hf import --hf-dir DIR --run-dir RUN [--config PRESET] [key=value ...]
    python -m model.hf export --run-dir RUN --out DIR [--step N] [--dtype bfloat16] [--overwrite]

The two layouts hold the same numbers: a Hugging Face projection `W` ([out, in], applied as
`x @ W.T`) is our `W.T` reshaped to named dims (q: [embed, heads, head_dim]; o: [heads,
head_dim, embed]), and the per-layer tensors are stacked on a leading `layers` dim. Rotary
embeddings use the same half-split convention (`rotate_half`), so q and k need no permutation;
the oracle tests in tests/test_hf.py check all of it against `transformers` logits.

Safetensors files are read and written by model/safetensors_files.py with numpy memory maps,
so no torch is needed, bfloat16 files included, and `load_params` reads only the slices that
this process's devices hold.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx

from configs import dump_config, load_config
from configs.schema import ConfigError, MeshConfig, ModelConfig, PipelineConfig
from model.safetensors_files import EXPORT_DTYPES, SafetensorsDir, write_safetensors  # noqa: F401 (re-exported)
from model.transformer import abstract_transformer

# (our parameter path, Hugging Face tensor name, input dims). "{i}" is the layer index. A
# projection with n input dims is stored by Hugging Face as [prod(other dims), prod(input dims)]
# (torch's [out, in]); ours keeps the dims named, input first. 0: stored as is (norms, embedding).
TENSORS: tuple[tuple[tuple[str, ...], str, int], ...] = (
    (("embedding",), "model.embed_tokens.weight", 0),
    (("final_norm", "scale"), "model.norm.weight", 0),
    (("lm_head",), "lm_head.weight", 1),
    (("layers", "attn_norm", "scale"), "model.layers.{i}.input_layernorm.weight", 0),
    (("layers", "attn", "q"), "model.layers.{i}.self_attn.q_proj.weight", 1),
    (("layers", "attn", "k"), "model.layers.{i}.self_attn.k_proj.weight", 1),
    (("layers", "attn", "v"), "model.layers.{i}.self_attn.v_proj.weight", 1),
    (("layers", "attn", "o"), "model.layers.{i}.self_attn.o_proj.weight", 2),
    (("layers", "mlp_norm", "scale"), "model.layers.{i}.post_attention_layernorm.weight", 0),
    (("layers", "mlp", "gate"), "model.layers.{i}.mlp.gate_proj.weight", 1),
    (("layers", "mlp", "up"), "model.layers.{i}.mlp.up_proj.weight", 1),
    (("layers", "mlp", "down"), "model.layers.{i}.mlp.down_proj.weight", 1),
)

# Options whose non-default values change the network in ways ModelConfig cannot express.
UNSUPPORTED_DEFAULTS = {
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "rope_scaling": None,
    "sliding_window": None,
}


def read_hf_config(hf_dir: str, key: str) -> dict[str, Any]:
    path = os.path.join(hf_dir, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except OSError:
        raise ConfigError(f"{key}: no Hugging Face config at {path}") from None
    except ValueError as e:
        raise ConfigError(f"{key}: {path} is not valid JSON ({e})") from None


def _rope_theta(hf: dict[str, Any]) -> tuple[float, list[str]]:
    """The rotary base and the rope options we cannot express. transformers 5 writes
    `rope_parameters`; 4.x writes `rope_theta` and `rope_scaling`."""
    params = hf.get("rope_parameters") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    bad = [] if rope_type == "default" else [f"rope_parameters.rope_type={rope_type!r}"]
    return float(theta), bad


def model_keys(hf: dict[str, Any], key: str) -> dict[str, Any]:
    """A Hugging Face Llama config.json -> our `model.*` values. Raises ConfigError naming every
    option the model cannot express."""
    path = f"{key}/config.json"
    if hf.get("model_type") != "llama":
        raise ConfigError(f"{key}: {path} has model_type={hf.get('model_type')!r}; only 'llama' can be read")
    theta, bad = _rope_theta(hf)
    bad += [f"{n}={hf[n]!r}" for n, default in UNSUPPORTED_DEFAULTS.items() if hf.get(n, default) != default]
    if bad:
        raise ConfigError(f"{key}: {path} uses options this model cannot express: {', '.join(bad)}")
    heads = hf["num_attention_heads"]
    return {
        "num_layers": hf["num_hidden_layers"],
        "d_model": hf["hidden_size"],
        "num_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "d_ff": hf["intermediate_size"],
        "vocab_size": hf["vocab_size"],
        "rope_theta": theta,
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


def check_compatible(cfg: ModelConfig, hf_dir: str, key: str = "init.from_hf") -> None:
    """`cfg` must describe the network stored in `hf_dir`; ConfigError names the first key that does not."""
    for name, value in model_keys(read_hf_config(hf_dir, key), key).items():
        ours = cfg.resolved_head_dim if name == "head_dim" else getattr(cfg, name)
        if ours != value:
            raise ConfigError(
                f"model.{name}={ours!r} but the Hugging Face checkpoint {key}={hf_dir} has {value!r}; "
                f"set model.{name}={value} (python -m model.hf import writes a matching config)"
            )


def _get_path(tree: dict, path: tuple[str, ...]) -> Any:
    for part in path:
        tree = tree[part]
    return tree


def _set_path(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for part in path[:-1]:
        tree = tree.setdefault(part, {})
    tree[path[-1]] = value


def _entries(cfg: ModelConfig) -> list[tuple[tuple[str, ...], str, int]]:
    return [e for e in TENSORS if not (cfg.tie_embeddings and e[0] == ("lm_head",))]


def _hf_shape(ours: tuple[int, ...], n_in: int) -> tuple[int, ...]:
    return (int(np.prod(ours[n_in:])), int(np.prod(ours[:n_in]))) if n_in else ours


def _to_ours(w: np.ndarray, shape: tuple[int, ...], n_in: int) -> np.ndarray:
    """One Hugging Face tensor -> our (unstacked) layout, float32."""
    w = np.asarray(w, dtype=np.float32)
    return (w.T if n_in else w).reshape(shape)


def _from_ours(a: np.ndarray, n_in: int) -> np.ndarray:
    """Inverse of `_to_ours`: e.g. o [heads, head_dim, embed] -> [heads*head_dim, embed] -> [embed, heads*head_dim]."""
    a = np.asarray(a, dtype=np.float32)
    return np.ascontiguousarray(a.reshape(int(np.prod(a.shape[:n_in])), -1).T if n_in else a)


def param_shapes(cfg: ModelConfig) -> dict:
    """Our parameters' ShapeDtypeStructs (nested dict, layers stacked), without allocating."""
    return nnx.to_pure_dict(nnx.state(abstract_transformer(cfg)))


def _reader(files: SafetensorsDir, names: list[str], shape: tuple[int, ...], n_in: int, stacked: bool) -> Callable:
    """The callback that reads the block `index` of one parameter for one device; a stacked
    parameter ([layers, ...], one tensor name per layer) is read one layer at a time."""
    one = shape[1:] if stacked else shape

    def tensor(name: str) -> np.ndarray:
        return _to_ours(files.get(name, _hf_shape(one, n_in)), one, n_in)

    def read(index: tuple) -> np.ndarray:
        if not stacked:
            return tensor(names[0])[index]
        return np.stack([tensor(n)[index[1:]] for n in names[index[0]]])

    return read


def load_params(
    hf_dir: str, cfg: ModelConfig, sharding: jax.sharding.Sharding | dict, key: str = "init.from_hf"
) -> dict:
    """The Hugging Face checkpoint in `hf_dir` as our parameters, placed by `sharding` (one for
    all, or a tree like the parameters). Each device's block is read from the memory maps, so
    no host holds more than one layer's tensor whole."""
    check_compatible(cfg, hf_dir, key)
    files, shapes, params = SafetensorsDir(hf_dir, key), param_shapes(cfg), {}
    for path, name, n_in in _entries(cfg):
        shape = _get_path(shapes, path).shape
        stacked = path[0] == "layers"
        names = [name.format(i=i) for i in range(cfg.num_layers)] if stacked else [name]
        for n in names:  # every tensor present with the right shape, before anything is placed
            files.get(n, _hf_shape(shape[1:] if stacked else shape, n_in))
        placement = _get_path(sharding, path) if isinstance(sharding, dict) else sharding
        read = _reader(files, names, shape, n_in, stacked)
        _set_path(params, path, jax.make_array_from_callback(shape, placement, read))
    return params


def to_hf_tensors(params: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Our parameters (any arrays) -> Hugging Face tensor names and float32 [out, in] layouts."""
    out = {}
    for path, name, n_in in _entries(cfg):
        a = np.asarray(jax.device_get(_get_path(params, path)))
        if path[0] == "layers":
            out.update({name.format(i=i): _from_ours(a[i], n_in) for i in range(cfg.num_layers)})
        else:
            out[name] = _from_ours(a, n_in)
    return out


def hf_config(cfg: ModelConfig, source: dict[str, Any] | None = None, dtype: str = "float32") -> dict[str, Any]:
    """config.json for LlamaForCausalLM. Token ids and the context length come from `source`:
    the config.json of the checkpoint the run was imported from, or just the tokenizer's ids."""
    source = source or {}
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.resolved_head_dim,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,  # read by transformers 4.x
        "rope_parameters": rope,  # read by transformers 5
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "max_position_embeddings": max(cfg.seq_len, source.get("max_position_embeddings", 0)),
        "bos_token_id": source.get("bos_token_id"),
        "eos_token_id": source.get("eos_token_id"),
        "pad_token_id": source.get("pad_token_id"),
        "torch_dtype": dtype,  # transformers 4.x
        "dtype": dtype,  # transformers 5
    }


TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "generation_config.json",
)


def export(run_dir: str, out: str, step: int | None = None, dtype: str = "float32", overwrite: bool = False) -> int:
    """Writes the run's checkpoint (newest, or `step`) as a Hugging Face directory of `dtype`
    tensors; returns the step. Restores onto this host's first CPU device, whatever mesh the
    checkpoint was saved from. A non-empty `out` is refused unless `overwrite`."""
    from model.generate import load_run

    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"--dtype: {dtype!r} is not one of {', '.join(EXPORT_DTYPES)}")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise ConfigError(f"--out: {out} is not empty; give --overwrite to replace what export writes there")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"--out: {out} is a file, not a directory")

    try:
        device = jax.devices("cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS names no cpu backend
        device = jax.devices()[0]
    cfg, step, params = load_run(run_dir, step, device=device)
    imported = bool(cfg.init.from_hf) and os.path.exists(os.path.join(cfg.init.from_hf, "config.json"))
    if imported:
        source = read_hf_config(cfg.init.from_hf, "init.from_hf")
    else:  # the byte tokenizer ends documents with 256 (data/tokenizer.py)
        source = {"eos_token_id": 256} if cfg.data.tokenizer == "byte" else {}
    os.makedirs(out, exist_ok=True)
    write_safetensors(to_hf_tensors(params, cfg.model), os.path.join(out, "model.safetensors"), dtype)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf_config(cfg.model, source, dtype), f, indent=2)
    for name in TOKENIZER_FILES if imported else ():
        src = os.path.join(cfg.init.from_hf, name)
        if os.path.exists(src):
            with open(src, "rb") as fin, open(os.path.join(out, name), "wb") as fout:
                fout.write(fin.read())
    return step


def import_config(hf_dir: str, run_dir: str, preset: str | None, overrides: list[str]) -> Any:
    """The fine-tuning config: the preset, then the model keys (and tokenizer.json, if the
    directory has one) of the checkpoint, then the user's overrides."""
    hf_dir = os.path.abspath(hf_dir)
    keys = model_keys(read_hf_config(hf_dir, "--hf-dir"), "--hf-dir")
    derived = [f"model.{k}={v}" for k, v in keys.items()] + [f"init.from_hf={hf_dir}", f"run.dir={run_dir}"]
    if os.path.exists(os.path.join(hf_dir, "tokenizer.json")):
        derived.append(f"data.tokenizer={os.path.join(hf_dir, 'tokenizer.json')}")
    return load_config(preset, derived + list(overrides))


def import_(
    hf_dir: str, run_dir: str, preset: str | None, overrides: list[str], log: Callable[[str], None] = print
) -> None:
    """Writes run_dir/config.yaml and a step-0 checkpoint holding the Hugging Face weights (and a
    fresh optimizer state and data position), so `train.py --config RUN/config.yaml` fine-tunes.
    The state is built on one local device: for models larger than one device, train with
    `init.from_hf` instead, which loads straight into the sharded layout."""
    # The trainer builds the state and its data position; imported here because the model
    # package must not depend on the trainer (which depends on it).
    from trainer.checkpoint import has_checkpoints
    from trainer.loop import build
    from trainer.program import prepare

    cfg = import_config(hf_dir, run_dir, preset, overrides)
    if has_checkpoints(cfg.run.dir):
        raise ConfigError(f"--run-dir: {cfg.run.dir} already holds checkpoints; import into a new run directory")
    check_compatible(cfg.model, cfg.init.from_hf, "--hf-dir")  # user overrides of model.* must still fit
    one = dataclasses.replace(cfg, mesh=MeshConfig(pipeline=1, data=1, fsdp=1, tensor=1), pipeline=PipelineConfig())
    built = build(prepare(one, 1), jax.devices()[:1])
    built.ckpt.save(0, built.state, built.iterator)
    built.ckpt.wait()
    built.ckpt.close()
    with open(os.path.join(cfg.run.dir, "config.yaml"), "w") as f:  # the user's mesh, not the import's
        f.write(dump_config(cfg))
    log(f"imported {cfg.init.from_hf} into {cfg.run.dir} (step 0); fine-tune with: "
        f"python train.py --config {os.path.join(cfg.run.dir, 'config.yaml')}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model.hf", description="Hugging Face Llama checkpoints in/out.")
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="a Hugging Face Llama directory -> a run directory with a step-0 checkpoint")
    imp.add_argument("--hf-dir", required=True, help="config.json + model.safetensors (or a sharded index)")
    imp.add_argument("--run-dir", required=True, help="the new run directory")
    imp.add_argument("--config", help="preset for everything but the model keys (data, optim, mesh ...)")
    imp.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    exp = sub.add_parser("export", help="a run's checkpoint -> config.json + model.safetensors")
    exp.add_argument("--run-dir", required=True)
    exp.add_argument("--out", required=True, help="the directory to write")
    exp.add_argument("--step", type=int, help="the checkpoint step (default: the newest)")
    exp.add_argument("--dtype", default="float32", help="float32 (exact), bfloat16 or float16 (half the size)")
    exp.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    args = parser.parse_args(argv)
    try:
        if args.command == "import":
            import_(args.hf_dir, args.run_dir, args.config, args.overrides)
        else:
            step = export(args.run_dir, args.out, args.step, args.dtype, args.overwrite)
            print(f"exported step {step} of {args.run_dir} to {args.out} ({args.dtype})")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
