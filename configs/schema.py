"""The typed configuration schema: every key a user can set, with its type and default.

Keys are dotted paths into these dataclasses (`train.steps`, `mesh.fsdp`, ...). The defaults
are the default run (`python train.py`): a small byte-level LM on the Python standard library.
Static checks that need no devices live in `configs/validate.py`; checks that need the device
count live in `sharding.mesh`.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any, Iterable

# Each `model.remat` name, with the `jax.checkpoint_policies` member saying what a layer keeps for
# its backward pass (None: no remat at all; "nothing_saveable": only the layer's input).
REMAT_SAVES: dict[str, str | None] = {
    "none": None,
    "full": "nothing_saveable",
    "save_dots": "checkpoint_dots",
    "save_dots_no_batch": "dots_with_no_batch_dims_saveable",
}
REMAT_POLICIES = tuple(REMAT_SAVES)
ATTENTION_IMPLS = ("xla", "dot_product", "cudnn", "splash")
QUANT_MODES = ("none", "fp8", "int8")  # model.quant: the block matmuls' operand precision (model/quant.py)
GRAD_REDUCE_DTYPES = ("compute", "float32", "bfloat16")  # model.grad_reduce
GATHER_DTYPES = ("compute", "fp8")  # model.gather_dtype
LOGITS_DTYPES = ("compute", "float32")  # model.logits_dtype
FLAT_WEIGHT_GRADS = ("auto", "on", "off")  # model.flat_weight_grads
CPU_MATMULS = ("auto", "mkl", "xla")  # model.cpu_matmul (model/cpu_matmul.py)
REUSE_HOST_MEMORY = ("auto", "on", "off")  # run.reuse_host_memory
DTYPES = ("float32", "bfloat16", "float16")
DATA_SOURCES = ("text", "prepared", "synthetic")
PACKINGS = ("concat", "document")
SCHEDULES = ("cosine", "linear", "constant")
OPTIMIZERS = ("adamw", "muon", "adafactor", "lion")  # all from optax (trainer/optimizer.py)
TRACKERS = ("tensorboard", "wandb", "mlflow")  # trainer/trackers.py
MESH_AXES = ("pipeline", "data", "fsdp", "expert", "context", "tensor")  # outermost first
ROUTERS = ("softmax_topk", "topk_softmax")  # model.moe.router (model/moe.py)
GROUPED_MATMULS = ("auto", "ragged_dot", "megablox")  # model.moe.grouped_matmul (trainer/layout.py)
# pipeline.schedule: the names of pipeline/registry.py's schedules (tests/test_plan.py checks they agree)
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
# The logical dim names the model gives its parameters and activations (model/layers.py,
# model/transformer.py, the pipeline runner): the only keys a rules table may have, since a rule
# for any other name matches nothing. tests/test_config.py checks the model uses exactly these.
# `sublayers`: the dense layers inside one group of `model.moe.every` layers (model/transformer.py).
LOGICAL_AXES = ("batch", "length", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "layers", "expert",
                "sublayers")


class ConfigError(ValueError):
    """A bad key or value. Its message is one line that names the key or file."""


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice a typo most likely meant, or None if none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return close[0] if close else None


@dataclass(kw_only=True)
class RunConfig:
    dir: str = "runs/default"
    seed: int = 0
    # A directory for XLA's persistent compilation cache ("": off): a restarted or resumed job
    # with the same program skips the compile (minutes at scale). Shared storage on a cluster.
    compile_cache: str = ""
    # Keep the host memory a step frees for the next (glibc's mallopt; trainer/host_memory.py):
    # XLA:CPU's step temporaries are otherwise mapped and page-faulted afresh every step (about a
    # sixth of the default CPU step). "auto": in CPU-only processes; "on"; "off".
    reuse_host_memory: str = "auto"
    # run.dir's lock (trainer.rundir_lock): the holder refreshes it 4 times per period; a holder
    # on another host whose heartbeat stays still this long is taken to be gone.
    lock_timeout_s: float = 30.0
    # Where process 0 sends every metric, the config and the summary (trainer/trackers.py).
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])


@dataclass(kw_only=True)
class TrainConfig:
    steps: int = 200
    global_batch: int = 16
    grad_accum: int = 1
    # The batch (each micro-batch) as this many independent parts whose loss sums and gradients add
    # up: 0, the stack picks (trainer/layout.py `batch_streams`: 2 on a one-device CPU mesh with
    # XLA's matmuls).
    batch_streams: int = 0
    log_every: int = 10
    step_timeout_s: float = 900.0  # a step (or save) stuck this long: dump stacks, exit 4; 0: off
    max_bad_steps: int = 10  # non-finite loss/grad-norm steps in a row before stopping (exit 3)
    preempt_exit_code: int = 143  # after SIGTERM/SIGINT and a committed checkpoint (0: "done")


@dataclass(kw_only=True)
class DistConfig:
    """Several processes (jax.distributed). Empty/0/-1: detect SLURM, Open MPI or a TPU pod from
    the environment, else run as one process."""

    coordinator: str = ""  # host:port of process 0
    num_processes: int = 0
    process_id: int = -1
    init_timeout_s: int = 300
    heartbeat_timeout_s: int = 20  # a silent peer is declared dead after this long


@dataclass(kw_only=True)
class MeshConfig:
    """Mesh axis sizes, outermost first. One may be -1: it takes the devices left over."""

    pipeline: int = 1
    data: int = -1
    fsdp: int = 1
    expert: int = 1  # splits the MoE experts (and the batch); tokens reach them by all-to-all
    context: int = 1  # splits activations' `length` dim (the sequence); see ContextConfig
    tensor: int = 1
    # A hybrid mesh: the job spans `nodes` GPU hosts or TPU slices (> 1), and only the axis
    # `across` crosses them (InfiniBand / DCN); the other axes stay inside a node (NVLink / ICI).
    nodes: int = 1
    across: str = "data"


@dataclass(kw_only=True)
class PipelineConfig:
    """Used when mesh.pipeline > 1: the stacked layers are split into stages over `pipeline`."""

    microbatches: int = 0  # 0: as many as stages
    repeats: int = 1  # > 1: circular schedule, each stage holds `repeats` non-adjacent layer groups
    # gpipe: all forwards, then all backwards (activations of every microbatch live at once);
    # 1f1b: one forward and one backward per tick (activations of at most 2S - 1 microbatches);
    # interleaved_1f1b: the same over `repeats` layer groups per stage (at most 2RS - 1 stage inputs);
    # zero_bubble: 1f1b with each backward split, the weight-gradient half deferred into the bubble.
    schedule: str = "gpipe"


CONTEXT_STRATEGIES = ("allgather", "ring")


@dataclass(kw_only=True)
class ContextConfig:
    """Attention under a sequence split (mesh.context > 1)."""

    # allgather: keys and values gathered over `context`, queries stay local.
    # ring: key/value blocks passed round the `context` ring, online softmax (no whole-sequence keys).
    strategy: str = "allgather"
    # Each device holds chunks i and 2C-1-i of the sequence (2C chunks), so causal attention gives
    # every device the same work; needs model.seq_len divisible by 2 x mesh.context.
    load_balance: bool = True


@dataclass(kw_only=True)
class MoEConfig:
    """A mixture of experts in place of the blocks' SwiGLU (model/moe.py); num_experts 0: dense."""

    num_experts: int = 0
    # Every k-th layer is an MoE (layers k-1, 2k-1, ...: Qwen3-MoE's decoder_sparse_step), the
    # others dense SwiGLU; 1: every layer. model.num_layers must be a multiple.
    every: int = 1
    experts_per_token: int = 2  # top-k
    d_ff: int = 0  # per expert; 0: model.d_ff
    shared_experts: int = 0  # always-on experts (one SwiGLU of shared_experts x d_ff beside the routed ones)
    # softmax_topk (Mixtral): top-k of the logits, softmax over those k. topk_softmax (Qwen3-MoE):
    # softmax over all experts, then top-k, divided by their sum if `renormalize`.
    router: str = "softmax_topk"
    renormalize: bool = True
    aux_loss_coef: float = 0.01  # Switch load-balancing loss, added to the training loss
    router_z_loss_coef: float = 0.001  # mean squared logsumexp of the router logits
    # 0: dropless (every chosen expert computes every token). > 0: each expert takes at most
    # ceil(capacity_factor x tokens x top-k / experts) of a device's tokens; the rest are dropped.
    capacity_factor: float = 0.0
    # The dropless experts' grouped matmuls: ragged_dot (jax.lax.ragged_dot, what XLA makes of it),
    # megablox (the Pallas TPU kernel in jax.experimental.pallas.ops.tpu.megablox: on TPU compiled,
    # on CPU interpreted, for tests; needs model.d_model, the expert d_ff and each device's rows
    # (model.seq_len / mesh.context x experts_per_token) in multiples of 128, its tile), auto:
    # megablox on TPU where those divide, else ragged_dot.
    grouped_matmul: str = "auto"

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0


