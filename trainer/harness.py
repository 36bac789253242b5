"""lm-evaluation-harness on a meshlm model: `MeshLM` is the harness's language model (its `LM`
interface) backed by the run's own sharded forward on the run's mesh (trainer/tasks.py finds and
runs the tasks on it).

Scoring requests are packed into rows of `train.global_batch` (the batch the run's layout
divides) and right-padded to a few fixed lengths (powers of two up to `model.seq_len`), so the
scoring step compiles once per length, not once per request; a row longer than `model.seq_len`
keeps its last tokens, as the harness's own models do. Generation is greedy decoding with the
key/value cache of model/decode.py, prompts left-padded to the same lengths (padding slots never
attended to), the decoding length rounded up to a power of two and the tokens past the request's
cut: one program per (prompt length, decoding length) bucket.
`lm_eval` is imported here, in trainer/tasks.py and in eval.py only (the optional `eval` extra).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import defaultdict
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from data.tokenizer import Tokenizer
from model.decode import generate
from model.inputs import TokenInputs
from model.kernels import use_kernels
from trainer.compute import Compute

Array = jax.Array
SHORTEST = 16  # the shortest padded row: shorter buckets would cost compiles for little


def make_score_fn(graphdef: nnx.GraphDef, compute: Compute) -> Callable:
    """score(params, inputs, targets, weights) -> (the weighted sum of the targets' log-probabilities
    per row [batch] float32, whether every weighted target is the argmax [batch] bool), through the
    training forward as `compute` says it runs (cast, layer runner, kernels, sequence order)."""
    cast, order = compute.cast, compute.order

    def score(params: dict, inputs: Array, targets: Array, weights: Array) -> tuple[Array, Array]:
        model = nnx.merge(graphdef, params if cast is None else cast(params))
        positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
        if order is not None:  # a sum over positions: the rows may be permuted as a whole
            inputs, targets, weights, positions = (a[:, order] for a in (inputs, targets, weights, positions))
        with use_kernels(compute.kernels):
            x, _ = model.features_and_stats(inputs, TokenInputs(positions), runner=compute.runner)
        # Reductions of the logits only (no second [batch, length, vocab] array of log-probabilities).
        logits = model.logits(x).astype(jnp.float32)
        hit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        logp = hit - jax.nn.logsumexp(logits, axis=-1)
        greedy = (jnp.argmax(logits, axis=-1) == targets) | (weights == 0)
        return jnp.sum(logp * weights, axis=1), jnp.all(greedy, axis=1)

    return score


@dataclasses.dataclass
class Evaluator:
    """What `MeshLM` runs on: the parameters on their mesh, the model's structure, how it computes,
    the batch's sharding and the context that binds the model's activation rules while tracing."""

    params: dict
    graphdef: nnx.GraphDef
    compute: Compute
    batch_sh: jax.sharding.NamedSharding
    rows: int  # rows of every scoring batch
    seq_len: int
    buckets: tuple[int, ...]  # the padded lengths
    tracing: Callable[[], contextlib.AbstractContextManager]


def buckets_for(seq_len: int, fixed: bool) -> tuple[int, ...]:
    """The padded row lengths: powers of two from SHORTEST below seq_len, then seq_len; only
    seq_len where the layout needs it (a pipeline or a sequence split)."""
    if fixed:
        return (seq_len,)
    out, n = [], SHORTEST
    while n < seq_len:
        out.append(n)
        n *= 2
    return (*out, seq_len)


def evaluator_of(program: Any, params: dict) -> Evaluator:
    """The `Evaluator` of a `trainer.program.Program` and parameters sharded as its state's."""
    cfg, layout = program.spec.cfg, program.spec.layout
    fixed = layout.pipelined or program.compute.order is not None
    return Evaluator(params, program.spec.model.graphdef, program.compute, program.batch_sh, cfg.train.global_batch,
                     cfg.model.seq_len, buckets_for(cfg.model.seq_len, fixed), program.tracing)


