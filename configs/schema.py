"""The typed configuration schema: every key a user can set, with its type, default and docstring.

Keys are dotted paths into these dataclasses (`train.steps`, `mesh.fsdp`, ...). The defaults
are the default run (`python train.py`): a small byte-level LM on the Python standard library.
Each field declares itself once: its choices as a `Literal[...]`, its range as a `Range` (both
checked by pydantic when `configs/load.py` builds a Config), a `Resume` marker if a resumed run
must keep it (`configs.resume_keys`, checked by `trainer/checkpoint.py`), and a one-line docstring
right under it (`python train.py --help-config`, docs/config.md). Checks between keys live in
`configs/validate.py`; checks that need the device count live in `sharding.mesh`.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Annotated, Any, Iterable, Literal

from annotated_types import MinLen

from configs.fields import Range, Resume, choices
from configs.post import DistillConfig, DPOConfig, RLConfig
from configs.straggler import StragglerConfig
from configs.lora import LoraConfig
from configs.mla import MLAConfig
from configs.rope import RopeScalingConfig
from configs.moe import MoEConfig

# The logical dim names the model gives its parameters and activations (model/layers.py,
# model/transformer.py, the pipeline runner): the only keys a rules table may have, since a rule
# for any other name matches nothing. tests/test_config.py checks the model uses exactly these.
# `sublayers`: the dense layers inside one group of `model.moe.every` layers (model/transformer.py);
# `latent`: the low-rank dims of multi-head latent attention (model/mla.py);
# `lora_rank`: the rank dim of a LoRA adapter (model/lora.py); no rule maps it, so it stays whole;
# `norm`: the scale of a model-width RMSNorm (model/layers.py); no default rule, so replicated.
LOGICAL_AXES = ("batch", "length", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "layers", "expert",
                "sublayers", "latent", "lora_rank", "norm")


class ConfigError(ValueError):
    """A bad key or value. Its message is one line that names the key or file."""


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice a typo most likely meant, or None if none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return close[0] if close else None


@dataclass(kw_only=True)
class RunConfig:
    """Where a run writes, and what it reports to."""

    dir: Annotated[str, MinLen(1)] = "runs/default"
    """The run directory: config.yaml, metrics.jsonl, summary.json, tb/, checkpoints/."""
    seed: Annotated[int, Range(ge=0, lt=2**32), Resume()] = 0
    """Seeds the parameter init and the data order."""
    # A restarted or resumed job with the same program skips the compile (minutes at scale).
    compile_cache: str = ""
    """A directory for XLA's persistent compilation cache ("": off); shared storage on a cluster."""
    # The holder refreshes the lock 4 times per period (ops.rundir_lock).
    lock_timeout_s: Annotated[float, Range(gt=0)] = 30.0
    """Seconds a run.dir lock on another host may stay still before its holder is taken to be gone."""
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = field(default_factory=lambda: ["tensorboard"])
    """Where process 0 sends every metric, the config and the summary (ops/trackers.py)."""


@dataclass(kw_only=True)
class TrainConfig:
    """The training loop: its length, batch and failure handling."""

    steps: Annotated[int, Range(ge=0)] = 200
    """Total optimizer steps; a resumed run continues up to this."""
    global_batch: Annotated[int, Range(gt=0), Resume()] = 16
    """Sequences per step, over all devices and processes."""
    grad_accum: Annotated[int, Range(gt=0)] = 1
    """Micro-batches per step, their gradients summed before one update."""
    log_every: Annotated[int, Range(gt=0)] = 10
    """Steps between metric lines."""
    step_timeout_s: Annotated[float, Range(ge=0, hint="0: off")] = 900.0
    """A step (or save) stuck this long dumps every stack and exits 4."""
    max_bad_steps: Annotated[int, Range(gt=0)] = 10
    """Non-finite loss or grad-norm steps in a row before the run stops (exit 3)."""
    preempt_exit_code: Annotated[int, Range(ge=0, lt=256)] = 143
    """Exit status after SIGTERM once the checkpoint is committed (0: "done"); Ctrl-C (SIGINT) exits 130."""
    objective: Literal["lm", "sft", "dpo", "distill", "grpo"] = "lm"
    """lm: loss on every token; sft: on assistant/completion tokens; dpo: preference pairs; distill: a teacher's logits (docs/post-training.md); grpo: rewards of sampled completions (docs/rl.md)."""


