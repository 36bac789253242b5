"""The commands beside train.py with their paths on a bucket (docs/storage.md), on the real S3 test
server (tests/storage_servers.py): `hf.py import` of a Hugging Face directory on the bucket into a
run directory on the bucket (a step-0 checkpoint), `generate.py` from that run, `hf.py export` of
it to another prefix, the weights unchanged at each hop; `plan.py --out` on the bucket; a
tokenizer file on the bucket."""

from __future__ import annotations

import json
import os
import pathlib
import uuid

import jax
import numpy as np
import pytest

import eval as eval_cli
import generate as generate_cli
import hf as hf_cli
import plan as plan_cli
import storage
from configs import Config, ConfigError, ModelConfig, load_config
from conftest import ROOT, stdlib_glob
from data.chat import ChatTemplate, template_file
from data.tokenizer import load_tokenizer
from model import hf, hf_arch
from model.decode import generate
from model.transformer import transformer_from_params
from model.safetensors_files import SafetensorsDir, write_safetensors
from sharding.hardware import HARDWARE
from trainer.checkpoint import restore_params
from trainer.state import abstract_model


def random_params(cfg_model: ModelConfig) -> dict:
    """Every parameter of the model, random: a checkpoint no initializer would give by chance."""
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda x: rng.standard_normal(x.shape, dtype=np.float32), abstract_model(cfg_model).shapes)


def hf_tensors(directory: str, names: list[str]) -> dict[str, np.ndarray]:
    """The named tensors of a Hugging Face directory, read whole."""
    files = SafetensorsDir(directory, "test")
    return {n: np.asarray(files.slices[n][1][...]) for n in names}


def bpe_dir(folder: pathlib.Path) -> pathlib.Path:
    """A small BPE tokenizer.json in `folder`, its end-of-document token "<stop>" named only by the
    tokenizer_config.json beside it (none of the names a tokenizer is searched for)."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]", "<stop>"], show_progress=False)
    tok.train_from_iterator(["the lazy dog sings", "a quick brown fox"] * 20, trainer)
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<stop>"}))
    return folder


def hf_on_bucket(root: str, tmp_path: pathlib.Path) -> tuple[Config, dict, dict, pathlib.Path]:
    """A random tiny model written under root/hf as a Hugging Face folder (safetensors, config.json
    and a BPE tokenizer): its config, parameters, HF tensors and the tokenizer's local folder."""
    cfg = load_config("tiny", ["model.vocab_size=64"])  # the tokenizer's 52 ids, padded
    params = random_params(cfg.model)
    tensors = hf.to_hf_tensors(params, cfg.model)
    source = storage.join(root, "hf")
    write_safetensors(tensors, storage.join(source, "model.safetensors"))
    storage.write_text(storage.join(source, "config.json"), json.dumps(hf_arch.hf_config(cfg.model, {"eos_token_id": 256})))
    tok_files = bpe_dir(tmp_path / "tok")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        storage.copy_file(str(tok_files / name), storage.join(source, name))
    return cfg, params, tensors, tok_files


def imported_from(source: str, run: str, params: dict, capsys: pytest.CaptureFixture) -> Config:
    """`hf.py import` of source into the run directory run: its config, the parameters checked."""
    assert hf_cli.main(["import", "--hf-dir", source, "--run-dir", run, "--config", "tiny",
                        f"data.path={stdlib_glob('json')}"]) == 0
    assert "imported " + source in capsys.readouterr().out
    assert storage.exists(storage.join(run, "config.yaml"))
    got_cfg, step, imported = restore_params(run, device=jax.devices()[0])
    assert step == 0 and got_cfg.init.from_hf == source and got_cfg.run.dir == run
    assert got_cfg.data.tokenizer == storage.join(source, "tokenizer.json")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), imported, params)
    return got_cfg


def exported_to(run: str, out: str, source: str, tensors: dict, tok_files: pathlib.Path,
                capsys: pytest.CaptureFixture) -> None:
    """`hf.py export` of run to out: the files, the import's tokenizer and config, the tensors."""
    assert hf_cli.main(["export", "--run-dir", run, "--out", out]) == 0
    assert f"exported step 0 of {run} to {out}" in capsys.readouterr().out
    assert storage.listdir(out) == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    for name in ("tokenizer.json", "tokenizer_config.json"):  # copied from the import's source, bucket to bucket
        assert storage.read_bytes(storage.join(out, name)) == (tok_files / name).read_bytes()
    assert json.loads(storage.read_text(storage.join(out, "config.json"))) == json.loads(
        storage.read_text(storage.join(source, "config.json")))
    exported = hf_tensors(out, sorted(tensors))
    for name, want in tensors.items():
        np.testing.assert_array_equal(exported[name], want, err_msg=name)