class MeshLM(TemplateLM):
    """The harness's model interface over an `Evaluator` and the run's tokenizer."""

    def __init__(self, ev: Evaluator, tokenizer: Tokenizer, cfg_model: Any):
        super().__init__()
        self.ev, self.tokenizer, self.cfg_model = ev, tokenizer, cfg_model
        self._score = jax.jit(make_score_fn(ev.graphdef, ev.compute), in_shardings=(None, ev.batch_sh, ev.batch_sh,
                                                                                     ev.batch_sh))
        self.requests_done = 0
        self.model_seconds = 0.0  # spent in score_tokens and generate_until, compiles included

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eod_id

    @property
    def max_length(self) -> int:
        return self.ev.seq_len

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(string)]

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """The harness's own (its context/continuation split), without a progress bar."""
        return super().loglikelihood(requests, disable_tqdm=True)

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        return self.score_tokens([(ctx, cont) for _, ctx, cont in requests])

    def score_tokens(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(context ids, continuation ids) pairs -> (log-probability of the continuation, whether
        it is the greedy one), in the order given."""
        t0 = time.perf_counter()
        rows = [_row(ctx + cont, len(cont), self.ev.seq_len) for ctx, cont in pairs]
        by_bucket: dict[int, list[int]] = defaultdict(list)
        for i, (inputs, _, _) in enumerate(rows):
            by_bucket[next(b for b in self.ev.buckets if b >= len(inputs))].append(i)
        out: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        for length, members in sorted(by_bucket.items()):
            for chunk in _chunks(members, self.ev.rows):
                arrays = _pack([rows[i] for i in chunk], self.ev.rows, length)
                with self.ev.tracing():
                    sums, greedy = jax.device_get(self._score(self.ev.params, *arrays))
                for j, i in enumerate(chunk):
                    out[i] = (float(sums[j]), bool(greedy[j]))
        self.requests_done += len(pairs)
        self.model_seconds += time.perf_counter() - t0
        return out

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-probability: its tokens after an end-of-document token, in disjoint
        windows of `model.seq_len` targets (the harness's own rolling windows)."""
        pairs, owner = [], []
        for n, (text,) in enumerate(req.args for req in requests):
            windows = get_rolling_token_windows(token_list=self.tok_encode(text), prefix_token=self.eot_token_id,
                                                max_seq_len=self.ev.seq_len, context_len=1)
            for ctx, cont in map(make_disjoint_window, windows):
                pairs.append((ctx, cont))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (logp, _) in zip(owner, self.score_tokens(pairs)):
            totals[n] += logp
        return totals

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut at the first stop string (`until`) or end of document."""
        t0 = time.perf_counter()
        todo = [(req.args[0], dict(req.args[1])) for req in requests]
        by_shape: dict[tuple[int, int], list[int]] = defaultdict(list)
        prompts = [self.tok_encode(ctx)[-self.ev.seq_len:] or [self.eot_token_id] for ctx, _ in todo]
        wanted = [int(kwargs.get("max_gen_toks", 256)) for _, kwargs in todo]
        for i, new in enumerate(wanted):  # decoding lengths rounded up to a power of two: fewer programs
            length = next(n for n in buckets_for(self.ev.seq_len, False) if n >= len(prompts[i]))
            by_shape[(length, max(SHORTEST, 1 << (new - 1).bit_length()))].append(i)
        out = [""] * len(todo)
        model = nnx.merge(self.ev.graphdef, self.ev.params)
        for (length, new), members in sorted(by_shape.items()):
            for chunk in _chunks(members, self.ev.rows):
                rows = [prompts[i] for i in chunk] + [prompts[chunk[0]]] * (self.ev.rows - len(chunk))
                pad = np.asarray([length - len(r) for r in rows], np.int32)
                batch = np.asarray([[self.eot_token_id] * p + r for p, r in zip(pad, rows)], np.int32)
                tokens = np.asarray(generate(model, batch, new, pad=pad))
                for j, i in enumerate(chunk):
                    out[i] = self.cut(tokens[j, : wanted[i]].tolist(), todo[i][1].get("until"))
        self.requests_done += len(todo)
        self.model_seconds += time.perf_counter() - t0
        return out

    def cut(self, tokens: list[int], until: str | list[str] | None) -> str:
        """The text of `tokens` up to an end of document and the first of the stop strings."""
        if self.eot_token_id in tokens:
            tokens = tokens[: tokens.index(self.eot_token_id)]
        text = self.tok_decode(tokens)
        for stop in [until] if isinstance(until, str) else (until or []):
            if stop and stop in text:
                text = text[: text.index(stop)]
        return text


def _row(whole: list[int], n_cont: int, seq_len: int) -> tuple[list[int], list[int], int]:
    """(inputs, targets, how many of the last targets count) of a context + continuation, its
    last `seq_len` positions kept."""
    inputs, targets = whole[:-1][-seq_len:], whole[1:][-seq_len:]
    return inputs, targets, min(n_cont, len(targets))


def _chunks(items: list[int], size: int) -> Iterator[list[int]]:
    for i in range(0, len(items), size):
        yield items[i: i + size]


def _pack(rows: list[tuple[list[int], list[int], int]], n: int, length: int) -> tuple[np.ndarray, ...]:
    """Rows padded right to `length` and with empty rows to `n`: (inputs, targets, weights)."""
    inputs, targets, weights = np.zeros((n, length), np.int32), np.zeros((n, length), np.int32), np.zeros((n, length),
                                                                                                           np.float32)
    for i, (inp, tgt, k) in enumerate(rows):
        inputs[i, : len(inp)], targets[i, : len(tgt)] = inp, tgt
        weights[i, len(tgt) - k: len(tgt)] = 1.0
    return inputs, targets, weights