@dataclass(kw_only=True)
class DistConfig:
    """Several processes (jax.distributed). Empty/0/-1: detect SLURM, Open MPI or a TPU pod from
    the environment, else run as one process."""

    coordinator: str = ""
    """host:port of process 0 ("": detect)."""
    num_processes: Annotated[int, Range(ge=0, hint="0: detect")] = 0
    """Processes in the job."""
    process_id: Annotated[int, Range(ge=-1, hint="-1: detect")] = -1
    """This process's index, in [0, dist.num_processes)."""
    init_timeout_s: Annotated[int, Range(gt=0)] = 300
    """Seconds to wait for every process to join."""
    heartbeat_timeout_s: Annotated[int, Range(gt=0)] = 20
    """Seconds after which a silent peer is declared dead."""


@dataclass(kw_only=True)
class MeshConfig:
    """Mesh axis sizes, outermost first. One may be -1: it takes the devices left over."""

    pipeline: int = 1
    """Pipeline stages: the layer stack is split over this axis."""
    data: int = -1
    """Data-parallel axis size (-1: the devices left over)."""
    fsdp: int = 1
    """FSDP axis: shards parameters and optimizer state, and the batch."""
    expert: int = 1
    """Splits the MoE experts (and the batch); tokens reach them by all-to-all."""
    context: int = 1
    """Splits activations' `length` dim (the sequence); see context.*."""
    tensor: int = 1
    """Tensor-parallel axis: shards heads, MLP and vocabulary."""
    # A hybrid mesh: only the axis `across` crosses nodes (InfiniBand / DCN); the other axes stay
    # inside a node (NVLink / ICI).
    nodes: Annotated[int, Range(gt=0, hint="1: one node or slice")] = 1
    """GPU hosts or TPU slices the job spans."""
    across: Literal["pipeline", "data", "fsdp", "expert", "context", "tensor"] = "data"
    """The one mesh axis that crosses nodes; its size must be a multiple of mesh.nodes."""


@dataclass(kw_only=True)
class PipelineConfig:
    """Used when mesh.pipeline > 1: the stacked layers are split into stages over `pipeline`."""

    microbatches: Annotated[int, Range(ge=0, hint="0: one per stage")] = 0
    """Microbatches per step."""
    repeats: Annotated[int, Range(gt=0)] = 1
    """Layer groups per stage; > 1: a circular schedule over non-adjacent groups."""
    # gpipe: all forwards, then all backwards (activations of every microbatch live at once);
    # 1f1b: one forward and one backward per tick (activations of at most 2S - 1 microbatches);
    # interleaved_1f1b: the same over `repeats` layer groups per stage (at most 2RS - 1 stage inputs);
    # zero_bubble: 1f1b with each backward split, the weight-gradient half deferred into the bubble.
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"] = "gpipe"
    """The order stages run microbatches' forwards and backwards in."""


@dataclass(kw_only=True)
class ContextConfig:
    """Attention under a sequence split (mesh.context > 1)."""

    # allgather: key/value gathered over `context`, queries stay local. ring: key/value blocks
    # passed round the `context` ring, online softmax (no whole-sequence keys).
    strategy: Literal["allgather", "ring"] = "allgather"
    """How attention reaches the keys and values of other devices' positions."""
    # Chunks i and 2C-1-i of 2C give causal attention the same work on every device.
    load_balance: bool = True
    """Each device holds two mirrored sequence chunks; needs model.seq_len divisible by 2 x mesh.context."""


