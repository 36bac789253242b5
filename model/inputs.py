"""The per-token inputs of a forward pass beside the tokens, as one structure: `TokenInputs`.

Every layer, layer runner and pipeline schedule takes this one value rather than one argument
per input, so a new per-token input (a mask, a modality id) is a field here and changes no
signature on its way to the layer that reads it. It is a pytree: a pipeline splits it into
micro-batches, a scan carries it and a sequence split reorders it like any array; a field that
is None is no leaf and costs nothing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from model.lora import for_layer

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenInputs:
    """[batch, length] arrays in the order the tokens are in."""

    positions: Array  # int32: the position of each token in its document (rotary embeddings, masks)
    segment_ids: Array | None = None  # int32: the document of each token under packing (None: one per row)
    noise: Array | None = None  # uint32: a training step's LoRA dropout noise (model/lora.py; None: no dropout)

    @staticmethod
    def of(tokens: Array, positions: Array | None = None, segment_ids: Array | None = None,
           noise: Array | None = None) -> TokenInputs:
        """The inputs of `tokens` [batch, length]; positions 0 .. length - 1 in every row unless given."""
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1], dtype=jnp.int32), tokens.shape)
        return TokenInputs(positions, segment_ids, noise)

    def for_layer(self, layer: Array | int) -> TokenInputs:
        """The inputs layer `layer` sees (a global index, or a sublayer's within its group): its
        own LoRA dropout noise, mixed from the step's with the index (model/lora.py)."""
        if self.noise is None:
            return self
        return dataclasses.replace(self, noise=for_layer(self.noise, layer))

    def map(self, fn: object) -> TokenInputs:
        """Every present field through `fn` (a reorder, a micro-batch split, a reshape)."""
        return jax.tree.map(fn, self)