@dataclass(kw_only=True)
class ModelConfig:
    num_layers: int = 4
    d_model: int = 256
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 0  # 0: d_model // num_heads
    d_ff: int = 768
    vocab_size: int = 264  # 256 bytes + end-of-document, padded to a multiple of 8
    seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    # RMSNorm (a learned scale per head_dim entry) on every head of q and k, before the rotary
    # embedding, as Qwen3 and Qwen3-MoE do; off: Llama, Mixtral.
    qk_norm: bool = False
    init_std: float = 0.02
    dtype: str = "float32"  # compute dtype; parameters are always float32
    remat: str = "none"
    attention: str = "xla"
    loss_chunk: int = 0  # > 0: output head + loss this many positions at a time (no full logits)
    # The dtype the output head's matmul writes the logits in: "compute" (model.dtype, as MaxText,
    # torchtitan and Megatron do; the loss upcasts inside its own fused reductions, so no float32
    # [batch, length, vocab] array exists) or "float32". Same for a float32 model.
    logits_dtype: str = "compute"
    # > 0: with data.packing=document a row holds at most this many documents (pieces), and
    # cudnn attention takes them as cuDNN's packed layout; 0: no bound (cudnn builds a dense mask).
    max_documents: int = 0
    # Layers per trip of the layer scan (lax.scan's `unroll`). 0: the stack picks: on CPU a stack
    # of at most CPU_UNROLL_LAYERS (trainer/layout.py) layers is unrolled whole (XLA:CPU spends about a tenth of the
    # default step on the scan's stacked buffers), everywhere else 1 (compile time flat in depth).
    scan_unroll: int = 0
    # Queries per block of `attention: xla`, each block scoring only the keys up to its own end
    # (model.attention.query_blocked_attention: the same sums, about half the [T, T] work). 0: the
    # stack picks: on CPU CPU_ATTENTION_BLOCK (trainer/layout.py) when the sequence is not split
    # (XLA:CPU spends most of the attention's time on the [T, T] passes), everywhere else one
    # block; seq_len or more: one block (the plain kernel).
    attention_block: int = 0
    # The block weight gradients' sum over the tokens as one merged (batch x length) dim ("on")
    # or over the two dims ("off"): the same sums; XLA:CPU writes the activation transposed for
    # the two-dim form (model/quant.py). "auto": on for CPU programs whose sequence is not split
    # (mesh.context=1), off elsewhere (trainer/layout.py `flat_weight_grads`).
    flat_weight_grads: str = "auto"
    # The CPU step's float32 matmuls (the blocks' projections, the query-blocked attention's
    # products): "mkl", the MKL kernel of model/cpu_matmul.py (a one-device CPU mesh only), or
    # "xla", XLA:CPU's own. "auto": mkl on a one-device CPU mesh of a float32 model whose remat
    # policy saves no dots, where the kernel is built, else xla (trainer/layout.py `cpu_matmul`).
    cpu_matmul: str = "auto"
    quant: str = "none"  # none | fp8 | int8: the blocks' matmuls (model/quant.py)
    # The dtype block weight gradients leave their matmuls in, so the dtype their reductions over
    # the batch shards move ("compute": the compute dtype).
    grad_reduce: str = "compute"
    # The dtype block weights are gathered from their shards in (FSDP): "compute", or "fp8"
    # (float8_e4m3fn with one scale per weight, back in the compute dtype after the gather).
    gather_dtype: str = "compute"
    moe: MoEConfig = field(default_factory=MoEConfig)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.num_heads


