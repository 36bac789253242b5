"""Hugging Face checkpoints (Llama, Mixtral, Qwen3-MoE, DeepSeek-V3) in and out of a run directory.

    python hf.py import --hf-dir DIR --run-dir RUN [--config PRESET] [key=value ...]
    python hf.py export --run-dir RUN --out DIR [--step N] [--dtype bfloat16] [--overwrite] [--format peft]

`import` writes RUN/config.yaml (the checkpoint's model keys, then the user's overrides) and a
step-0 checkpoint holding the Hugging Face weights, a fresh optimizer state and data position, so
`python train.py --config RUN/config.yaml` fine-tunes. `export` writes a run's checkpoint as
config.json + model.safetensors (and the tokenizer files of an imported checkpoint), as the
architecture that holds the run's network (model/hf_arch.py); a LoRA run's adapters are merged
into their weights, or with `--format peft` written alone as a PEFT adapter
(adapter_model.safetensors + adapter_config.json, on the base `init.from_hf` names). The weight mapping itself is
model/hf.py; this entry point sits above the trainer, like train.py.
"""

from __future__ import annotations

from configs import handle_interrupts

# What a signal before the command finishes leaves.
KEPT = ("each file is written under a temporary name and renamed whole, so what is there is "
        "whole; run the same command again")

if __name__ == "__main__":  # before the imports below (pydantic, JAX): a signal while they load gets the line too
    handle_interrupts(KEPT)

import argparse
import dataclasses
import json
import sys
from typing import Any, Callable

import storage
from configs import ConfigError, MeshConfig, PipelineConfig, check_output, dump_config, guarded, load_config

# JAX, the model and the trainer are imported inside the functions that use them, after the
# arguments are parsed and the signal handler is in: importing them takes seconds, and `--help`
# or a Ctrl-C meanwhile should not wait for that.

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "generation_config.json",
)


EXPORT_FORMATS = ("merged", "peft")


def check_out(out: str, overwrite: bool) -> None:
    """export's --out, before anything is read: a non-empty directory is refused unless
    `overwrite`, a file always; a local one must be writable, a bucket must exist and answer."""
    if storage.isdir(out) and storage.listdir(out) and not overwrite:
        raise ConfigError(f"--out: {out} is not empty; give --overwrite to replace what export writes there")
    if storage.exists(out) and not storage.isdir(out):
        raise ConfigError(f"--out: {out} is a file, not a directory")
    check_output(out, "--out")


