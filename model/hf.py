"""The Hugging Face Llama weight mapping: its config and tensors to ours and back.

The commands that use it (`python hf.py import|export`) live beside train.py. The two layouts hold the same numbers: a Hugging Face projection `W` ([out, in], applied as
`x @ W.T`) is our `W.T` reshaped to named dims (q: [embed, heads, head_dim]; o: [heads,
head_dim, embed]), and the per-layer tensors are stacked on a leading `layers` dim. Rotary
embeddings use the same half-split convention (`rotate_half`), so q and k need no permutation;
the oracle tests in tests/test_hf.py check all of it against `transformers` logits.

Safetensors files are read and written through the `safetensors` library
(model/safetensors_files.py), memory-mapped, with numpy (no torch), bfloat16 files included;
`load_params` reads only what this process's devices hold.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import jax
import numpy as np

from configs.schema import ConfigError, ModelConfig
from model.safetensors_files import SafetensorsDir
from model.transformer import param_shapes

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
    if cfg.moe.enabled:
        raise ConfigError(f"model.moe.num_experts={cfg.moe.num_experts}: {key} reads dense Llama checkpoints only "
                          "(Hugging Face MoE models are not supported yet)")
    for name, value in model_keys(read_hf_config(hf_dir, key), key).items():
        ours = cfg.resolved_head_dim if name == "head_dim" else getattr(cfg, name)
        if ours != value:
            raise ConfigError(
                f"model.{name}={ours!r} but the Hugging Face checkpoint {key}={hf_dir} has {value!r}; "
                f"set model.{name}={value} (python hf.py import writes a matching config)"
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


def _reader(files: SafetensorsDir, names: list[str], shape: tuple[int, ...], n_in: int, stacked: bool) -> Callable:
    """The callback that reads the block `index` of one parameter for one device. A tensor
    stored as is (n_in 0: embedding, norms) is read block by block; a projection, whose stored
    layout is transposed, one layer's tensor at a time (a stacked parameter, [layers, ...] with
    one tensor name per layer, reads only the layers in the block)."""
    one = shape[1:] if stacked else shape

    def tensor(name: str, index: tuple) -> np.ndarray:
        lazy = files.get(name, _hf_shape(one, n_in))
        if not n_in:
            return np.asarray(lazy[index], dtype=np.float32)
        return _to_ours(lazy[:], one, n_in)[index]

    def read(index: tuple) -> np.ndarray:
        if not stacked:
            return tensor(names[0], index)
        return np.stack([tensor(n, index[1:]) for n in names[index[0]]])

    return read


def load_params(
    hf_dir: str, cfg: ModelConfig, sharding: jax.sharding.Sharding | dict, key: str = "init.from_hf"
) -> dict:
    """The Hugging Face checkpoint in `hf_dir` as our parameters, placed by `sharding` (one for
    all, or a tree like the parameters). Each device's block is read from the lazy slices, so
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
