"""Preallocated KV cache with one slot per block application, updated in place.

Shared Core weights do not mean shared KV: Core layer j at iteration i has its own entry. The cache
is a plain pytree of two arrays

    k, v: [L, B, S, H, K]   L slots, B batch, S max positions, H heads, K head_dim

with the slots laid out as [prelude layers | Core slots | coda layers]. Writes are
`dynamic_update_slice`s at (slot, 0, start); under `jit` with the cache donated XLA performs them in
place, so the history is never copied or re-concatenated.

Strategies (the reference's `lookup_strategy`), i.e. which Core slot (iteration i, layer j) uses,
with P prelude layers and C Core layers:

| strategy      | Core slots | slot of (i, j)      | what a later token t reads at step i      |
| ------------- | ---------- | ------------------- | ----------------------------------------- |
| `full`        | C · steps  | P + C·i + j         | entry (i, j) (t must have run step i)     |
| `latest-m4`   | C · steps  | P + C·i + j         | entry (min(i, n_t − 1), j); n_t: t's steps |
| `compress-sN` | N          | P + (C·i + j) mod N | whatever was written last into that slot  |

`latest-m4` is what adaptive exits need: a token that exited after n_t < steps iterations gets its
slots for iterations n_t..steps−1 filled with copies of its last iteration's entries
(`fill_after_exit`), so "the newest entry of the same layer at a step no later than the current
one" (the reference's lookup) is simply entry (i, j). The reference hard-codes C = 4 ("m4");
here it is the model's Core depth.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np

from huginn_jax import parallel
from huginn_jax.config import HuginnConfig

UNLIMITED_STEPS = 2**31 - 1  # compress-sN reuses its slots, so any step count fits
_COMPRESS = re.compile(r"compress-s([0-9]+)")


def parse_strategy(strategy: str) -> int | None:
    """Validates a strategy name; returns N for `compress-sN`, else None. Raises ValueError."""
    if strategy in ("full", "latest-m4"):
        return None
    match = _COMPRESS.fullmatch(strategy)
    if match is None or int(match.group(1)) < 1:
        raise ValueError(
            f"unknown cache strategy {strategy!r}; known: 'full', 'latest-m4', 'compress-sN' "
            "(N >= 1 Core slots reused cyclically, e.g. 'compress-s4')"
        )
    return int(match.group(1))


def _num_core_slots(config: HuginnConfig, num_steps: int, strategy: str) -> int:
    compress = parse_strategy(strategy)
    return compress if compress is not None else num_steps * config.n_core


def _shape(config: HuginnConfig, batch: int, max_len: int, num_core_slots: int) -> tuple:
    """[L, B, S, H, K] with L = prelude slots + Core slots + coda slots; H = the heads the layers
    hold (n_heads, padded to a multiple of the mesh's "model" axis under a mesh)."""
    slots = config.n_layers_in_prelude + num_core_slots + config.n_layers_in_coda
    return (slots, batch, max_len, config.attention_heads, config.head_dim)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: jax.Array  # [L, B, S, H, K]
    v: jax.Array  # [L, B, S, H, K]
    num_prelude: int = dataclasses.field(metadata=dict(static=True))
    num_core_layers: int = dataclasses.field(metadata=dict(static=True))
    num_core_slots: int = dataclasses.field(metadata=dict(static=True))
    strategy: str = dataclasses.field(default="full", metadata=dict(static=True))
    # Positions `read` returns: the first read_len of each slot (0: all max_len). Static, so a
    # step compiled for a window reads only that prefix of the preallocated cache.
    read_len: int = dataclasses.field(default=0, metadata=dict(static=True))

    @classmethod
    def create(
        cls,
        config: HuginnConfig,
        *,
        batch: int,
        max_len: int,
        num_steps: int,
        dtype=jnp.float32,
        strategy: str = "full",
    ) -> KVCache:
        """A zeroed cache: a slot per prelude layer, the strategy's Core slots, a slot per coda
        layer. `num_steps` is the most Core iterations a token may run (ignored by compress-sN).
        Under a mesh (config.mesh) the cache is split by heads over its "model" axis."""
        if max_len > config.block_size:
            raise ValueError(
                f"max_len={max_len} exceeds the model's block_size={config.block_size}"
            )
        if batch < 1 or max_len < 1 or num_steps < 1:
            raise ValueError(f"{batch=}, {max_len=} and {num_steps=} must be positive")
        num_core_slots = _num_core_slots(config, num_steps, strategy)
        shape = _shape(config, batch, max_len, num_core_slots)
        sharding = parallel.kv_cache_sharding(config)
        return cls(
            k=jnp.zeros(shape, dtype, device=sharding),
            v=jnp.zeros(shape, dtype, device=sharding),
            num_prelude=config.n_layers_in_prelude,
            num_core_layers=config.n_core,
            num_core_slots=num_core_slots,
            strategy=strategy,
        )

    @staticmethod
    def bytes_needed(
        config: HuginnConfig,
        *,
        batch: int,
        max_len: int,
        num_steps: int,
        dtype=jnp.float32,
        strategy: str = "full",
    ) -> int:
        """What `create` would allocate, in bytes (K and V), without allocating it."""
        shape = _shape(config, batch, max_len, _num_core_slots(config, num_steps, strategy))
        return 2 * math.prod(shape) * jnp.dtype(dtype).itemsize

    @property
    def compressed(self) -> bool:
        return self.strategy.startswith("compress-")

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def max_steps(self) -> int:
        """Core iterations a token may run: those with a slot of their own (any for compress)."""
        if self.compressed:
            return UNLIMITED_STEPS
        return self.num_core_slots // self.num_core_layers

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def prelude_slot(self, layer: int) -> int:
        return layer

    def core_slot(self, iteration, layer: int):
        """Slot of Core layer `layer` at iteration `iteration` (an int or a traced int32 array)."""
        index = iteration * self.num_core_layers + layer
        if self.compressed:
            index = index % self.num_core_slots
        return self.num_prelude + index

    def coda_slot(self, layer: int) -> int:
        return self.num_prelude + self.num_core_slots + layer

    def slot_table(self, num_steps: int) -> np.ndarray:
        """[num_steps, C] int: the Core slot of every (iteration, layer), for inspection."""
        return np.array(
            [[self.core_slot(i, j) for j in range(self.num_core_layers)] for i in range(num_steps)]
        )

    def write(self, slot, start, k_BxTxHxK: jax.Array, v_BxTxHxK: jax.Array) -> KVCache:
        """Stores T new positions' K/V at positions [start, start + T) of `slot`."""
        index = (slot, 0, start, 0, 0)
        k = jax.lax.dynamic_update_slice(self.k, k_BxTxHxK[None].astype(self.k.dtype), index)
        v = jax.lax.dynamic_update_slice(self.v, v_BxTxHxK[None].astype(self.v.dtype), index)
        return dataclasses.replace(self, k=k, v=v)

    def read(self, slot) -> tuple[jax.Array, jax.Array]:
        """K and V of one slot, each [B, S, H, K]: S = read_len positions, or all of them."""
        k = jax.lax.dynamic_index_in_dim(self.k, slot, axis=0, keepdims=False)
        v = jax.lax.dynamic_index_in_dim(self.v, slot, axis=0, keepdims=False)
        if self.read_len:
            k, v = (jax.lax.slice_in_dim(x, 0, self.read_len, axis=1) for x in (k, v))
        return k, v

    def with_read_len(self, read_len: int) -> KVCache:
        """The same arrays, read over positions [0, read_len) (0 or max_len: all of them)."""
        if not 0 <= read_len <= self.max_len:
            raise ValueError(f"read_len={read_len} must be in [0, max_len={self.max_len}]")
        return dataclasses.replace(self, read_len=0 if read_len == self.max_len else read_len)

    def core_positions(self, start, length: int) -> tuple[jax.Array, jax.Array]:
        """K and V of positions [start, start + length) in every Core slot, each [C, B, T, H, K]
        with C = num_core_slots."""
        _, b, _, h, d = self.k.shape
        index = (self.num_prelude, 0, start, 0, 0)
        size = (self.num_core_slots, b, length, h, d)
        k = jax.lax.dynamic_slice(self.k, index, size)
        return k, jax.lax.dynamic_slice(self.v, index, size)

    def write_core_positions(self, start, k_CxBxTxHxK: jax.Array, v_CxBxTxHxK: jax.Array):
        """Stores what `core_positions` returns back at positions [start, start + T)."""
        index = (self.num_prelude, 0, start, 0, 0)
        k = jax.lax.dynamic_update_slice(self.k, k_CxBxTxHxK.astype(self.k.dtype), index)
        v = jax.lax.dynamic_update_slice(self.v, v_CxBxTxHxK.astype(self.v.dtype), index)
        return dataclasses.replace(self, k=k, v=v)

    def fill_after_exit(self, steps_B: jax.Array, start, length: int) -> KVCache:
        """latest-m4 bookkeeping after an adaptive step on positions [start, start + length).

        Sequence b ran steps_B[b] >= 1 iterations; its slots for iterations
        steps_B[b]..max_steps-1 receive copies of its last iteration's entries, per Core layer.
        Afterwards attention at any step i reads, for these positions, their newest entry of the
        same layer at an iteration <= i, exactly the reference's `latest-m4` lookup. Writes
        2 · T · H · K elements per filled (sequence, iteration, layer) and never reads what it
        overwrites (a read-modify-write of the cache in a loop makes XLA copy the whole cache).
        """
        if self.compressed:
            raise ValueError(f"fill_after_exit needs a full-layout cache, not {self.strategy!r}")
        _, batch, _, h, d = self.k.shape
        last_B = jnp.maximum(steps_B - 1, 0).astype(jnp.int32)
        layers = range(self.num_core_layers)

        def gather_last(arr_LxBxSxHxK, layer):
            # Row b's entries at its own last iteration: a per-row slot index, i.e. a gather.
            def one(arr_LxSxHxK, slot):
                return jax.lax.dynamic_slice(arr_LxSxHxK, (slot, start, 0, 0), (1, length, h, d))

            return jax.vmap(one, in_axes=(1, 0), out_axes=1)(
                arr_LxBxSxHxK, self.core_slot(last_B, layer)
            )

        src_k = [gather_last(self.k, j) for j in layers]  # each [1, B, T, H, K]
        src_v = [gather_last(self.v, j) for j in layers]
        cache = self
        for b in range(batch):

            def body(iteration, cache, b=b):
                k, v = cache.k, cache.v
                for j in layers:
                    index = (cache.core_slot(iteration, j), b, start, 0, 0)
                    k = jax.lax.dynamic_update_slice(k, src_k[j][:, b : b + 1], index)
                    v = jax.lax.dynamic_update_slice(v, src_v[j][:, b : b + 1], index)
                return dataclasses.replace(cache, k=k, v=v)

            cache = jax.lax.fori_loop(steps_B[b].astype(jnp.int32), self.max_steps, body, cache)
        return cache