def export(run_dir: str, out: str, step: int | None = None, dtype: str = "float32", overwrite: bool = False,
           form: str = "merged") -> int:
    """Writes the run's checkpoint (newest, or `step`) as a Hugging Face directory of `dtype`
    tensors (`form` merged: the whole model, LoRA adapters folded in; peft: a LoRA run's
    adapters alone, in PEFT's format); returns the step. Restores onto this host's first CPU
    device, whatever mesh the checkpoint was saved from. A non-empty `out` is refused unless
    `overwrite`."""
    import jax

    from model import lora
    from model.hf import peft_config, read_hf_config, to_hf_tensors, to_peft_tensors
    from model.hf_arch import hf_config
    from model.safetensors_files import EXPORT_DTYPES, write_safetensors
    from trainer.checkpoint import restore_params

    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"--dtype: {dtype!r} is not one of {', '.join(EXPORT_DTYPES)}")
    if form not in EXPORT_FORMATS:
        raise ConfigError(f"--format: {form!r} is not one of {', '.join(EXPORT_FORMATS)}")
    check_out(out, overwrite)

    try:
        device = jax.devices("cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS names no cpu backend
        device = jax.devices()[0]
    cfg, step, params = restore_params(run_dir, step, device=device)
    if form == "peft":
        if not cfg.model.lora.enabled:
            raise ConfigError(f"--format peft: the run in {run_dir} has no LoRA adapters (model.lora.rank=0)")
        config = peft_config(cfg.model, cfg.init.from_hf)  # ConfigError, before anything is written, if none fits
        storage.makedirs(out)
        write_safetensors(to_peft_tensors(params, cfg.model), storage.join(out, "adapter_model.safetensors"), dtype)
        storage.write_text(storage.join(out, "adapter_config.json"), json.dumps(config, indent=2))
        return step
    params = lora.merged(params, cfg.model) if cfg.model.lora.enabled else params
    imported = bool(cfg.init.from_hf) and storage.exists(storage.join(cfg.init.from_hf, "config.json"))
    if imported:
        source = read_hf_config(cfg.init.from_hf, "init.from_hf")
    else:  # the byte tokenizer ends documents with 256 (data/tokenizer.py)
        source = {"eos_token_id": 256} if cfg.data.tokenizer == "byte" else {}
    config = hf_config(cfg.model, source, dtype)  # ConfigError, before anything is written, if none fits
    storage.makedirs(out)
    write_safetensors(to_hf_tensors(params, cfg.model), storage.join(out, "model.safetensors"), dtype)
    storage.write_text(storage.join(out, "config.json"), json.dumps(config, indent=2))
    for name in TOKENIZER_FILES if imported else ():
        src = storage.join(cfg.init.from_hf, name)
        if storage.exists(src):
            storage.copy_file(src, storage.join(out, name))
    return step


def import_config(hf_dir: str, run_dir: str, preset: str | None, overrides: list[str]) -> Any:
    """The fine-tuning config: the preset, then the model keys (and tokenizer.json, if the
    directory has one) of the checkpoint, then the user's overrides."""
    from model.hf import read_hf_config
    from model.hf_arch import model_keys

    hf_dir = storage.absolute(hf_dir)
    keys = model_keys(read_hf_config(hf_dir, "--hf-dir"), "--hf-dir")
    derived = [f"model.{k}={v}" for k, v in keys.items()] + [f"init.from_hf={hf_dir}", f"run.dir={run_dir}"]
    if storage.exists(storage.join(hf_dir, "tokenizer.json")):
        derived.append(f"data.tokenizer={storage.join(hf_dir, 'tokenizer.json')}")
    return load_config(preset, derived + list(overrides))


def import_(
    hf_dir: str, run_dir: str, preset: str | None, overrides: list[str], log: Callable[[str], None] = print
) -> None:
    """Writes run_dir/config.yaml and a step-0 checkpoint holding the Hugging Face weights (and a
    fresh optimizer state and data position), so `train.py --config RUN/config.yaml` fine-tunes.
    The state is built on one local device: for models larger than one device, train with
    `init.from_hf` instead, which loads straight into the sharded layout."""
    import jax

    from model.hf import check_compatible
    from trainer.checkpoint import read_run_dir
    from trainer.session import make_session
    from trainer.spec import prepare

    if storage.is_remote(run_dir):  # before the first read: a missing bucket is one line, not a traceback
        check_output(run_dir, "--run-dir")
    cfg = import_config(hf_dir, run_dir, preset, overrides)
    found = read_run_dir(cfg.run.dir)  # once: prepare and the session read this, not the disk
    if found.checkpoints:
        raise ConfigError(f"--run-dir: {cfg.run.dir} already holds checkpoints; import into a new run directory")
    check_compatible(cfg.model, cfg.init.from_hf, "--hf-dir")  # user overrides of model.* must still fit
    one = dataclasses.replace(cfg, mesh=MeshConfig(pipeline=1, data=1, fsdp=1, tensor=1), pipeline=PipelineConfig())
    session = make_session(prepare(one, 1, found=found), jax.devices()[:1])
    session.ckpt.save(0, session.state, session.iterator)
    session.ckpt.wait()
    session.ckpt.close()
    storage.write_text(storage.join(cfg.run.dir, "config.yaml"), dump_config(cfg))  # the user's mesh, not the import's
    log(f"imported {cfg.init.from_hf} into {cfg.run.dir} (step 0); fine-tune with: "
        f"python train.py --config {storage.join(cfg.run.dir, 'config.yaml')}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python hf.py", description="Hugging Face checkpoints (Llama, Mixtral, Qwen3-MoE, DeepSeek-V3) in/out.")
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="a Hugging Face Llama, Mixtral, Qwen3-MoE or DeepSeek-V3 directory -> a run directory with a step-0 checkpoint")
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
    exp.add_argument("--format", default="merged", choices=EXPORT_FORMATS,
                     help="merged: the whole model (LoRA adapters folded in); "
                     "peft: a LoRA run's adapters as a PEFT adapter")
    args = parser.parse_args(argv)
    from ops.xla_env import set_default_flags

    set_default_flags()
    try:
        if args.command == "import":
            import_(args.hf_dir, args.run_dir, args.config, args.overrides)
        else:
            step = export(args.run_dir, args.out, args.step, args.dtype, args.overwrite, args.format)
            print(f"exported step {step} of {args.run_dir} to {args.out} ({args.format}, {args.dtype})")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main, KEPT))
