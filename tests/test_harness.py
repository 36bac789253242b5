"""The lm-evaluation-harness model (evaluation/harness.py) against independent references: token
log-probabilities in float64 NumPy from the model's own full forward, the training loss function,
and generate.py's greedy decoding."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import ROOT, require

require("lm_eval", "eval")

from lm_eval.api.instance import Instance  # noqa: E402

from configs import load_config  # noqa: E402
from data.tokenizer import ByteTokenizer  # noqa: E402
from model.transformer import transformer_from_params  # noqa: E402
from evaluation.harness import MeshLM, buckets_for  # noqa: E402
from trainer.scoring import evaluator_of  # noqa: E402
from trainer.program import abstract_program  # noqa: E402
from trainer.state import init_state  # noqa: E402
from trainer.objectives.lm import make_loss_fn  # noqa: E402

# A large init scale spreads the logits: the greedy comparisons are far from ties.
MODEL = ["model.init_std=0.3", "model.num_layers=2"]
PAIRS = [("The quick brown", " fox"), ("def f(x):\n    return", " x + 1"), ("", "import os"),
         ("a" * 40, " tail past the model's length")]


def _lm(tmp_path: os.PathLike, devices: int, *overrides: str) -> tuple[MeshLM, dict]:
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [f"run.dir={tmp_path}", *MODEL, *overrides])
    program = abstract_program(cfg, jax.devices()[:devices])
    state = init_state(cfg.model, program.tx, 0, program.state_sh)
    return MeshLM(evaluator_of(program, state.params), ByteTokenizer(), cfg.model), jax.device_get(state.params)


def _requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def _reference(params: dict, model_cfg: object, ctx: list[int], cont: list[int], seq_len: int) -> tuple[float, bool]:
    """The continuation's log-probability from the full forward's logits, in float64 NumPy."""
    whole = ctx + cont
    inputs, targets = whole[:-1][-seq_len:], whole[1:][-seq_len:]
    logits = np.asarray(transformer_from_params(model_cfg, params)(jnp.asarray([inputs])), np.float64)[0]
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    n = min(len(cont), len(targets))
    picked = logp[np.arange(len(targets)), targets][-n:]
    return float(picked.sum()), bool((logits.argmax(-1)[-n:] == np.asarray(targets[-n:])).all())


@pytest.mark.parametrize("devices,layout", [(1, []), (8, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]),
                                            (8, ["mesh.data=2", "mesh.pipeline=2", "mesh.context=2"])],
                         ids=["1-device", "8-devices", "pipeline-and-context"])
def test_loglikelihood_is_the_sum_of_token_log_probs(tmp_path, devices, layout):
    lm, params = _lm(tmp_path, devices, *layout)
    got = lm.loglikelihood(_requests("loglikelihood", PAIRS), disable_tqdm=True)
    tok = ByteTokenizer()
    for (ctx, cont), (logp, greedy) in zip(PAIRS, got):
        c = [int(t) for t in tok.encode(ctx)] or [tok.eod_id]
        want, want_greedy = _reference(params, lm.cfg_model, c, [int(t) for t in tok.encode(cont)], 32)
        assert abs(logp - want) <= 1e-5 * max(1.0, abs(want)), (ctx, cont, logp, want)
        assert greedy == want_greedy
    # The rows differ: the comparison is not between equal numbers.
    assert len({round(v, 3) for v, _ in got}) == len(PAIRS)
    # Requests of many lengths compile one scoring program per padded length, not one per length.
    many = [("ab" * n, "c" * (1 + n % 3)) for n in range(1, 30)]
    lm.loglikelihood(_requests("loglikelihood", many), disable_tqdm=True)
    assert lm._score._cache_size() == len(lm.ev.buckets), (lm._score._cache_size(), lm.ev.buckets)


def test_loglikelihood_rolling_is_the_eval_loss_times_the_tokens(tmp_path):
    lm, params = _lm(tmp_path, 1)
    text = "".join(chr(33 + (7 * i) % 90) for i in range(64))  # two windows of seq_len=32
    got = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(text,)]), disable_tqdm=True)[0]
    tok = [int(t) for t in ByteTokenizer().encode(text)]
    # The training loss on the rows the windows are: the end-of-document token then the first 32
    # tokens, and the 33 tokens ending the text (its first as context).
    rows = np.asarray([[256] + tok[:32], tok[31:64]], np.int32)
    graphdef, _ = nnx.split(transformer_from_params(lm.cfg_model, params))
    loss_sum, count = jax.jit(make_loss_fn(graphdef))(params, {"tokens": jnp.asarray(rows)})
    assert float(count) == 64
    mean = float(loss_sum) / float(count)
    np.testing.assert_allclose(got, -mean * 64, rtol=1e-5)
    assert got < -64  # a random model: more than a nat per byte


def test_generate_until_is_generate_py_greedy_output(tmp_path, capsys):
    from generate import main as generate_main
    from trainer.checkpoint import Checkpointer, checkpoint_dir
    from configs import dump_config

    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [f"run.dir={tmp_path}", *MODEL])
    program = abstract_program(cfg, jax.devices()[:1])
    state = init_state(cfg.model, program.tx, 0, program.state_sh)
    with open(os.path.join(tmp_path, "config.yaml"), "w") as f:
        f.write(dump_config(cfg))
    ckpt = Checkpointer(checkpoint_dir(str(tmp_path)), cfg.checkpoint)
    ckpt.save(1, state, _NoData())
    ckpt.wait()
    ckpt.close()
    lm = MeshLM(evaluator_of(program, state.params), ByteTokenizer(), cfg.model)
    prompt = "def main("
    assert generate_main(["--run-dir", str(tmp_path), "--prompt", prompt, "--max-new-tokens", "24"]) == 0
    sampled = capsys.readouterr().out[len(prompt):].rstrip("\n")
    stop = sampled[5:7]
    want = sampled[: sampled.index(stop)]
    assert want and want != sampled
    got = lm.generate_until(_requests("generate_until", [(prompt, {"until": [stop], "max_gen_toks": 24}),
                                                          (prompt, {"until": [], "max_gen_toks": 24})]))
    assert got == [want, sampled]


class _NoData:
    """The data position a checkpoint saves beside the state: none here, no data was read."""

    def get_state(self) -> dict:
        return {}


def test_buckets():
    assert buckets_for(32, False) == (16, 32)
    assert buckets_for(100, False) == (16, 32, 64, 100)
    assert buckets_for(100, True) == (100,)
