"""The attention kernels by name (`model.attention`): what each one is, and the one way to look it up.

A kernel owns every fact that differs between kernels: the config checks it needs (a tile the
length must fill, whether it takes a sequence split, the platforms that run it), how the layers
call it on arrays that hold whole sequences (`local`, `attend`), whether and how it must see the
mesh (`mesh_bound`), what a run says about it at start (`notes`) and what the planner compiles
in its place on a target that cannot run it (`planned_as`). Callers hold a name and ask `get`;
no kernel name is compared outside this package but in configs/validate.py (below).

Why this shape, within the import direction (docs/design.md,
"Packages and the one import direction"): the registry sits in `model`, below `sharding`, so
the layers can look their kernel up and the model still knows no mesh. The math stays in
model/attention.py, which looks kernels up here; each kernel module imports that math, so the
kernel modules are imported (and register) from model/__init__.py, not from this package's
__init__ (which model/attention.py runs when it imports this registry: the kernels would then
import a half-loaded model/attention.py). A kernel that must see the mesh builds its mesh-bound
form from the two shard_map wrappers sharding/context.py hands it (`MeshBinders`: per device,
or the ring over the sequence split), so the choice is the kernel's and the mesh code stays in
`sharding`.

The names are the config's (configs.schema.ATTENTION_KERNELS, which the configs cannot import
from here); tests/test_attention_registry.py checks the two agree. Two config-only rules stay in
configs/validate.py, which cannot import the model: `chunks` and `one_head_dim` below say the
same facts, and that test checks they agree with it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, ClassVar

import jax
import jax.numpy as jnp

from configs import Config, ConfigError
from configs.registry import Registry, api
from model.kernels import AttentionFn
from model.ring_blocks import BlockKernel

Array = jax.Array
# (q, k, v, segment_ids) -> out: a kernel on one device's rows and heads, whole along `length`.
LocalFn = Callable[[Array, Array, Array, "Array | None"], Array]
# (q_positions, k_positions, q_segment_ids, k_segment_ids) -> [batch, 1, q_len, kv_len] boolean:
# the mask a kernel hands the ring (xla's: model/attention.py `block_mask`).
MaskFn = Callable[[Array, Array, "Array | None", "Array | None"], Array]

__all__ = ["Kernel", "LocalFn", "MaskFn", "MeshBinders", "Options", "get", "names", "register"]


@dataclasses.dataclass(frozen=True)
class Options:
    """The config's knobs a kernel reads when the layers call it."""

    max_documents: int = 0  # model.max_documents: cudnn's packed layout bound (0: a dense mask)
    chunk: int = 0  # model.attention_chunk: queries at a time (0: all; -1: model/attention.py query_chunk)


@dataclasses.dataclass(frozen=True)
class MeshBinders:
    """The layout's shard_map wrappers (sharding/context.py `mesh_binders`), handed to a kernel
    that must see the mesh: the model imports no sharding."""

    per_device: Callable[[LocalFn], AttentionFn]  # the function on each device's rows and heads
    ring: Callable[[MaskFn], AttentionFn]  # ring attention over the sequence split with this mask
    # Ring attention over the sequence split with this fused kernel on each block; the bool:
    # context.load_balance (sharding/fused_ring.py).
    fused_ring: Callable[[BlockKernel, bool], AttentionFn]
    shards: int = 1  # devices along the sequence split (mesh.context)


