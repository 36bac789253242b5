"""The network, written once with logical axis names; it knows no mesh and no devices."""

from model.flops import flops_per_token, matmul_params, stack_layers
from model.inputs import TokenInputs
from model.transformer import LayerRunner, Transformer, abstract_transformer, remat, scan_layers

__all__ = ["LayerRunner", "TokenInputs", "Transformer", "abstract_transformer", "flops_per_token", "matmul_params",
           "remat", "scan_layers", "stack_layers"]
