"""The Hugging Face weight mapping: config.json and tensors to ours and back (Llama, Mixtral,
Qwen3-MoE, DeepSeek-V3; which tensor is which per architecture: model/hf_arch.py).

The commands that use it (`python hf.py import|export`) live beside train.py. The two layouts
hold the same numbers: a Hugging Face projection `W` ([out, in], applied as `x @ W.T`) is our
`W.T` reshaped to named dims (q: [embed, heads, head_dim]; o: [heads, head_dim, embed]); the
per-layer tensors are stacked on a leading `layers` dim and the per-expert ones on `expert`
after it. Rotary embeddings use the same half-split convention (`rotate_half`), so q and k need
no permutation; the oracle tests in tests/test_hf.py check all of it against `transformers` logits.

Safetensors files are read and written through the `safetensors` library
(model/safetensors_files.py), memory-mapped, with numpy (no torch), bfloat16 files included;
`load_params` reads only what this process's devices hold.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import jax
import numpy as np

import storage
from configs.schema import ConfigError, ModelConfig
from model import lora
from model.hf_arch import architecture, entries, model_keys
from model.safetensors_files import SafetensorsDir
from model.transformer import param_shapes


def read_hf_config(hf_dir: str, key: str) -> dict[str, Any]:
    path = storage.join(hf_dir, "config.json")
    try:
        return json.loads(storage.read_text(path))
    except OSError:
        raise ConfigError(f"{key}: no Hugging Face config at {path}") from None
    except ValueError as e:
        raise ConfigError(f"{key}: {path} is not valid JSON ({e})") from None


def _ours(cfg: ModelConfig, name: str) -> Any:
    """The value of `model.<name>` (dotted) as the network sees it (0 = default resolved)."""
    if name == "head_dim":
        return cfg.resolved_head_dim
    if name == "moe.d_ff":
        return cfg.moe.d_ff or cfg.d_ff
    value = cfg
    for part in name.split("."):
        value = getattr(value, part)
    return value


def check_compatible(cfg: ModelConfig, hf_dir: str, key: str = "init.from_hf") -> None:
    """`cfg` must describe the network stored in `hf_dir`; ConfigError names the first key that does not."""
    keys = model_keys(read_hf_config(hf_dir, key), key)
    if keys["moe.num_experts"] and keys.get("moe.every", 1) == 1 and not keys.get("moe.first_k_dense_replace"):
        # no dense layer: d_ff is used nowhere
        del keys["d_ff"]
    for name, value in keys.items():
        ours = _ours(cfg, name)
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


def _names(path: tuple[str, ...], name: str, shape: tuple[int, ...], every: int, first: int = 0) -> np.ndarray:
    """The tensor names of one parameter, an array over its stacked dims: [layers] for "{i}",
    [layers, expert] for "{i}" and "{j}", a 0-d array for a single tensor. Under layer groups
    of `every` (model/hf_arch.py `entries`) the layer dims are [group, every - 1] for the dense
    layers (layer g x every + s) and [group] for the MoE ones (layer g x every + every - 1). After
    `first` dense layers (`dense_layers`, layers 0..first-1) the `layers` stack starts at layer `first`."""
    group = path[1] if path[:2] in (("layers", "dense"), ("layers", "moe")) else None
    stacked = shape[: ("{i}" in name) * (2 if group == "dense" else 1) + ("{j}" in name)]
    names = np.empty(stacked, dtype=object)
    for index in np.ndindex(stacked):
        fields, rest = {}, index
        if "{i}" in name:
            if group == "dense":
                fields["i"], rest = index[0] * every + index[1], index[2:]
            else:
                fields["i"], rest = index[0] * every + (every - 1 if group else 0), index[1:]
            fields["i"] += first if path[0] == "layers" else 0
        if "{j}" in name:
            fields["j"] = rest[0]
        names[index] = name.format(**fields)
    return names


def _first(cfg: ModelConfig) -> int:
    """The dense layers before the `layers` stack (model.moe.first_k_dense_replace)."""
    return cfg.moe.first_k_dense_replace if cfg.moe.enabled else 0


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


def _reader(files: SafetensorsDir, names: np.ndarray, shape: tuple[int, ...], n_in: int) -> Callable:
    """The callback that reads the block `index` of one parameter for one device. A tensor
    stored as is (n_in 0: embedding, norms) is read block by block; a projection, whose stored
    layout is transposed, one tensor at a time (a stacked parameter, [layers, (expert,) ...]
    with one tensor per layer (and expert), reads only the tensors in the block)."""
    one = shape[names.ndim:]

    def tensor(name: str, index: tuple) -> np.ndarray:
        lazy = files.get(name, _hf_shape(one, n_in))
        if not n_in:
            return np.asarray(lazy[index], dtype=np.float32)
        return _to_ours(lazy[:], one, n_in)[index]

    def read(index: tuple) -> np.ndarray:
        if not names.ndim:
            return tensor(names[()], index)
        block = names[index[: names.ndim]]
        parts = [tensor(n, index[names.ndim:]) for n in block.reshape(-1)]
        return np.stack(parts).reshape(block.shape + parts[0].shape)

    return read


def load_params(
    hf_dir: str, cfg: ModelConfig, sharding: jax.sharding.Sharding | dict, key: str = "init.from_hf"
) -> dict:
    """The Hugging Face checkpoint in `hf_dir` as our parameters, placed by `sharding` (one for
    all, or a tree like the parameters). Each device's block is read from the lazy slices, so
    no host holds more than one layer's (or expert's) tensor whole."""
    check_compatible(cfg, hf_dir, key)
    arch = read_hf_config(hf_dir, key)["model_type"]
    files, shapes, params = SafetensorsDir(hf_dir, key), param_shapes(cfg), {}
    for path, name, n_in in entries(arch, cfg):
        shape = _get_path(shapes, path).shape
        names = _names(path, name, shape, cfg.moe.every, _first(cfg))
        for n in names.reshape(-1):  # every tensor present with the right shape, before anything is placed
            files.get(n, _hf_shape(shape[names.ndim:], n_in))
        placement = _get_path(sharding, path) if isinstance(sharding, dict) else sharding
        _set_path(params, path, jax.make_array_from_callback(shape, placement, _reader(files, names, shape, n_in)))
    return params


def to_hf_tensors(params: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Our parameters (any arrays) -> Hugging Face tensor names and float32 [out, in] layouts,
    in the architecture `cfg` describes (ConfigError if none)."""
    out = {}
    for path, name, n_in in entries(architecture(cfg), cfg):
        a = np.asarray(jax.device_get(_get_path(params, path)))
        names = _names(path, name, a.shape, cfg.moe.every, _first(cfg))
        out.update({names[index]: _from_ours(a[index], n_in) for index in np.ndindex(names.shape)})
    return out