def test_import_from_and_export_to_a_bucket_round_trip(s3_bucket: str, tmp_path: pathlib.Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    root = f"{s3_bucket}/{uuid.uuid4().hex[:8]}"
    source, run, out = storage.join(root, "hf"), storage.join(root, "run"), storage.join(root, "exported")
    cfg, params, tensors, tok_files = hf_on_bucket(root, tmp_path)
    got_cfg = imported_from(source, run, params, capsys)

    # generate.py from the bucket run, through its tokenizer on the bucket: the greedy text of the
    # weights written there.
    tok = load_tokenizer(got_cfg.data.tokenizer)
    prompt = np.asarray(tok.encode("the dog"), np.int32)[None]
    tokens = np.asarray(generate(transformer_from_params(cfg.model, params), prompt, 6))[0]
    assert generate_cli.main(["--run-dir", run, "--prompt", "the dog", "--max-new-tokens", "6"]) == 0
    want = [int(t) for t in tokens]
    want = want[: want.index(tok.eod_id)] if tok.eod_id in want else want  # the end of a document ends the sample
    assert capsys.readouterr().out == "the dog" + tok.decode(want) + "\n"
    # eval.py from the bucket run, its scores written to the bucket: those of the same weights
    # imported from the bucket into a local run directory.
    local = str(tmp_path / "run")
    assert hf_cli.main(["import", "--hf-dir", source, "--run-dir", local, "--config", "tiny",
                        f"data.path={stdlib_glob('json')}"]) == 0
    scores = storage.join(root, "scores.json")
    for run_dir, output in ((run, scores), (local, str(tmp_path / "scores.json"))):
        assert eval_cli.main(["--run-dir", run_dir, "--tasks", "stdlib_words", "--limit", "8", "--output", output]) == 0
    written = json.loads(storage.read_text(scores))
    assert written["step"] == 0 and written["requests"] > 8
    assert written["scores"] == json.loads((tmp_path / "scores.json").read_text())["scores"]
    capsys.readouterr()

    exported_to(run, out, source, tensors, tok_files, capsys)

    # A non-empty --out on a bucket is left alone, as on disk; a missing bucket is one line.
    assert hf_cli.main(["export", "--run-dir", run, "--out", out]) == 2
    assert "is not empty; give --overwrite" in capsys.readouterr().err
    assert hf_cli.main(["export", "--run-dir", run, "--out", "s3://no-such-bucket/x"]) == 2
    assert "--out=s3://no-such-bucket/x: bucket no-such-bucket does not exist" in capsys.readouterr().err


def test_import_from_and_export_to_gcs_round_trip(gcs_bucket: str, tmp_path: pathlib.Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    """The same on the GCS server: a Hugging Face folder on gs:// imported into a run directory there
    and exported to it again, weights, config and tokenizer whole; a missing bucket is one line."""
    root = f"{gcs_bucket}/{uuid.uuid4().hex[:8]}"
    source, run, out = storage.join(root, "hf"), storage.join(root, "run"), storage.join(root, "exported")
    _, params, tensors, tok_files = hf_on_bucket(root, tmp_path)
    imported_from(source, run, params, capsys)
    exported_to(run, out, source, tensors, tok_files, capsys)
    assert hf_cli.main(["export", "--run-dir", run, "--out", "gs://no-such-bucket/x"]) == 2
    assert "--out=gs://no-such-bucket/x: bucket no-such-bucket does not exist" in capsys.readouterr().err


def test_plan_writes_its_json_to_a_bucket(s3_bucket: str, capsys: pytest.CaptureFixture) -> None:
    """A plan decided without compiling (pure data parallel of llama3-8b cannot fit) is written to
    a prefix on the bucket; a missing bucket is refused before anything else, exit 2."""
    out = f"{s3_bucket}/{uuid.uuid4().hex[:8]}/plans/dp.json"
    args = ["--config", os.path.join(ROOT, "configs", "llama3-8b.yaml"), "--devices", "64", "--search",
            "mesh.pipeline=1", "mesh.data=64", "mesh.fsdp=1", "mesh.tensor=1", "model.remat=full"]
    assert plan_cli.main([*args, "--out", out]) == 1
    assert f"wrote {out}" in capsys.readouterr().out
    assert json.loads(storage.read_text(out))["best"] is None
    assert plan_cli.main([*args, "--out", "s3://no-such-bucket/plan.json"]) == 2
    assert capsys.readouterr().err == (f"error: --out=s3://no-such-bucket/plan.json: bucket no-such-bucket does not exist "
                                       f"at {storage.s3_endpoint()}\n")


def test_a_tokenizer_on_a_bucket_is_the_local_one(s3_bucket: str, tmp_path: pathlib.Path) -> None:
    """data.tokenizer on a bucket: the tokenizer.json's ids, end-of-document id (named by the
    tokenizer_config.json beside it, not by a known name) and fingerprint are the local file's."""
    local = bpe_dir(tmp_path / "tok")
    root = f"{s3_bucket}/{uuid.uuid4().hex[:8]}"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        storage.copy_file(str(local / name), storage.join(root, name))

    url = storage.join(root, "tokenizer.json")
    here, there = load_tokenizer(str(local / "tokenizer.json")), load_tokenizer(url)
    assert there.eod_id == here.eod_id == 1  # "<stop>", after "[UNK]"
    assert there.fingerprint() == here.fingerprint() and there.describe()["path"] == url
    assert list(there.encode("the quick dog")) == list(here.encode("the quick dog"))
    with pytest.raises(ConfigError, match="data.tokenizer: no file"):
        load_tokenizer(storage.join(root, "missing.json"))
    # data.prepare's chat template, by default the one beside the tokenizer: read from the bucket.
    storage.write_text(storage.join(root, "tokenizer_config.json"), json.dumps(
        {"eos_token": "<stop>", "chat_template": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}"
                                                 "{% endfor %}"}))
    template = ChatTemplate(template_file(url, None))
    assert template.path == storage.join(root, "tokenizer_config.json")
    assert template.render([{"role": "user", "content": "hi"}]) == "<user>hi<stop>"



def test_a_sweep_on_a_bucket_runs_logs_summarizes_and_resumes(s3_bucket: str, tmp_path: pathlib.Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture) -> None:
    """A sweep's dir on the bucket: its point's run.dir there, its train.log uploaded, summary.csv,
    summary.md and the loss curves written there; a rerun skips the finished point; --emit slurm
    refused; a missing bucket refused before any point runs. (tests/test_sweep.py covers a
    failed point, the same code.)"""
    import csv
    import io

    import train as train_cli
    from bench.procs import cpu_env

    # tests/test_sweep.py's first point: a train.py process on one device.
    monkeypatch.setenv("XLA_FLAGS", cpu_env(1)["XLA_FLAGS"])
    root = f"{s3_bucket}/{uuid.uuid4().hex[:8]}/sweep"
    path = tmp_path / "sweep.yaml"
    path.write_text(f"base: {os.path.join(ROOT, 'configs', 'tiny.yaml')}\ndir: {root}\n"
                    "overrides: {train.steps: 3, train.log_every: 1}\nzip: {optim.lr: [0.001], mesh.data: [1]}\n")
    args = ["--sweep", str(path), f"data.path={stdlib_glob('json')}"]
    name = "optim.lr=0.001,mesh.data=1"
    assert train_cli.main(args) == 0
    assert f"[sweep 1/1] {name}: {root}/{name}" in capsys.readouterr().out
    assert "step 3" in storage.read_text(f"{root}/{name}/train.log")
    rows = list(csv.DictReader(io.StringIO(storage.read_text(f"{root}/summary.csv"))))
    assert [(r["point"], r["status"], r["step"]) for r in rows] == [(name, "done", "3")]
    assert f"| `{name}` | done | 3 |" in storage.read_text(f"{root}/summary.md")
    assert storage.size(f"{root}/loss_curves.png") > 10_000
    metrics = storage.read_text(f"{root}/{name}/metrics.jsonl")
    assert train_cli.main(args) == 0
    assert f"[sweep 1/1] {name}: finished earlier (step 3), skipped" in capsys.readouterr().out
    assert storage.read_text(f"{root}/{name}/metrics.jsonl") == metrics
    assert train_cli.main([*args, "--emit", "slurm"]) == 2
    assert "--emit slurm writes a batch script" in capsys.readouterr().err
    path.write_text(path.read_text().replace(s3_bucket, "s3://no-such-bucket"))
    assert train_cli.main(args) == 2
    assert capsys.readouterr().err.startswith(f"error: {path}: dir=s3://no-such-bucket/")


def test_plan_dumps_its_hlo_to_a_bucket(s3_bucket: str, capsys: pytest.CaptureFixture) -> None:
    """--dump-hlo on the bucket: the compiled program's HLO as one object (the compile measured
    in this process, on its fake devices, as plan.py's child measures it); a missing bucket
    refused before anything compiles, exit 2."""
    dump = f"{s3_bucket}/{uuid.uuid4().hex[:8]}/hlo"
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), ["mesh.data=8"])
    plan_cli.measure(cfg, HARDWARE["h100"], None, 8, "", dump)
    (name,) = storage.listdir(dump)
    assert name == "h100_8_data8_none.hlo" and storage.read_text(f"{dump}/{name}").startswith("HloModule ")
    assert plan_cli.main(["--config", "tiny", "--devices", "8", "--dump-hlo", "s3://no-such-bucket/hlo"]) == 2
    assert capsys.readouterr().err == (f"error: --dump-hlo=s3://no-such-bucket/hlo: bucket no-such-bucket does not "
                                       f"exist at {storage.s3_endpoint()}\n")