@dataclass(kw_only=True)
class DataConfig:
    source: str = "text"
    path: str = ""  # text: glob of files (empty: Python's standard library); prepared: the directory
    mixture: str = ""  # prepared corpora with weights, "DIR_A:0.7,DIR_B:0.3" (instead of data.path)
    tokenizer: str = "byte"  # "byte", or a path to a tokenizer.json or a SentencePiece .model
    packing: str = "concat"  # concat: join and cut; document: whole documents, attention within each
    eval_fraction: float = 0.02  # text source: share of documents held out (by content hash) for eval
    read_threads: int = 2
    prefetch: int = 4
    workers: int = 0  # Grain worker processes (0: threads only)


@dataclass(kw_only=True)
class EvalConfig:
    every: int = 50  # steps between evals of the held-out split; 0: off
    batches: int = 4  # global batches per eval (the same ones every time)


@dataclass(kw_only=True)
class OptimConfig:
    name: str = "adamw"
    lr: float = 3e-3  # under muon: the AdamW rate of the embedding, output head and norms
    muon_lr: float = 0.02  # under muon: the rate of the block matrices (Muon's own scale)
    warmup_steps: int = 30
    schedule: str = "cosine"
    # The schedule's horizon: the step the decay ends at. 0: train.steps at the run's start, then
    # kept on resume (from the checkpoints' config.yaml), so a longer train.steps continues the
    # schedule the run was on instead of reshaping it.
    decay_steps: int = 0
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip: float = 1.0  # global-norm clipping; 0 turns it off