def to_peft_tensors(params: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The LoRA adapters of our parameters as a PEFT adapter's tensors: for each adapted
    projection `<name>.weight` of the architecture, `base_model.model.<name>.lora_A.weight`
    [rank, in] and `...lora_B.weight` [out, rank] (PEFT computes x A^T B^T alpha / rank, with the
    input dims flattened as the base weight's are)."""
    adapters = lora.split(params)[0]
    names = {path: name for path, name, _ in entries(architecture(cfg), cfg)}
    out = {}
    for path, target in lora.adapter_pairs(adapters):
        name = names[path + (target,)]
        held = _get_path(adapters, path)
        a, b = (np.asarray(jax.device_get(held[target + s]), np.float32) for s in lora.SUFFIXES)
        n_in = lora.INPUT_DIMS[target]
        stacked = _names(path + (target,), name, a.shape[:a.ndim - n_in - 1] + (0,), cfg.moe.every, _first(cfg))
        for index in np.ndindex(stacked.shape):
            stem = "base_model.model." + stacked[index].removesuffix(".weight")
            out[stem + ".lora_A.weight"] = np.ascontiguousarray(a[index].reshape(-1, cfg.lora.rank).T)
            out[stem + ".lora_B.weight"] = np.ascontiguousarray(b[index].reshape(cfg.lora.rank, -1).T)
    return out


def peft_config(cfg: ModelConfig, base: str) -> dict[str, Any]:
    """adapter_config.json of `to_peft_tensors`' adapter on the base model at `base`."""
    names = {path[-1]: name for path, name, _ in entries(architecture(cfg), cfg)}
    modules = sorted({names[t].removesuffix(".weight").rsplit(".", 1)[-1] for t in cfg.lora.targets})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": cfg.lora.rank,
            "lora_alpha": cfg.lora.alpha, "lora_dropout": cfg.lora.dropout, "target_modules": modules, "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "inference_mode": True}
