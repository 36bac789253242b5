"""train.objective=distill (trainer/objectives/distill.py) from a teacher of a different size: the
loss of one batch equals a float64 NumPy computation from the two models' logits; a short run
lowers the KL; 8 devices (data x fsdp x tensor) give the one-device losses; a resumed run (its
teacher restored from the checkpoint) is bitwise the straight one; a Hugging Face export of the
teacher loads the same weights; bad input is one line naming the key, exit 2."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf as hf_cli
import train
import trainer
from configs import ConfigError, load_config
from conftest import ROOT, stdlib_glob
from model.loss import model_inputs
from trainer.checkpoint import check_resumable
from trainer.compute import Compute
from trainer.forward import forward
from trainer.program import make_program
from trainer.spec import prepare
from trainer.state import abstract_model, init_state

TINY = os.path.join(ROOT, "configs", "tiny.yaml")
STEPS = 6
COMMON = ["train.log_every=1", "optim.warmup_steps=1", "model.seq_len=32", "train.global_batch=8",
          "model.num_layers=2", "checkpoint.every=100"]
# The teacher: half the student's width, its own head count, depth 3 (the student has 2).
TEACHER = ["model.num_layers=3", "model.d_model=32", "model.d_ff=64", "model.num_heads=8", "model.num_kv_heads=4",
           "model.head_dim=4"]
DISTILL = ["train.objective=distill", "distill.temperature=2.0", "distill.lm_weight=0.25", "optim.lr=1e-2",
           "data.eval_fraction=0.3"]  # a held-out split of the few standard-library files
LAYOUT = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
GPIPE = ["mesh.pipeline=2", "mesh.data=4", "pipeline.schedule=gpipe", "pipeline.microbatches=2"]
KEYS = ("loss", "kl", "lm_loss")


def student(run_dir, teacher: str, *extra: str):
    return load_config(TINY, [f"run.dir={run_dir}", f"data.path={stdlib_glob('json')}", f"distill.teacher={teacher}",
                              f"train.steps={STEPS}", *COMMON, *DISTILL, *extra])


def column(history: list[dict], key: str) -> np.ndarray:
    return np.array([r[key] for r in history if key in r])


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> str:
    """A meshlm run directory: the teacher trained a few steps on one device (sharper than its init)."""
    run_dir = str(tmp_path_factory.mktemp("teacher") / "run")
    cfg = load_config(TINY, [f"run.dir={run_dir}", f"data.path={stdlib_glob('json')}", "train.steps=12", *COMMON,
                             *TEACHER, "optim.lr=1e-2", "checkpoint.every=12", "mesh.data=1"])
    trainer.run(cfg, devices=jax.devices()[:1])
    return run_dir


@pytest.fixture(scope="module")
def runs(teacher, tmp_path_factory) -> dict[str, list[dict]]:
    """The distillation run on one device (with a held-out eval at its end) and on LAYOUT."""
    root = tmp_path_factory.mktemp("student")
    one = trainer.run(student(root / "one", teacher, "mesh.data=1", f"eval.every={STEPS}", "eval.batches=1"),
                      devices=jax.devices()[:1])
    return {"one": one, "eight": trainer.run(student(root / "eight", teacher, *LAYOUT))}


def new_state(cfg, devices: list):  # noqa: ANN001, ANN201 (a Config; a Program and a TrainState)
    program = make_program(prepare(cfg, len(devices)), devices)
    return program, program.with_frozen(init_state(cfg.model, program.tx, cfg.run.seed, program.init_sh))


def numpy_distill(student_logits: np.ndarray, teacher_logits: np.ndarray, targets: np.ndarray, weights: np.ndarray,
                  t: float, w: float) -> tuple[float, float, float]:
    """(loss sum, KL sum, cross-entropy sum) in float64."""
    def log_softmax(z: np.ndarray) -> np.ndarray:
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    p, q = log_softmax(teacher_logits / t), log_softmax(student_logits / t)
    kl = float(((np.exp(p) * (p - q)).sum(-1) * weights).sum())
    logq = log_softmax(student_logits)
    ce = float((-np.take_along_axis(logq, targets[..., None], -1)[..., 0] * weights).sum())
    return (1 - w) * t * t * kl + w * ce, kl, ce


def test_one_batch_loss_is_the_numpy_distillation_loss(teacher, tmp_path):
    cfg = student(tmp_path / "run", teacher, "mesh.data=1")
    program, state = new_state(cfg, jax.devices()[:1])
    objective, graphdef = program.spec.objective, program.spec.model.graphdef
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.model.vocab_size, (4, cfg.model.seq_len + 1), dtype=np.int32)
    # Two documents and padding per row: the weights drop padding and the targets across the boundary.
    segments = np.repeat(np.array([[1] * 20 + [2] * 10 + [0] * 3]), 4, axis=0).astype(np.int32)
    positions = np.concatenate([np.arange(20), np.arange(10), np.zeros(3)]).astype(np.int32)[None].repeat(4, 0)
    batch = {"tokens": jnp.asarray(tokens), "segment_ids": jnp.asarray(segments), "positions": jnp.asarray(positions)}
    loss_fn, batch_fn = objective.loss_fn(graphdef, Compute()), objective.batch_fn(graphdef, Compute())
    total, (count, sums) = jax.jit(lambda p, r, b: loss_fn(p, batch_fn(p, r, b)))(state.params, state.ref_params, batch)

    rows = model_inputs(batch)
    logits = lambda g, params: np.asarray(forward(g, Compute(), params, rows).model.logits(  # noqa: E731
        forward(g, Compute(), params, rows).x), np.float64)
    t_graph = abstract_model(objective.frozen.model).graphdef
    s_logits, t_logits = logits(graphdef, state.params), logits(t_graph, state.ref_params)
    assert s_logits.shape == t_logits.shape  # one vocabulary, two networks
    weights = np.asarray(rows["weights"], np.float64)
    assert 0 < weights.sum() < weights.size  # the weights matter
    want, kl, ce = numpy_distill(s_logits, t_logits, np.asarray(rows["targets"]), weights, 2.0, 0.25)
    assert kl > 1e-3  # the teacher is not the student
    assert float(count) == weights.sum()
    np.testing.assert_allclose([float(total), float(sums[0]), float(sums[1])], [want, kl, ce], rtol=1e-5)


def test_a_short_run_lowers_the_kl_and_reports_the_held_out_kl(runs):
    one = runs["one"]
    kl = column(one, "kl")
    assert len(kl) == STEPS and kl[-1] < 0.8 * kl[0], kl
    held_out = [r for r in one if "eval_kl" in r]
    assert len(held_out) == 1 and held_out[0]["eval_kl"] > 0 and held_out[0]["eval_lm_loss"] > 0, held_out


def test_8_devices_give_the_one_device_losses(runs, teacher, tmp_path):
    one_spec = prepare(student(tmp_path / "a", teacher, "mesh.data=1"), 1, with_data=False)
    eight_spec = prepare(student(tmp_path / "b", teacher, *LAYOUT), 8, with_data=False)
    assert one_spec.layout.sizes != eight_spec.layout.sizes
    eight = make_program(eight_spec, jax.devices())
    specs = {sh.spec for sh in jax.tree.leaves(eight.state_sh.ref_params)}
    assert any(any(axis is not None for axis in spec) for spec in specs)  # the teacher is sharded too
    assert jax.tree.map(lambda s: s.shape, eight_spec.frozen.shapes) != jax.tree.map(
        lambda s: s.shape, eight_spec.model.shapes)  # of its own size
    assert np.ptp(column(runs["one"], "loss")) > 0.01  # the runs train
    for key in KEYS:
        np.testing.assert_allclose(column(runs["eight"], key), column(runs["one"], key), rtol=2e-5, atol=1e-6,
                                   err_msg=key)


def test_a_gpipe_layout_gives_the_one_device_losses(runs, teacher, tmp_path):
    """The student pipelined over 2 stages (GPipe) while its 3-layer teacher, whole on every stage,
    runs outside the pipeline: one device's losses."""
    piped = student(tmp_path / "piped", teacher, *GPIPE)
    spec = prepare(piped, 8, with_data=False)
    assert spec.layout.pipelined and spec.frozen.shapes["layers"]["attn"]["q"].shape[0] % 2  # depth odd: unsplit
    history = trainer.run(piped)
    for key in KEYS:
        np.testing.assert_allclose(column(history, key), column(runs["one"], key), rtol=2e-5, atol=1e-6, err_msg=key)


