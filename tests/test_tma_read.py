"""The TMA read probe (pallas_kernels/tma_read.py): each worker's share of the units copied in
order, in GPU interpret mode on CPU and on a GPU; what it refuses; lowering for sm_90 with
every SM of an H200, with units marked in L2 (tools/l2_resident.py) and without; and the
ceilings probe built from it (experiments.measure.probes)."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from experiments.measure import probes
from pallas_kernels.tma_read import build_tma_read, check_read, last_units, tma_read
from tools.l2_resident import UNIT_BYTES, resident_per_worker

ON_GPU = jax.devices()[0].platform == "gpu"


def units_of(count: int, cols: int) -> jax.Array:
    return jax.random.normal(jax.random.key(0), (count, 64, cols), jnp.bfloat16)


def test_interpret_each_worker_ends_on_its_last_unit():
    """11 units over 3 workers (3, 4 and 4: the last units 2, 6 and 10), 2 in flight."""
    w = units_of(11, 128)
    got = tma_read(w, workers=3, ring=2, interpret=plgpu.InterpretGPUParams())
    assert last_units(11, 3) == [2, 6, 10]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(w)[[2, 6, 10]])


def test_interpret_leaves_out_the_l2_marks():
    """The marks are PTX prefetches, which interpret mode does not run: the same units come
    back with them as without."""
    w = units_of(11, 128)
    got = tma_read(w, workers=3, ring=2, resident=3, interpret=plgpu.InterpretGPUParams())
    np.testing.assert_array_equal(np.asarray(got), np.asarray(w)[[2, 6, 10]])


@pytest.mark.parametrize(
    "units,cols,workers,ring,resident,match",
    [
        (10, 96, 2, 2, 0, "multiple of 64"),
        (10, 128, 2, 0, 0, "ring=0"),
        (10, 128, 4, 3, 0, "at least ring=3"),
        (100, 256, 2, 8, 0, "bytes >"),
        (10, 128, 2, 2, 6, "resident=6"),
        (10, 128, 2, 2, -1, "must be >= 0"),
    ],
)
def test_refuses_what_it_cannot_run(units, cols, workers, ring, resident, match):
    with pytest.raises(ValueError, match=match):
        check_read(units, cols, workers, ring, resident)
    with pytest.raises(ValueError, match="must be \\[units, 64, cols\\] bf16"):
        tma_read(jnp.zeros((4, 32, 128), jnp.bfloat16), workers=1, ring=1)


@pytest.mark.parametrize(
    "resident,priority", [(0, "evict_last"), (8, "evict_last"), (8, "evict_normal")]
)
def test_lowers_for_cuda_with_every_sm(resident, priority):
    """2 GiB of [64, 256] units over 132 workers, 4 in flight each (the ceilings' probe), and
    with each worker's first 8 units given an L2 priority: the PTX prefetch is in the kernel
    only then."""
    units = 2**31 // (64 * 256 * 2)
    f = build_tma_read(units, 256, workers=132, ring=4, resident=resident, priority=priority)
    shape = jax.ShapeDtypeStruct((units, 64, 256), jnp.bfloat16)
    text = jax.jit(f).trace(shape).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    assert (f"prefetch.global.L2::{priority}" in text) == bool(resident)
    with pytest.raises(ValueError, match="priority='evict_first' is not one of"):
        build_tma_read(units, 256, workers=132, ring=4, resident=8, priority="evict_first")


def test_l2_resident_marks_about_the_asked_bytes():
    """tools/l2_resident.py: 48 MiB over 132 SMs is 11 [64, 256] units each (46.4 MiB)."""
    assert UNIT_BYTES == 32768
    assert resident_per_worker(48, 132) == 11
    assert resident_per_worker(0, 132) == 0


def test_ceilings_probe_only_on_a_hopper_gpu(monkeypatch):
    """On this CPU no probe; on a (pretend) sm_90 GPU of 4 SMs one over W's bytes; none on an
    older GPU or where W is not whole [64, 256] units."""
    w = jnp.zeros((64, 4 * 256), jnp.bfloat16)
    if not ON_GPU:
        assert probes.tma_probe(w) is None
        assert [p.name for p in probes.read_probes(w)] == ["gemv", "sum", "copy"]

    def pretend(capability):
        device = types.SimpleNamespace(platform="gpu", compute_capability=capability, core_count=4)
        monkeypatch.setattr(jax, "devices", lambda: [device])

    pretend("9.0")
    probe = probes.tma_probe(w, ring=1)
    assert (probe.name, probe.nbytes, probe.read_only) == ("tma", w.nbytes, True)
    assert "[64, 256] units, 1 per SM in flight by TMA, 4 SMs" in probe.what
    assert probes.tma_probe(jnp.zeros((64, 100), jnp.bfloat16)) is None
    pretend("8.0")
    assert probes.tma_probe(w) is None


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (Mosaic GPU, sm_90)")
def test_every_sm_ends_on_its_last_unit_gpu():
    """2,000 units of [64, 256] over every SM, 4 in flight each."""
    workers = jax.devices()[0].core_count
    w = units_of(2000, 256)
    got = tma_read(w, workers=workers, ring=4)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(w)[last_units(2000, workers)])


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (Mosaic GPU, sm_90)")
@pytest.mark.parametrize("priority", ["evict_last", "evict_normal"])
def test_l2_marks_assemble_and_leave_the_units_as_they_are_gpu(priority):
    """The PTX prefetches of `l2.mark_in_l2` assemble and run: the same last units come back."""
    workers = jax.devices()[0].core_count
    w = units_of(2000, 256)
    got = tma_read(w, workers=workers, ring=4, resident=5, priority=priority)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(w)[last_units(2000, workers)])
