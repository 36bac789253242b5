"""SFT and DPO data and losses: the chat template renders and marks assistant text as
`transformers` does; data.prepare counts the rows that are no example; the SFT loss is the
cross-entropy over assistant tokens and the DPO loss, rewards and margin are the paper's, each
against an independent float64 NumPy computation."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import ConfigError, load_config
from conftest import ROOT, require
from data import open_source
from data.chat import ChatTemplate, chat_segments
from data.manifest import read_manifest
from data.prepare import prepare
from model.preference import preference_loss, token_logps
from trainer import objectives
from trainer.objectives.dpo import make_dpo_loss_fn, make_reference_fn
from trainer.program import abstract_program
from trainer.state import init_state
from trainer.objectives.lm import make_loss_fn

# ChatML with transformers' {% generation %} marks around what the assistant says.
CHATML = ("{{ bos_token }}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
          "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
          "{% else %}{{ m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there"}, {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "ciao"}]


def write_jsonl(path, rows: list) -> str:
    with open(path, "w") as f:
        f.writelines((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    return str(path)


def test_chat_template_renders_and_marks_assistant_text_as_transformers_does(tmp_path):
    chat_utils = require("transformers.utils.chat_template_utils", "hf")
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": CHATML, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    template = ChatTemplate(str(config))
    [text], [spans] = chat_utils.render_jinja_template(conversations=[CHAT], chat_template=CHATML,
                                                       return_assistant_tokens_mask=True, bos_token="<s>")
    segments = chat_segments(template, CHAT)
    assert "".join(s for s, _ in segments) == text == template.render(CHAT)
    ours, at = [], 0
    for piece, trained in segments:
        if trained:
            ours.append((at, at + len(piece)))
        at += len(piece)
    assert ours == [tuple(s) for s in spans] and len(ours) == 2
    assert [text[a:b] for a, b in ours] == ["hello there<|im_end|>\n", "ciao<|im_end|>\n"]
    # Only the turns of a completion train when the prompt is a conversation of its own.
    assert [text[a:b] for a, b in ours[1:]] == [p for p, t in chat_segments(template, CHAT, 3) if t]


def test_bad_rows_are_counted_and_skipped_and_a_file_of_none_is_refused(tmp_path):
    sft = write_jsonl(tmp_path / "sft.jsonl", [
        {"messages": CHAT}, {"messages": CHAT[:2]}, {"text": "no messages"}, "not json",
        {"messages": [{"role": "user"}]}, {"prompt": "2+2=", "completion": "4"}, {"prompt": "p", "completion": ""}])
    m = prepare([sft], str(tmp_path / "p_sft"), progress=False, objective="sft")
    entry = m["inputs"][0]
    assert (m["objective"], entry["documents"], entry["skipped"]) == ("sft", 2, 5)
    assert entry["skip_reasons"] == {"no_assistant": 1, "no_messages": 1, "not_json": 1, "bad_messages": 1,
                                     "no_trained_tokens": 1}
    assert entry["bad_lines"] == [2, 3, 4, 5, 7]
    dpo = write_jsonl(tmp_path / "dpo.jsonl", [
        {"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "a", "chosen": "b"}, {"prompt": "a", "chosen": 1,
                                                                                          "rejected": "c"}])
    entry = prepare([dpo], str(tmp_path / "p_dpo"), progress=False, objective="dpo")["inputs"][0]
    assert (entry["documents"], entry["skip_reasons"]) == (1, {"no_rejected": 1, "not_string": 1})
    none = write_jsonl(tmp_path / "none.jsonl", [{"prompt": "a", "chosen": "b"}])
    with pytest.raises(ConfigError, match=r"none.jsonl: no document in 1 lines \(1 no_rejected\); check --objective dpo"):
        prepare([none], str(tmp_path / "p_none"), progress=False, objective="dpo")
    assert not os.path.exists(tmp_path / "p_none")
    lm = load_config("tiny", ["data.source=prepared", f"data.path={tmp_path / 'p_sft'}"])
    with pytest.raises(ConfigError, match="^data.path: .* was prepared with --objective sft, the config has "
                                          "train.objective=lm$"):
        open_source(lm, lm.train.objective)


def _sft_config(tmp_path, *extra: str):
    """The tiny model on a prepared SFT corpus of two kinds of rows (chat and prompt/completion)."""
    rows = [{"messages": CHAT}, {"prompt": "2+2=", "completion": "4"}] * 24
    prepare([write_jsonl(tmp_path / "sft.jsonl", rows)], str(tmp_path / "sft"), progress=False, objective="sft")
    return load_config(os.path.join(ROOT, "configs", "sft-tiny.yaml"), [
        f"run.dir={tmp_path / 'run'}", f"data.path={tmp_path / 'sft'}", "mesh.data=1", "model.seq_len=96", *extra])


def _model(cfg):
    program = abstract_program(cfg, jax.devices()[:1])
    params = init_state(cfg.model, program.tx, 0, program.state_sh).params
    return program, params, nnx.merge(program.spec.model.graphdef, params)


def _log_softmax64(logits) -> np.ndarray:
    z = np.asarray(logits, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_the_sft_loss_is_the_cross_entropy_over_assistant_tokens(tmp_path):
    cfg = _sft_config(tmp_path)
    source = open_source(cfg, cfg.train.objective)
    rows, _ = source.train[0]
    batch = {k: np.stack([rows[i][k] for i in range(4)]) for k in source.fields}
    # The mask by hand: the bytes of what the assistant says (byte template: content then "\n"),
    # and the end-of-document token after a conversation whose last turn is the assistant's.
    chat = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in CHAT)
    spans = [(chat.index("hello there"), len("hello there\n")), (chat.index("ciao\n"), len("ciao\n"))]
    documents = {chat.encode(): [s for a, n in spans for s in range(a, a + n)] + [len(chat)],
                 b"2+2=4": [4, 5]}
    hand = np.zeros_like(batch["tokens"])
    for r in range(4):
        for seg in range(1, batch["segment_ids"][r].max() + 1):
            where = np.flatnonzero(batch["segment_ids"][r] == seg)
            doc = bytes(batch["tokens"][r][where[:-1]].astype(np.uint8))
            hand[r, where[documents[doc]]] = 1
    np.testing.assert_array_equal(batch["loss_mask"], hand)

    program, params, model = _model(cfg)
    total, count = jax.jit(make_loss_fn(program.spec.model.graphdef, program.compute))(params, batch)
    t, s, p = batch["tokens"], batch["segment_ids"], batch["positions"]
    logp = _log_softmax64(model.logits(model.features(t[:, :-1], p[:, :-1], s[:, :-1])))
    picked = np.take_along_axis(logp, t[:, 1:, None], -1)[..., 0]
    weights = (s[:, 1:] == s[:, :-1]) & (s[:, 1:] != 0) & (hand[:, 1:] == 1)
    assert float(count) == weights.sum() > 0
    np.testing.assert_allclose(float(total) / float(count), -(picked * weights).sum() / weights.sum(), rtol=1e-5)
    every = ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] != 0))
    assert abs(-(picked * every).sum() / every.sum() - float(total) / float(count)) > 0.01  # the mask matters


def test_token_logps_are_the_same_bits_differentiated_or_not_and_match_numpy():
    """DPO's first step has the policy equal to its reference: the log-probs the gradient's
    program computes must be the reference's forward-only ones bit for bit (rewards exactly 0)."""
    rng = np.random.default_rng(0)
    # A new model's small logits: where XLA:CPU's two exp kernels disagreed (on AMD EPYC).
    logits = np.float32(rng.normal(0, 0.1, (16, 32, 264)))
    targets = rng.integers(0, 264, (16, 32)).astype(np.int32)
    weights = np.float32(rng.random((16, 32)))
    alone = jax.jit(token_logps)(logits, targets)
    (_, within), grad = jax.jit(jax.value_and_grad(
        lambda z: (jnp.sum(token_logps(z, targets) * weights), token_logps(z, targets)), has_aux=True))(logits)
    np.testing.assert_array_equal(within, alone)
    log_softmax = _log_softmax64(logits)
    onehot = np.eye(264)[targets]
    np.testing.assert_allclose(alone, np.take_along_axis(log_softmax, targets[..., None], -1)[..., 0], rtol=1e-6,
                               atol=1e-6)
    np.testing.assert_allclose(grad, weights[..., None] * (onehot - np.exp(log_softmax)), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("variant", ["sigmoid", "ipo"])
def test_preference_loss_rewards_and_margin_match_numpy(variant):
    rng = np.random.default_rng(0)
    policy, reference = rng.normal(-20, 5, (32, 2)), rng.normal(-20, 5, (32, 2))
    beta = 0.3
    losses, chosen, rejected = preference_loss(np.float32(policy), np.float32(reference), beta, variant)
    ratios = policy - reference
    margin = ratios[:, 0] - ratios[:, 1]
    expect = np.logaddexp(0.0, -beta * margin) if variant == "sigmoid" else (margin - 1 / (2 * beta)) ** 2
    np.testing.assert_allclose(losses, expect, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(chosen, beta * ratios[:, 0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rejected, beta * ratios[:, 1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", ["sigmoid", "ipo"])
def test_the_dpo_step_loss_and_metrics_match_numpy_from_the_models_log_probs(tmp_path, variant):
    rows = [{"prompt": f"q{i}: ", "chosen": "yes" * (i % 3 + 1), "rejected": "no" * (i % 4 + 1)} for i in range(8)]
    prepare([write_jsonl(tmp_path / "dpo.jsonl", rows)], str(tmp_path / "dpo"), progress=False, objective="dpo")
    cfg = load_config(os.path.join(ROOT, "configs", "dpo-tiny.yaml"), [
        f"run.dir={tmp_path / 'run'}", f"data.path={tmp_path / 'dpo'}", "mesh.data=1", "model.seq_len=16",
        "train.global_batch=8", f"dpo.loss={variant}", "dpo.beta=0.5"])
    source = open_source(cfg, cfg.train.objective)
    batch = {k: np.stack([source.train[0][0][i][k] for i in range(8)]) for k in source.fields}
    assert batch["tokens"].shape == (8, 2, 17)
    program, params, model = _model(cfg)
    graphdef = program.spec.model.graphdef
    reference = jax.tree.map(lambda p: p * 0.9, params)  # a reference that differs from the policy
    ref_logps = jax.jit(make_reference_fn(graphdef, program.compute, cfg.dpo))(reference, batch)
    total, (pairs, stats) = jax.jit(make_dpo_loss_fn(graphdef, program.compute, cfg.dpo))(
        params, {**batch, "ref_logps": ref_logps})

    def logps64(m: nnx.Module) -> np.ndarray:
        t, w = batch["tokens"].reshape(16, 17), batch["loss_mask"].reshape(16, 17)[:, 1:]
        picked = np.take_along_axis(_log_softmax64(m.logits(m.features(t[:, :-1]))), t[:, 1:, None], -1)[..., 0]
        out = (picked * w).sum(-1) / (w.sum(-1) if variant == "ipo" else 1)
        return out.reshape(8, 2)

    ref64 = logps64(nnx.merge(graphdef, reference))
    np.testing.assert_allclose(ref_logps, ref64, rtol=1e-5, atol=1e-5)
    ratios = logps64(model) - ref64
    margin = ratios[:, 0] - ratios[:, 1]
    assert np.ptp(margin) > 0.01  # pairs that differ
    losses = np.logaddexp(0, -0.5 * margin) if variant == "sigmoid" else (margin - 1.0) ** 2
    assert float(pairs) == 8
    np.testing.assert_allclose(float(total) / 8, losses.mean(), rtol=1e-4)
    expect = [0.5 * ratios[:, 0].mean(), 0.5 * ratios[:, 1].mean(), 0.5 * margin.mean(), (margin > 0).mean()]
    np.testing.assert_allclose(np.asarray(stats) / 8, expect, rtol=1e-4, atol=1e-5)


def test_a_hugging_face_tokenizer_brings_its_own_chat_template(tmp_path):
    """The tokenizer_config.json beside a tokenizer.json gives the template; its special tokens
    stay single tokens and the trained ones are the assistant's turns, end-of-turn included."""
    from test_prepare import _hf_tokenizer

    from data.chat import decode_sequence
    from data.tokenizer import load_tokenizer

    path = _hf_tokenizer(tmp_path, "chatml", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    (tmp_path / "chatml" / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "bos_token": ""}))
    manifest = prepare([write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}])], str(tmp_path / "out"),
                       progress=False, objective="sft", tokenizer=path)
    assert manifest["chat_template"]["path"] == str(tmp_path / "chatml" / "tokenizer_config.json")
    tok = load_tokenizer(path)
    shards = read_manifest(str(tmp_path / "out"))["splits"]["train"]["shards"]
    import grain

    record = np.frombuffer(grain.sources.ArrayRecordDataSource([str(tmp_path / "out" / shards[0])])[0], "<u4")
    tokens, mask = decode_sequence(record, tok.eod_id)
    im_end = tok.encode("<|im_end|>")
    assert len(im_end) == 1 and (tokens == im_end[0]).sum() == 5
    trained = [tok.decode(tokens[i : j + 1]) for i, j in _runs(mask[:-1])]
    # (this small vocabulary has no newline: it reads back as [UNK], the same on both sides)
    assert trained == [tok.decode(tok.encode(t)) for t in ("hello there<|im_end|>\n", "ciao<|im_end|>\n")]


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(first, last) index of each run of ones."""
    edges = np.diff(np.concatenate([[0], mask, [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1) - 1))


@pytest.mark.parametrize("overrides, message", [
    (["train.objective=sft"], "train.objective: sft reads a corpus that `python -m data.prepare --objective sft` "
                              "wrote; set data.source=prepared and data.path"),
    (["train.objective=sft", "data.source=prepared", "data.path=/a"],
     "data.packing: train.objective=sft needs document packing, which keeps conversations apart"),
    (["train.objective=dpo", "data.source=prepared", "data.path=/a", "model.mtp_depth=1"],
     "model.mtp_depth: 1 with train.objective=dpo: the DPO loss is the main head's log-probs, so the prediction "
     "modules would get no gradient; set 0"),
    (["train.objective=dpo", "data.source=prepared", "data.path=/a", "eval.every=0", "model.loss_chunk=16"],
     "model.loss_chunk: train.objective=dpo computes whole-row log-probs; set 0"),
])
def test_objective_rules_are_one_line_naming_the_key(overrides, message):
    """Each objective's own checks (trainer/objectives/), run by `trainer.prepare` before anything is built."""
    with pytest.raises(ConfigError) as err:
        objectives.build(load_config("tiny", overrides))
    assert str(err.value) == message
