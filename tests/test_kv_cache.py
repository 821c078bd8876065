"""KV cache strategies: slot mapping, sizes, and the latest-m4 fill after an adaptive exit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from huginn_jax.config import HuginnConfig
from huginn_jax.kv_cache import KVCache, parse_strategy

MICRO = HuginnConfig.from_name("micro")  # 2 prelude, 4 Core, 2 coda layers


def test_full_slot_mapping_is_one_slot_per_iteration_and_layer():
    cache = KVCache.create(MICRO, batch=1, max_len=4, num_steps=3)
    assert cache.strategy == "full"  # the default, as before strategies existed
    assert cache.k.shape[0] == 2 + 3 * 4 + 2
    np.testing.assert_array_equal(
        cache.slot_table(3), [[2, 3, 4, 5], [6, 7, 8, 9], [10, 11, 12, 13]]
    )
    assert [cache.coda_slot(j) for j in range(2)] == [14, 15]
    assert cache.max_steps == 3
    latest = KVCache.create(MICRO, batch=1, max_len=4, num_steps=3, strategy="latest-m4")
    np.testing.assert_array_equal(latest.slot_table(3), cache.slot_table(3))


@pytest.mark.parametrize(
    "strategy, table",
    [
        # the reference: slot (idx - 2) mod N + 2 with idx = 2 + 4 i + j
        ("compress-s4", [[2, 3, 4, 5]] * 3),
        ("compress-s6", [[2, 3, 4, 5], [6, 7, 2, 3], [4, 5, 6, 7]]),
        ("compress-s1", [[2, 2, 2, 2]] * 3),
    ],
)
def test_compress_slot_mapping_reuses_n_slots_cyclically(strategy, table):
    cache = KVCache.create(MICRO, batch=1, max_len=4, num_steps=32, strategy=strategy)
    n = parse_strategy(strategy)
    assert cache.k.shape[0] == 2 + n + 2
    np.testing.assert_array_equal(cache.slot_table(3), table)
    assert [cache.coda_slot(j) for j in range(2)] == [2 + n, 3 + n]
    assert cache.max_steps >= 10**9  # any step count fits
    # traced iterations map the same way
    traced = jax.jit(lambda i: jnp.stack([cache.core_slot(i, j) for j in range(4)]))
    np.testing.assert_array_equal(traced(jnp.int32(2)), table[2])


@pytest.mark.parametrize("bad", ["", "compress", "compress-s0", "compress-r4", "latest", "Full"])
def test_unknown_strategy_fails_clearly(bad):
    with pytest.raises(ValueError, match="unknown cache strategy"):
        KVCache.create(MICRO, batch=1, max_len=4, num_steps=2, strategy=bad)


def test_bytes_match_allocation_and_the_huginn_0125_figure():
    for strategy in ("full", "compress-s4"):
        cache = KVCache.create(MICRO, batch=2, max_len=8, num_steps=3, strategy=strategy)
        kwargs = dict(batch=2, max_len=8, num_steps=3, strategy=strategy)
        assert KVCache.bytes_needed(MICRO, **kwargs) == cache.nbytes
    big = HuginnConfig.from_name("huginn_0125")
    full = KVCache.bytes_needed(big, batch=1, max_len=4096, num_steps=32, dtype=jnp.bfloat16)
    assert full == 132 * 2 * 55 * 96 * 2 * 4096  # 2.79 MB per token (HUGINN.md)
    assert round(full / 1e9, 1) == 11.4
    s4 = KVCache.bytes_needed(
        big, batch=1, max_len=4096, num_steps=32, dtype=jnp.bfloat16, strategy="compress-s4"
    )
    assert s4 * 132 == full * 8


def _numbered_cache(batch, max_len, num_steps):
    """A full-layout cache whose every entry is distinct: value = 1000 slot + 100 b + position."""
    cache = KVCache.create(MICRO, batch=batch, max_len=max_len, num_steps=num_steps)
    slots, _, _, h, d = cache.k.shape
    value = (
        1000 * np.arange(slots)[:, None, None]
        + 100 * np.arange(batch)[None, :, None]
        + np.arange(max_len)[None, None, :]
    )
    k = np.broadcast_to(value[..., None, None], cache.k.shape).astype(np.float32)
    return KVCache(
        k=jnp.asarray(k),
        v=jnp.asarray(-k),
        num_prelude=cache.num_prelude,
        num_core_layers=cache.num_core_layers,
        num_core_slots=cache.num_core_slots,
        strategy="latest-m4",
    )


def test_fill_after_exit_copies_each_sequences_last_iteration_forward():
    cache = _numbered_cache(batch=2, max_len=6, num_steps=4)
    before = np.asarray(cache.k)
    # positions 2..3 of sequence 0 ran 1 iteration, of sequence 1 ran 3
    filled = jax.jit(lambda c, s: c.fill_after_exit(s, jnp.int32(2), 2))(
        cache, jnp.array([1, 3], jnp.int32)
    )
    k, v = np.asarray(filled.k), np.asarray(filled.v)
    np.testing.assert_array_equal(v, -k)
    expected = before.copy()
    for b, steps in enumerate([1, 3]):
        for i in range(steps, 4):
            for j in range(4):
                last = cache.core_slot(steps - 1, j)
                expected[cache.core_slot(i, j), b, 2:4] = before[last, b, 2:4]
    np.testing.assert_array_equal(k, expected)
    # what attention at step i now reads for those positions: layer j of min(i, steps - 1)
    for i in range(4):
        got = k[cache.core_slot(i, 1), :, 2, 0, 0]
        want = [before[cache.core_slot(min(i, s - 1), 1), b, 2, 0, 0] for b, s in enumerate([1, 3])]
        np.testing.assert_array_equal(got, want)
    # other positions, prelude and coda slots untouched
    untouched = np.ones(k.shape[2], bool)
    untouched[2:4] = False
    np.testing.assert_array_equal(k[:, :, untouched], before[:, :, untouched])


def test_fill_after_exit_needs_a_full_layout():
    cache = KVCache.create(MICRO, batch=1, max_len=4, num_steps=2, strategy="compress-s4")
    with pytest.raises(ValueError, match="full-layout"):
        cache.fill_after_exit(jnp.array([1]), 0, 1)


def test_core_positions_round_trip():
    cache = _numbered_cache(batch=2, max_len=6, num_steps=2)
    k, v = cache.core_positions(jnp.int32(3), 2)
    assert k.shape == (8, 2, 2, MICRO.n_heads, MICRO.head_dim)
    np.testing.assert_array_equal(k[:, 1, 0, 0, 0], 1000 * np.arange(2, 10) + 100 + 3)
    zeroed = cache.write_core_positions(jnp.int32(3), jnp.zeros_like(k), jnp.zeros_like(v))
    z = np.asarray(zeroed.k)
    assert not z[2:10, :, 3:5].any()
    np.testing.assert_array_equal(z[:, :, :3], np.asarray(cache.k)[:, :, :3])
    np.testing.assert_array_equal(z[:2], np.asarray(cache.k)[:2])