@dataclass(kw_only=True)
class CheckpointConfig:
    every: int = 100
    keep: int = 3
    async_save: bool = True
    fresh_if_unreadable: bool = False  # no readable checkpoint: start over instead of exit 2


@dataclass(kw_only=True)
class InitConfig:
    """Where the parameters of a run with no checkpoint come from (default: random, run.seed)."""

    from_hf: str = ""  # a Hugging Face Llama directory (config.json + safetensors); see model/hf.py


@dataclass(kw_only=True)
class ProfileConfig:
    steps: list[int] = field(default_factory=list)  # [a, b]: trace steps a..b into run.dir/profile/; []: off


@dataclass(kw_only=True)
class DebugConfig:
    nan_steps: str = ""  # fault injection: comma-separated steps whose batch is poisoned


def _default_param_rules() -> dict[str, Any]:
    # FSDP is one rule: stored parameters shard their `embed` dim over `fsdp`.
    return {
        "batch": ["data", "fsdp", "expert"],
        "embed": "fsdp",
        "heads": "tensor",
        "kv_heads": "tensor",
        "mlp": "tensor",
        "vocab": "tensor",
        "layers": "pipeline",
        "expert": "expert",
    }


def _default_activation_rules() -> dict[str, Any]:
    # Activations keep `embed` whole: FSDP gathers weights, not activations.
    return {
        "batch": ["data", "fsdp", "expert"],
        "heads": "tensor",
        "kv_heads": "tensor",
        "mlp": "tensor",
        "vocab": "tensor",
        "layers": "pipeline",
        "length": "context",
        "expert": "expert",
    }


@dataclass(kw_only=True)
class ShardingConfig:
    """Logical-axis -> mesh-axis rules, as data. A value is a mesh axis, a list of them, or null."""

    params: dict[str, Any] = field(default_factory=_default_param_rules)
    activations: dict[str, Any] = field(default_factory=_default_activation_rules)


@dataclass(kw_only=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    context: ContextConfig = field(default_factory=ContextConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    init: InitConfig = field(default_factory=InitConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)


def nan_steps(cfg: Config) -> set[int]:
    """The steps `debug.nan_steps` poisons ('3,7' -> {3, 7}). Raises ConfigError if malformed."""
    text = cfg.debug.nan_steps.strip()
    try:
        return {int(s) for s in text.split(",")} if text else set()
    except ValueError:
        raise ConfigError(f"debug.nan_steps: expected comma-separated step numbers, got {text!r}") from None


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