class Kernel:
    """One attention kernel: its facts as class attributes, its behaviour as methods."""

    name: ClassVar[str]
    tile: ClassVar[int] = 1  # model.seq_len must be a multiple of it
    splits_sequence: ClassVar[bool] = False  # takes a sequence split (mesh.context > 1)
    per_device: ClassVar[bool] = False  # always runs per device under shard_map (always mesh-bound)
    one_head_dim: ClassVar[bool] = False  # takes one head dim for q, k and v (a narrower v is padded)
    chunks: ClassVar[bool] = False  # runs model.attention_chunk's query blocks
    platforms: ClassVar[tuple[str, ...]] = ()  # the JAX platforms that can run it (): every one

    def local(self, q: Array, k: Array, v: Array, positions: Array, segment_ids: Array | None,
              opts: Options) -> Array:
        """The kernel on arrays that hold whole sequences (or, under GSPMD, look as if)."""
        raise NotImplementedError

    def attend(self, q: Array, k: Array, v: Array, positions: Array, segment_ids: Array | None,
               opts: Options) -> Array:
        """The layers' call when no mesh-bound kernel is bound (model/attention.py `attend`)."""
        dv = v.shape[-1]
        if self.one_head_dim and dv != q.shape[-1]:
            # The kernel takes one head dim for q, k and v: v gets zero columns up to it
            # (configs/validate.py refuses a v wider than q), and the output loses them again;
            # the scores, and so the weights, are untouched.
            padded = jnp.pad(v, ((0, 0),) * 3 + ((0, q.shape[-1] - dv),))
            return self.local(q, k, padded, positions, segment_ids, opts)[..., :dv]
        return self.local(q, k, v, positions, segment_ids, opts)

    def mesh_bound(self, cfg: Config, platform: str, binders: MeshBinders) -> AttentionFn | None:
        """The form of the kernel that must see the mesh, bound by the trainer through
        `Compute.kernels` on devices of `platform` (None: the model's own call is enough)."""
        return None

    def check_tile(self, cfg: Config) -> None:
        """Raises ConfigError where model.seq_len does not fill the kernel's tiles."""
        m = cfg.model
        if m.seq_len % self.tile:
            raise ConfigError(f"model.seq_len={m.seq_len} is not a multiple of {self.tile}, the tile of "
                              f"model.attention={self.name}")

    def check_split(self, cfg: Config, context: int) -> None:
        """Raises ConfigError where the kernel cannot take the sequence split over `context` > 1 devices."""
        if not self.splits_sequence:
            splitters = " or ".join(k.name for k in _KERNELS.values() if k.splits_sequence)
            raise ConfigError(f"model.attention={self.name}: the kernel cannot take a sequence split "
                              f"(mesh.context={context}); use model.attention={splitters} with "
                              "context.strategy=allgather or ring")

    def check_platform(self, platform: str) -> None:
        """Raises ConfigError where devices of `platform` ("cpu", "gpu", "tpu") cannot run the kernel."""
        if self.platforms and platform not in self.platforms:
            others = ", ".join(k.name for k in _KERNELS.values() if not k.platforms or platform in k.platforms)
            raise ConfigError(f"model.attention={self.name} runs on {' or '.join(self.platforms)} devices only, "
                              f"not on {platform}: choose one of {others}")

    def check_ring_blocks(self, cfg: Config, context: int) -> None:
        """Raises ConfigError unless the split can run as ring attention with this kernel fused on
        each block (sharding/fused_ring.py): context.strategy=ring, rows of one document (the
        blocks are masked by where they sit, not by segment ids), and ring blocks that fill the
        kernel's tiles (under load balancing a ring step's blocks are half a device's positions; a
        kernel with no tile leaves the length to trainer/checks.py's divisibility check)."""
        if cfg.context.strategy != "ring":
            raise ConfigError(f"model.attention={self.name} takes a sequence split (mesh.context={context}) only as "
                              "ring attention's blocks: set context.strategy=ring, or model.attention=xla for the "
                              "all-gather strategy")
        if cfg.data.packing == "document":
            raise ConfigError(f"data.packing=document: model.attention={self.name} under context.strategy=ring takes "
                              "rows of one document (data.packing=concat); model.attention=xla's ring masks documents")
        parts = 2 * context if cfg.context.load_balance else context
        if self.tile > 1 and cfg.model.seq_len % (parts * self.tile):
            raise ConfigError(f"model.seq_len={cfg.model.seq_len}: the ring's blocks of model.attention={self.name} "
                              f"need a multiple of {parts * self.tile} ({parts} blocks of its "
                              f"{self.tile}-position tile)")

    def notes(self, cfg: Config) -> list[str]:
        """What the run's attention falls back to, said at start (train.py) and in plans."""
        return []

    def planned_as(self, target: str | None) -> tuple[str, str] | None:
        """The kernel plan.py compiles in this one's place for a `target` platform ("cuda", "tpu";
        None: this process's fake CPU devices) that cannot run it, and the note saying so (None: itself)."""
        return None


_KERNELS: Registry[Kernel] = Registry("model.attention")
register, get, names = api(_KERNELS)  # a Kernel subclass decorated with `register`: its `name` selects it
