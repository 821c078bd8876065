"""Preallocated KV cache with one slot per block application, updated in place.

Shared Core weights do not mean shared KV: Core layer j at iteration i has its own entry. The cache
is a plain pytree of two arrays

    k, v: [L, B, S, H, K]   L slots, B batch, S max positions, H heads, K head_dim

with the slots laid out as [prelude layers | Core slots | coda layers]. Writes are
`dynamic_update_slice`s at (slot, 0, start); under `jit` with the cache donated XLA performs them in
place, so the history is never copied or re-concatenated.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from huginn_jax.config import HuginnConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: jax.Array  # [L, B, S, H, K]
    v: jax.Array  # [L, B, S, H, K]
    num_prelude: int = dataclasses.field(metadata=dict(static=True))
    num_core_layers: int = dataclasses.field(metadata=dict(static=True))
    num_core_slots: int = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def create(
        cls, config: HuginnConfig, *, batch: int, max_len: int, num_steps: int, dtype=jnp.float32
    ) -> KVCache:
        """A `full` cache: a slot per prelude layer, per (iteration, Core layer), per coda layer."""
        if max_len > config.block_size:
            raise ValueError(
                f"max_len={max_len} exceeds the model's block_size={config.block_size}"
            )
        if batch < 1 or max_len < 1 or num_steps < 1:
            raise ValueError(f"{batch=}, {max_len=} and {num_steps=} must be positive")
        num_core_slots = num_steps * config.n_core
        slots = config.n_layers_in_prelude + num_core_slots + config.n_layers_in_coda
        shape = (slots, batch, max_len, config.n_heads, config.head_dim)
        return cls(
            k=jnp.zeros(shape, dtype),
            v=jnp.zeros(shape, dtype),
            num_prelude=config.n_layers_in_prelude,
            num_core_layers=config.n_core,
            num_core_slots=num_core_slots,
        )

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def max_steps(self) -> int:
        """Core iterations that have a slot of their own."""
        return self.num_core_slots // self.num_core_layers

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def prelude_slot(self, layer: int) -> int:
        return layer

    def core_slot(self, iteration, layer: int):
        """Slot of Core layer `layer` at iteration `iteration` (an int or a traced int32)."""
        return self.num_prelude + iteration * self.num_core_layers + layer

    def coda_slot(self, layer: int) -> int:
        return self.num_prelude + self.num_core_slots + layer

    def write(self, slot, start, k_BxTxHxK: jax.Array, v_BxTxHxK: jax.Array) -> KVCache:
        """Stores T new positions' K/V at positions [start, start + T) of `slot`."""
        index = (slot, 0, start, 0, 0)
        k = jax.lax.dynamic_update_slice(self.k, k_BxTxHxK[None].astype(self.k.dtype), index)
        v = jax.lax.dynamic_update_slice(self.v, v_BxTxHxK[None].astype(self.v.dtype), index)
        return dataclasses.replace(self, k=k, v=v)

    def read(self, slot) -> tuple[jax.Array, jax.Array]:
        """K and V of one slot, each [B, S, H, K]."""
        k = jax.lax.dynamic_index_in_dim(self.k, slot, axis=0, keepdims=False)
        v = jax.lax.dynamic_index_in_dim(self.v, slot, axis=0, keepdims=False)
        return k, v