@dataclass(kw_only=True)
class ModelConfig:
    """The decoder's shape and numerics."""

    num_layers: Annotated[int, Range(gt=0), Resume()] = 4
    """Transformer blocks."""
    d_model: Annotated[int, Range(gt=0), Resume()] = 256
    """Width of the residual stream."""
    num_heads: Annotated[int, Range(gt=0), Resume()] = 8
    """Query heads."""
    num_kv_heads: Annotated[int, Range(gt=0), Resume()] = 4
    """Key/value heads (grouped-query attention); must divide num_heads."""
    # Compared resolved: 0 and the width it resolves to are the same shape.
    head_dim: Annotated[int, Range(ge=0, hint="0: d_model // num_heads"), Resume(read="resolved_head_dim")] = 0
    """Width of each head; must be even (rotary embeddings)."""
    d_ff: Annotated[int, Range(gt=0), Resume()] = 768
    """Hidden size of the SwiGLU feed-forward."""
    vocab_size: Annotated[int, Range(gt=0), Resume()] = 264  # 256 bytes + end-of-document, padded to a multiple of 8
    """Rows of the embedding and the output head."""
    seq_len: Annotated[int, Range(gt=0), Resume()] = 256
    """Tokens per sequence."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: Annotated[bool, Resume()] = True
    """The output head shares the embedding matrix."""
    # As Qwen3 and Qwen3-MoE do; Llama and Mixtral have none.
    qk_norm: Annotated[bool, Resume()] = False
    """RMSNorm (a learned scale per head_dim entry) on every head of q and k, before the rotary embedding."""
    init_std: float = 0.02
    """Standard deviation of the random init."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype; parameters are always float32."""
    remat: Literal["none", "full", "save_dots", "save_dots_no_batch", "save_ring_attention"] = "none"
    """What a layer keeps for its backward pass; the rest is recomputed (REMAT_SAVES)."""
    attention: Literal["xla", "dot_product", "cudnn", "splash"] = "xla"
    """The attention kernel."""
    attention_chunk: Annotated[int, Range(ge=-1, hint="-1: auto, 0: off")] = -1
    """xla attention this many queries at a time (no [length, length] scores); -1: 4 blocks from 512 tokens."""
    # mla: DeepSeek's multi-head latent attention, shaped by model.mla (num_kv_heads = num_heads).
    attention_type: Annotated[Literal["gqa", "mla"], Resume()] = "gqa"
    """gqa: grouped-query attention (Llama); mla: multi-head latent attention (DeepSeek-V2/V3)."""
    loss_chunk: Annotated[int, Range(ge=0, hint="0: off")] = 0
    """Output head + loss this many positions at a time (no full logits); must divide seq_len."""
    # "compute" is what MaxText, torchtitan and Megatron do: the loss upcasts inside its own fused
    # reductions, so no float32 [batch, length, vocab] array exists.
    logits_dtype: Literal["compute", "float32"] = "compute"
    """The dtype the output head's matmul writes the logits in (compute: model.dtype)."""
    # With data.packing=document cudnn attention takes the documents as cuDNN's packed layout;
    # without a bound it builds a dense mask.
    max_documents: Annotated[int, Range(ge=0, hint="0: no bound")] = 0
    """Most documents (pieces) a packed row holds."""
    quant: Literal["none", "fp8", "int8"] = "none"
    """The operand precision of the blocks' matmuls (model/quant.py)."""
    grad_reduce: Literal["compute", "float32", "bfloat16"] = "compute"
    """The dtype block weight gradients leave their matmuls in, so the dtype their reductions move."""
    # fp8: float8_e4m3fn with one scale per weight, back in the compute dtype after the gather.
    gather_dtype: Literal["compute", "fp8"] = "compute"
    """The dtype block weights are gathered from their FSDP shards in."""
    # DeepSeek-V3: 1 module, its loss at 0.3 early in training and 0.1 later.
    mtp_depth: Annotated[int, Range(ge=0, hint="0: off"), Resume()] = 0
    """Multi-token prediction modules (model/mtp.py): module k also predicts the token k + 1 ahead."""
    mtp_loss_coef: Annotated[float, Range(ge=0)] = 0.3
    """Weight of the multi-token prediction loss (the mean over its depths) in the training loss."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    mla: MLAConfig = field(default_factory=MLAConfig)
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.num_heads


@dataclass(kw_only=True)
class DataConfig:
    """The training and eval tokens: where they come from and how they are packed."""

    source: Annotated[Literal["text", "prepared", "synthetic"], Resume()] = "text"
    """text: files, one per document; prepared: a data.prepare directory; synthetic: random tokens."""
    path: Annotated[str, Resume()] = ""
    """text: a glob of files ("": Python's standard library); prepared: the directory."""
    mixture: Annotated[str, Resume()] = ""
    """Prepared corpora with weights, "DIR_A:0.7,DIR_B:0.3" (instead of data.path)."""
    tokenizer: Annotated[str, Resume()] = "byte"
    """The tokenizer: "byte", or a path to a tokenizer.json or a SentencePiece .model."""
    packing: Annotated[Literal["concat", "document"], Resume()] = "concat"
    """concat: join and cut; document: whole documents, attention within each."""
    eval_fraction: Annotated[float, Range(ge=0, lt=1), Resume()] = 0.02
    """text source: the share of documents held out (by content hash) for eval."""
    read_threads: Annotated[int, Range(gt=0)] = 2
    """Grain read threads."""
    verify: bool = False
    """prepared corpora: check every shard's sha256 against the manifest at start (reads every byte once; sizes are always checked)."""
    cache_dir: str = ""
    """prepared corpora on a bucket: this host's local copies, one folder per content hash ("": ~/.cache/meshlm/corpora)."""
    prefetch: Annotated[int, Range(ge=0)] = 4
    """Grain prefetch buffer, in batches."""
    workers: Annotated[int, Range(ge=0, hint="0: threads only")] = 0
    """Grain worker processes."""


@dataclass(kw_only=True)
class EvalConfig:
    """Evals of the held-out split, and downstream tasks (docs/evaluation.md)."""

    every: Annotated[int, Range(ge=0, hint="0: off")] = 50
    """Steps between evals."""
    batches: Annotated[int, Range(gt=0)] = 4
    """Global batches per eval (the same ones every time)."""
    tasks: list[str] = field(default_factory=list)
    """lm-evaluation-harness tasks to run in training: YAML tasks of eval.tasks_dir or the harness's own."""
    tasks_every: Annotated[int, Range(ge=0, hint="0: at the last step only")] = 0
    """Steps between runs of eval.tasks."""
    tasks_dir: str = "configs/eval"
    """The folder of local harness task YAMLs (their data files relative to it)."""
    tasks_limit: Annotated[int, Range(ge=0, hint="0: all")] = 0
    """Examples per task."""


@dataclass(kw_only=True)
class OptimConfig:
    """The optimizer and its learning-rate schedule (trainer/optimizer.py, all from optax)."""

    name: Literal["adamw", "muon", "adafactor", "lion"] = "adamw"
    """The optimizer."""
    lr: Annotated[float, Range(gt=0)] = 3e-3
    """Peak learning rate (under muon: of the embedding, output head and norms)."""
    muon_lr: Annotated[float, Range(gt=0)] = 0.02
    """Under muon: the rate of the block matrices (Muon's own scale)."""
    warmup_steps: Annotated[int, Range(ge=0)] = 30
    """Steps of linear warmup."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """The decay after warmup."""
    # Kept on resume (from the checkpoints' config.yaml), so a longer train.steps continues the
    # schedule the run was on instead of reshaping it.
    decay_steps: Annotated[int, Range(ge=0, hint="0: train.steps at the run's start")] = 0
    """The schedule's horizon: the step the decay ends at."""
    min_lr_ratio: Annotated[float, Range(ge=0, le=1)] = 0.1
    """The rate the decay ends at, as a fraction of optim.lr."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (never on norm scales)."""
    b1: float = 0.9
    """First-moment decay (AdamW, Lion)."""
    b2: float = 0.95
    """Second-moment decay (AdamW, Lion)."""
    eps: float = 1e-8
    """Denominator epsilon."""
    clip: Annotated[float, Range(ge=0, hint="0: off")] = 1.0
    """Global-norm gradient clipping."""


@dataclass(kw_only=True)
class CheckpointConfig:
    """Orbax checkpoints in run.dir/checkpoints/."""

    every: Annotated[int, Range(gt=0)] = 100
    """Steps between checkpoints."""
    keep: Annotated[int, Range(gt=0)] = 3
    """Checkpoints kept."""
    async_save: bool = True
    """Write checkpoints in the background."""
    fresh_if_unreadable: bool = False
    """No readable checkpoint: start over instead of exit 2."""
    local_dir: str = ""
    """A node-local directory for the frequent local tier ("": one tier); see docs/checkpoints-and-faults.md."""
    local_every: Annotated[int, Range(ge=0, hint="0: no local tier")] = 0
    """Steps between local-tier checkpoints (below checkpoint.every)."""
    local_keep: Annotated[int, Range(gt=0)] = 2
    """Local-tier checkpoints kept per process."""


@dataclass(kw_only=True)
class InitConfig:
    """Where the parameters of a run with no checkpoint come from (default: random, run.seed)."""

    from_hf: str = ""
    """A Hugging Face Llama directory (config.json + safetensors) to start from; see model/hf.py."""


@dataclass(kw_only=True)
class ProfileConfig:
    """A jax.profiler trace of some steps."""

    steps: list[int] = field(default_factory=list)
    """[a, b]: trace steps a..b into run.dir/profile/ ([]: off)."""


@dataclass(kw_only=True)
class DebugConfig:
    """Fault injection, for tests."""

    nan_steps: str = ""
    """Comma-separated steps whose batch is poisoned."""


def _default_param_rules() -> dict[str, Any]:
    # FSDP is one rule: stored parameters shard their `embed` dim over `fsdp` (and an MLA weight
    # without one, its `latent` dim). A rule claims a mesh axis in table order, so `expert` comes
    # first: an `embed` rule that also names the expert axis leaves the experts theirs.
    return {
        "expert": "expert",
        "batch": ["data", "fsdp", "expert"],
        "embed": "fsdp",
        "latent": "fsdp",
        "heads": "tensor",
        "kv_heads": "tensor",
        "mlp": "tensor",
        "vocab": "tensor",
        "layers": "pipeline",
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

    # Keys and values are checked in configs/validate.py, whose lines suggest the closest name.
    params: dict[str, Any] = field(default_factory=_default_param_rules)
    """Logical dim of stored parameters -> mesh axis, list of axes, or null; set one as sharding.params.NAME."""
    activations: dict[str, Any] = field(default_factory=_default_activation_rules)
    """The same for activations and the input batch; set one as sharding.activations.NAME."""


@dataclass(kw_only=True)
class Config:
    """The whole run: one section per dataclass above."""

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
    dpo: DPOConfig = field(default_factory=DPOConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)


# The choices other packages loop over, read from their fields.
MESH_AXES = choices(MeshConfig, "across")  # outermost first: the order of the mesh's dims
ATTENTION_KERNELS = choices(ModelConfig, "attention")  # model/attn_kernels registers one kernel each
PIPELINE_SCHEDULES = choices(PipelineConfig, "schedule")
REMAT_POLICIES = choices(ModelConfig, "remat")
TRACKERS = choices(RunConfig, "trackers")

# Each `model.remat` name, with the `jax.checkpoint_policies` member saying what a layer keeps for
# its backward pass (None: no remat at all; "nothing_saveable": only the layer's input), or
# ("save_only_these_names", name, ...): only the values named so (save_ring_attention: the fused
# ring's output and log-sum-exp, model/ring_blocks.py RESIDUALS; full remat otherwise).
# tests/test_config.py checks its names are REMAT_POLICIES.
REMAT_SAVES: dict[str, str | tuple[str, ...] | None] = {
    "none": None,
    "full": "nothing_saveable",
    "save_dots": "checkpoint_dots",
    "save_dots_no_batch": "dots_with_no_batch_dims_saveable",
    "save_ring_attention": ("save_only_these_names", "ring_attention"),
}
# The policies that run every layer's forward again in the backward pass (save_ring_attention all
# but the ring's attention): what the planner's estimates charge a recompute for.
RECOMPUTES_ALL = ("full", "save_ring_attention")


def nan_steps(cfg: Config) -> set[int]:
    """The steps `debug.nan_steps` poisons ('3,7' -> {3, 7}). Raises ConfigError if malformed."""
    text = cfg.debug.nan_steps.strip()
    try:
        return {int(s) for s in text.split(",")} if text else set()
    except ValueError:
        raise ConfigError(f"debug.nan_steps: expected comma-separated step numbers, got {text!r}") from None


def to_dict(cfg: Config) -> dict[str, Any]:
    """The config as nested plain dicts and lists (what config.yaml holds)."""
    return dataclasses.asdict(cfg)
