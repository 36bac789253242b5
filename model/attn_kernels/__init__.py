"""The attention kernels, one module per `model.attention` choice, behind one registry
(registry.py) that the layers, the trainer's checks and compute, the pipeline schedules and the
planner look kernels up in by name.

- xla.py: the float32 reference; takes a sequence split (all-gather, or ring attention bound to
  the mesh) and query chunks.
- dot_product.py: jax.nn.dot_product_attention with the implementation JAX picks.
- cudnn.py: cuDNN's fused attention (GPU only), packed documents without a mask.
- splash.py: the TPU Pallas kernel, always per device under shard_map; 128-position tiles.

    kernel = attn_kernels.get(cfg.model.attention)
    kernel.check_tile(cfg), kernel.check_split(cfg, context), kernel.check_platform(platform)
    kernel.attend(q, k, v, positions, segment_ids, Options(...))  # the layers' call
    kernel.mesh_bound(cfg, platform, binders)  # the mesh-bound form, or None

The kernel modules register when model/__init__.py imports them, not here: they import
model/attention.py, which imports this package's registry (registry.py says why).
"""

from model.attn_kernels.registry import Kernel, MeshBinders, Options, get, names, register

__all__ = ["Kernel", "MeshBinders", "Options", "get", "names", "register"]
