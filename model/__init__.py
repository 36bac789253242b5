"""The network, written once with logical axis names; it knows no mesh and no devices."""

# Each module registers its attention kernel. Imported here, not by model/attn_kernels/__init__.py:
# they import model/attention.py, which imports that package (model/attn_kernels/registry.py).
# In the schema's order, which the registry keeps (model.attention's choices).
from model.attn_kernels import xla, dot_product, cudnn, splash  # noqa: F401, I001
from model.flops import flops_per_token, matmul_params, stack_layers
from model.inputs import TokenInputs
from model.transformer import LayerRunner, Transformer, abstract_transformer, remat, scan_layers

__all__ = ["LayerRunner", "TokenInputs", "Transformer", "abstract_transformer", "flops_per_token", "matmul_params",
           "remat", "scan_layers", "stack_layers"]