def test_resume_restores_the_teacher_and_is_bitwise_exact(runs, teacher, tmp_path, capsys):
    common = [f"optim.decay_steps={STEPS}", "checkpoint.every=3", *LAYOUT]
    first = trainer.run(student(tmp_path / "run", teacher, *common, "train.steps=3"))
    second = trainer.run(student(tmp_path / "run", teacher, *common))
    assert "resumed from step 3" in capsys.readouterr().out
    for key in KEYS:
        np.testing.assert_array_equal(column(first + second, key), column(runs["eight"], key), err_msg=key)
    with pytest.raises(ConfigError, match=r"^distill.teacher=.* differs from"):  # the checkpoints hold their teacher
        check_resumable(student(tmp_path / "run", teacher + "-other", *common))


def test_a_hugging_face_teacher_loads_the_run_teachers_weights(teacher, tmp_path):
    hf_dir = str(tmp_path / "hf")
    hf_cli.export(teacher, hf_dir)
    from_run = new_state(student(tmp_path / "a", teacher, "mesh.data=1"), jax.devices()[:1])[1].ref_params
    from_hf = new_state(student(tmp_path / "b", hf_dir, "mesh.data=1"), jax.devices()[:1])[1].ref_params
    assert jax.tree.structure(from_run) == jax.tree.structure(from_hf)
    for a, b in zip(jax.tree.leaves(from_run), jax.tree.leaves(from_hf)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def bad_cases(teacher: str, tmp: str) -> dict[str, tuple[list[str], str]]:
    return {
        "no teacher": (["distill.teacher="], "distill.teacher: train.objective=distill needs a teacher"),
        "missing dir": ([f"distill.teacher={tmp}/nope"], f"distill.teacher: {tmp}/nope is not a directory"),
        "neither kind": ([f"distill.teacher={tmp}"], "distill.teacher: " + tmp + " holds neither"),
        "vocab": ([f"distill.teacher={teacher}", "model.vocab_size=272"],
                  "distill.teacher: the teacher at " + teacher + " has vocab_size 264, the student (model.vocab_size) 272"),
        "temperature": ([f"distill.teacher={teacher}", "distill.temperature=0"], "distill.temperature: must be > 0"),
        "lm_weight": ([f"distill.teacher={teacher}", "distill.lm_weight=1.5"], "distill.lm_weight: must be"),
        "loss chunk": ([f"distill.teacher={teacher}", "model.loss_chunk=8"], "model.loss_chunk: train.objective=distill"),
        "1f1b": ([f"distill.teacher={teacher}", "mesh.pipeline=2", "mesh.data=4", "pipeline.schedule=1f1b",
                  "pipeline.microbatches=2"], "pipeline.schedule=1f1b computes the language-model loss itself; "
                 "train.objective=distill pipelines with pipeline.schedule=gpipe"),
        "teacher shards": ([f"distill.teacher={teacher}", "mesh.data=1", "mesh.tensor=8"],
                           "distill.teacher: its model.num_kv_heads=4 is not divisible by 8"),
    }


def test_bad_input_exits_2_naming_the_key(teacher, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    for case, (overrides, message) in bad_cases(teacher, str(empty)).items():
        run_dir = tmp_path / "run"
        code = train.main(["--config", TINY, f"run.dir={run_dir}", f"data.path={stdlib_glob('json')}",
                           "train.objective=distill", *COMMON, *overrides])
        err = capsys.readouterr().err
        assert code == 2, case
        assert message in err, (case, err)
        assert err.count("\n") == 1 and err.startswith("error: "), (case, err)
        assert not run_dir.exists(), case
