"""The fused Core decode kernel's plan (pallas_kernels/core_step/fused_plan.py, fused_fit.py) on
CPU: schedules as written and parsed, the workers' unit ranges and the tile counters' signals,
how many workers and which schedules fit, and the profiler's records."""

from __future__ import annotations

import statistics

import pytest

from huginn_jax.config import HuginnConfig
from huginn_jax.persistent import fused_shape
from pallas_kernels.core_step.fused import build_fused_core
from pallas_kernels.core_step.fused_counters import counter_waits
from pallas_kernels.core_step.fused_fit import (
    PROFILE_RANGE_BYTES,
    check_fused,
    most_workers,
    profile_ranges,
    scratch_types,
    smem_bytes,
)
from pallas_kernels.core_step.fused_plan import (
    FusedShape,
    Schedule,
    attention_items,
    attention_tile_heads,
    counter_signals,
    tile_signals,
    unit_ranges,
)
from pallas_kernels.smem import SMEM_LIMIT

SMALL = (512, 8, 768, 2)  # d, heads (of 64), MLP width, layers: 16 workers, 2 splits per head
HUGINN = (5280, 55, 17920, 4)
OVERLAP = Schedule(3, 2, overlap=1)  # the attention's blocks in a second warpgroup


def test_only_one_worker_holds_the_tile_its_adds_go_through():
    """Workers that add by TMA reduce-add hold no tile for a read-add-write (one worker's,
    `KernelContext.add_into`): 6 KiB and a barrier less, which lets a ring of 4 beside 3
    stages of blocks fit at huginn-0125, batch 8."""
    shape = FusedShape(5280, 55, 96, 17920, 4, 8)
    many, one = (scratch_types(shape, Schedule(4, 3), 2, w)[0] for w in (132, 1))
    assert set(one) - set(many) == {"pin", "pbar"}
    assert (
        smem_bytes(shape, Schedule(4, 3), 2, 1)
        == smem_bytes(shape, Schedule(4, 3), 2, 132) + 6144 + 8
    )
    check_fused(shape, 132, Schedule(4, 3))
    with pytest.raises(ValueError, match="bytes of smem"):
        check_fused(shape, 1, Schedule(4, 3))


def test_overlap_needs_both_warpgroups_buffers_and_one_item_per_worker():
    """`Schedule.overlap` at huginn-0125: 3:2 fits, 3:3 does not (both warpgroups' buffers at
    once); 110 attention items fit on 132 workers, 55 not on 50; no interpret mode."""
    shape = FusedShape(5280, 55, 96, 17920, 4, 1)
    check_fused(shape, 132, OVERLAP)
    assert smem_bytes(shape, OVERLAP, 2, 132) > smem_bytes(shape, Schedule(3, 2), 2, 132)
    with pytest.raises(ValueError, match="bytes of smem"):
        check_fused(shape, 132, Schedule(3, 3, overlap=1))
    with pytest.raises(ValueError, match="one attention item per worker"):
        check_fused(shape, 50, OVERLAP)
    with pytest.raises(ValueError, match="GPU only"):
        build_fused_core(shape, 1, workers=1, eps=1e-6, schedule=OVERLAP, interpret=True)


def test_fewer_value_blocks_let_a_third_key_block_beside_the_second_warpgroup():
    """`Schedule.value_stages`: each stage of value blocks is a [64, 128] bf16 block and its
    barrier, so two value stages beside three key stages take one block less than 3:3; at
    huginn-0125, batch 1, that fits beside the second warpgroup, where 3:3 does not. 0 value
    stages mean as many as key stages; 1 is refused."""
    shape = FusedShape(5280, 55, 96, 17920, 4, 1)
    three_two = Schedule(3, 3, overlap=1, dataflow=1, value_stages=2)
    assert three_two.stages_of_values == 2 and Schedule(3, 3).stages_of_values == 3
    three = Schedule(3, 3, overlap=1, dataflow=1)
    assert (
        smem_bytes(shape, three, 2, 132) - smem_bytes(shape, three_two, 2, 132) == 64 * 128 * 2 + 8
    )
    check_fused(shape, 132, three_two)
    with pytest.raises(ValueError, match="bytes of smem"):
        check_fused(shape, 132, three)
    blocks = scratch_types(shape, three_two, 2, 132)[3]
    assert blocks["kblk"].shape[0] == 3 and blocks["vblk"].shape[0] == 2
    assert (blocks["kbar"].num_barriers, blocks["vbar"].num_barriers) == ((3,), (2,))
    assert smem_bytes(shape, Schedule(3, 3, value_stages=3), 2, 132) == smem_bytes(
        shape, Schedule(3, 3), 2, 132
    )
    with pytest.raises(ValueError, match="value_stages=1 must be 0 or in"):
        check_fused(shape, 132, Schedule(3, 3, value_stages=1))


@pytest.mark.parametrize("dims,workers", [(HUGINN, 132), (SMALL, 16)])
def test_overlap_takes_q_tiles_first_and_every_unit_once(dims, workers):
    """`unit_ranges` with overlap: in a qkv every worker's first range lies in q's tiles, the
    first ranges cover them and the second ranges the rest, every unit once; other products
    are one even share, as without overlap."""
    d, heads, f, layers = dims
    shape = FusedShape(d, heads, d // heads, f, layers, 1, 64 if dims == SMALL else 256)
    for phase in shape.phases:
        taken = []
        for w in range(workers):
            ranges = unit_ranges(shape, phase, w, workers, True)
            taken.append([list(range(a, a + n)) for a, n in ranges])
            if not phase.name.startswith("qkv"):
                assert ranges == unit_ranges(shape, phase, w, workers, False)
        units = sorted(u for ranges in taken for r in ranges for u in r)
        assert units == list(range(phase.units(shape.unit_cols)))
        if phase.name.startswith("qkv"):
            in_q = shape.q_tiles * phase.k_chunks
            assert shape.q_tiles * shape.unit_cols >= d > (shape.q_tiles - 1) * shape.unit_cols
            assert sorted(u for ranges in taken for u in ranges[0]) == list(range(in_q))


@pytest.mark.parametrize("cols,workers", [(256, 132), (256, 7), (64, 16), (128, 132)])
def test_tile_signals_count_the_workers_and_residual_chunks_of_each_tile(cols, workers):
    """Every tile of huginn-0125's proj and MLP proj (and of a small shape's) expects as many
    signals as workers own units of it (their ranges, as the kernel splits the units) plus
    the residual's chunks in it; without a residual, the workers only."""
    for shape in (FusedShape(5280, 55, 96, 17920, 1, 1, cols), FusedShape(256, 4, 64, 688, 1, 1)):
        for phase in shape.phases[2:5:2]:  # proj, mlp proj
            if phase.units(cols) < workers:
                continue
            units, kch, chunks = phase.units(cols), phase.k_chunks, shape.k_d // 64
            ranges = [
                range(units * w // workers, units * (w + 1) // workers) for w in range(workers)
            ]
            for t in range(phase.tiles(cols)):
                tile = range(t * kch, (t + 1) * kch)
                owners = sum(1 for r in ranges if r.start < tile.stop and tile.start < r.stop)
                residual = sum(1 for c in range(chunks) if c * 64 // cols == t)
                assert int(tile_signals(phase, cols, workers, chunks, t)) == owners + residual
                assert int(tile_signals(phase, cols, workers, 0, t)) == owners


@pytest.mark.parametrize("group", [1, 2, 4, 7])
def test_counter_signals_are_the_sums_of_their_tiles(group):
    """A counter of `group` tiles (`Schedule.counter_tiles`) expects its tiles' signals, the
    last counter those of the tiles left: every signal is expected once."""
    shape = FusedShape(5280, 55, 96, 17920, 1, 1, 256)
    for phase in shape.phases:
        tiles, chunks = phase.tiles(256), shape.k_d // 64
        per_tile = [int(tile_signals(phase, 256, 132, chunks, t)) for t in range(tiles)]
        counters = -(-tiles // group)
        got = [int(counter_signals(phase, 256, 132, chunks, g, group)) for g in range(counters)]
        assert got == [sum(per_tile[g * group : (g + 1) * group]) for g in range(counters)]
        assert sum(got) == sum(per_tile)


@pytest.mark.parametrize("cols,ring,waits", [(256, 3, [244, 140, 88]), (128, 6, [932, 500, 292])])
def test_counters_of_more_tiles_take_fewer_waits(cols, ring, waits):
    """huginn-0125's batch-1 default with one grid barrier per iteration: a worker's median
    waits on the tile counters per iteration with 1, 2 and 4 tiles per counter."""
    shape = fused_shape(HuginnConfig(5280, 55, 17920, 65536), 1, cols)
    got = []
    for tiles in (1, 2, 4):
        schedule = Schedule(ring, 2, overlap=1, dataflow=1, counter_tiles=tiles)
        got.append(statistics.median(counter_waits(shape, 132, schedule)))
    assert got == waits


@pytest.mark.parametrize("dims,workers", [(HUGINN, 132), (SMALL, 16)])
def test_tile_signals_of_a_qkv_split_in_two_ranges(dims, workers):
    """With overlap a qkv's units are shared out as two ranges (`unit_ranges`): every tile
    expects one signal from each worker whose ranges meet it."""
    d, heads, f, layers = dims
    cols = 64 if dims == SMALL else 256
    shape = FusedShape(d, heads, d // heads, f, layers, 1, cols)
    phase, kch = shape.phases[1], shape.phases[1].k_chunks
    ranges = [unit_ranges(shape, phase, w, workers, True) for w in range(workers)]
    split_at = shape.q_tiles * kch
    for t in range(phase.tiles(cols)):
        tile = range(t * kch, (t + 1) * kch)
        owners = sum(
            1 for pieces in ranges if any(a < tile.stop and tile.start < a + n for a, n in pieces)
        )
        assert int(tile_signals(phase, cols, workers, 0, t, split_at)) == owners


@pytest.mark.parametrize("dims,cols", [(HUGINN, 256), (HUGINN, 128), (SMALL, 64), (HUGINN, 64)])
def test_attention_tile_heads_are_the_windows_that_meet_each_tile(dims, cols):
    """The adds that complete a tile of the attention output: the heads whose kp-row value
    windows (`head_window`) meet it, counted one by one."""
    d, heads, f, layers = dims
    shape = FusedShape(d, heads, d // heads, f, layers, 1, cols)
    starts = [shape.head_window(h)[0] for h in range(heads)]
    for t in range(-(-shape.k_d // cols)):
        meet = sum(1 for c0 in starts if c0 < cols * (t + 1) and c0 + shape.kp > cols * t)
        assert int(attention_tile_heads(shape, cols, t)) == meet


def test_most_workers_is_what_check_fused_allows():
    """The `small` preset (D 256, 4 heads of 64, MLP width 688 padded to 704, 4 layers) in
    [64, 128] units: adapter 4 x 2, per layer qkv 4 x 6, proj 4 x 2, fc 4 x 11, mlp proj 11 x 2.
    Every worker must own more of each than a ring of 6: 8 // 7 workers. Past the most,
    check_fused says how many fit; a ring of 8 leaves not even one."""
    shape = fused_shape(HuginnConfig.from_name("small"), 1, 128)
    units = [p.units(128) for p in shape.phases]
    assert units == [4 * 2] + [4 * 6, 4 * 2, 4 * 11, 11 * 2] * 4
    six = Schedule(ring=6)
    most = min(units) // (six.ring + six.l2_units + 1)
    assert most_workers(shape, six) == most == 1
    check_fused(shape, most, six)
    with pytest.raises(ValueError, match=rf"with {most + 1} workers: .*\({most} workers at most"):
        check_fused(shape, most + 1, six)
    assert most_workers(shape, Schedule(ring=8)) == 0
    with pytest.raises(ValueError, match="not even one worker fits"):
        check_fused(shape, 1, Schedule(ring=8))


@pytest.mark.parametrize("batch", [1, 8])
def test_most_workers_keeps_every_sm_of_an_h200_for_huginn_0125(batch):
    """huginn-0125's fewest units are the adapter's and each proj's (83 row chunks by 21 column
    tiles of 256): far more workers than an H200's 132 SMs fit the default schedule."""
    shape = fused_shape(HuginnConfig.from_name("huginn_0125"), batch)
    most = most_workers(shape, Schedule())
    assert most == 83 * 21 // 4 and most >= 132
    check_fused(shape, most, Schedule())
    with pytest.raises(ValueError, match="L2 lookahead"):
        check_fused(shape, most + 1, Schedule())


def test_schedule_is_written_as_parsed():
    assert Schedule.parse("3:2:0:0:64:0:0:8:1") == OVERLAP
    assert str(OVERLAP) == "3:2:0:0:64:0:0:8:1"
    assert Schedule.parse("6:3") == Schedule(6, 3, 0, 0)
    assert str(Schedule.parse("6:3:16:8")) == "6:3:16:8"
    assert str(Schedule(6, 3, 16, 0)) == "6:3:16" and str(Schedule(6, 3, 0, 8)) == "6:3:0:8"
    assert Schedule.parse("4:2:0:0:128") == Schedule(4, 2, kv_block=128)
    assert str(Schedule(4, 2, kv_block=128)) == "4:2:0:0:128"
    assert str(Schedule.parse("6:3:0:0:64")) == "6:3"
    assert Schedule.parse("6:3:0:0:64:4:16") == Schedule(6, 3, l2_barrier=4, l2_attention=16)
    assert str(Schedule(6, 3, l2_attention=16)) == "6:3:0:0:64:0:16"
    assert Schedule.parse("3:3:0:0:64:0:0:0") == Schedule(3, 3, handover=0)
    assert Schedule.parse("3:2:0:0:64:0:0:8:1:1") == Schedule(3, 2, overlap=1, dataflow=1)
    assert str(Schedule(3, 3, dataflow=1)) == "3:3:0:0:64:0:0:8:0:1"
    assert str(Schedule(3, 3, handover=0)) == "3:3:0:0:64:0:0:0"
    assert Schedule.parse("3:2:0:0:64:0:0:8:0:0:1") == Schedule(3, 2, head_pairs=1)
    assert str(Schedule(3, 2, head_pairs=1)) == "3:2:0:0:64:0:0:8:0:0:1"
    assert Schedule.parse("3:2:0:0:64:0:0:8:1:1:0:0") == Schedule(
        3, 2, overlap=1, dataflow=1, lag=0
    )
    assert str(Schedule(3, 3, lag=0)) == "3:3:0:0:64:0:0:8:0:0:0:0"
    default_b1 = dict(ring=3, kv_stages=2, overlap=1, dataflow=1)  # the model's at batch 1
    for text, fields in [
        ("3:2:0:0:64:0:0:8:1:1:0:1:1", dict(default_b1, late_inputs=1)),
        ("3:2:0:0:64:0:0:8:1:1:0:1:0:4", dict(default_b1, counter_tiles=4)),
        ("3:3:0:0:64:0:0:8:1:1:0:1:0:1:2", dict(default_b1, kv_stages=3, value_stages=2)),
        ("3:2:0:0:64:0:0:8:1:1:0:1:0:1:0:10", dict(default_b1, l2_keep=10)),
        ("3:2:0:0:64:0:0:8:1:1:0:1:0:1:0:0:1", dict(default_b1, known_complete=1)),
    ]:
        assert Schedule.parse(text) == Schedule(**fields)
        assert str(Schedule(**fields)) == text
    for bad in ("6", "6:3:1:2:64:4:5:6:1:1:1:0:1:4:2:7:1:9", "6:x"):
        with pytest.raises(ValueError, match="is not RING:KV_STAGES"):
            Schedule.parse(bad)
    with pytest.raises(ValueError, match="kv_block=96 must be one of"):
        Schedule.parse("6:3:0:0:96")


def test_profiler_records_each_attention_item_parts():
    """Room for every step's range and its barrier's two, and the parts of each of a worker's
    items: one item each with 110 of 132 workers busy, four with 16 workers (55 heads, one
    split)."""
    four_layers = FusedShape(5280, 55, 96, 17920, 4, 1)
    per_step = 3 * four_layers.steps_per_iteration
    assert profile_ranges(four_layers, 132, 8, Schedule(3, 3)) == 8 * (per_step + 3 * 4) + 8
    assert profile_ranges(four_layers, 16, 8, Schedule(3, 3)) == 8 * (per_step + 3 * 4 * 4) + 8


def test_profiler_records_the_waits_of_one_barrier_per_iteration():
    """With `Schedule.dataflow`, room for three waits per product (17 at four layers) and one
    per attention item; the schedule without the second warpgroup is profiled at 8
    iterations."""
    four_layers = FusedShape(5280, 55, 96, 17920, 4, 1)
    extra = 8 * (3 * len(four_layers.phases) + 1 * 4)
    plain = profile_ranges(four_layers, 132, 8, Schedule(3, 3))
    assert profile_ranges(four_layers, 132, 8, Schedule(3, 3, dataflow=1)) == plain + extra
    check_fused(four_layers, 132, Schedule(3, 3, dataflow=1), profiled_iterations=8)


def test_profiler_records_both_warpgroups_of_the_default():
    """With `Schedule.overlap`, each warpgroup's records take shared memory: room per
    warpgroup for the first's ranges and each qkv's wait for the second's partials (more than
    the second's own, 5 per layer), twice; the model's batch-1 default (3:2, two warpgroups,
    one grid barrier per iteration) fits a profile of 3 iterations at huginn-0125, not 4 (which
    one warpgroup's records would leave room for)."""
    four_layers = FusedShape(5280, 55, 96, 17920, 4, 1)
    default = Schedule(3, 2, overlap=1, dataflow=1)
    dataflow = profile_ranges(four_layers, 132, 2, Schedule(3, 2, dataflow=1))
    assert profile_ranges(four_layers, 132, 2, default) == dataflow + 2 * 4
    one_layer = FusedShape(5280, 55, 96, 17920, 1, 1)  # 6 steps, one item's 3 parts, 1 wait
    assert profile_ranges(one_layer, 132, 1, Schedule(3, 2, overlap=1)) == 3 * 6 + 3 + 1 + 8
    check_fused(four_layers, 132, default, profiled_iterations=3)
    four = profile_ranges(four_layers, 132, 4, default)
    one_warpgroup = smem_bytes(four_layers, default, 2, 132) + PROFILE_RANGE_BYTES * four
    assert one_warpgroup <= SMEM_LIMIT
    with pytest.raises(ValueError, match="for the profiler's records of 4 iterations"):
        check_fused(four_layers, 132, default, profiled_iterations=4)


PAIRS = Schedule(3, 2, head_pairs=1)  # two-head items


def test_two_head_windows_hold_each_head_once_in_whole_tiles():
    """huginn-0125's 55 heads of 96 in 28 pair windows of 192 columns, the last (ending at d)
    holding heads 53 and 54; each head's value rows in a 128-column slice of its window
    (`value_window`), heads 0 to 53 where their own windows of 128 start or 32 columns
    before, head 54 where its own does (d - 128); slices and windows in tiles of 32."""
    shape = FusedShape(5280, 55, 96, 17920, 4, 8)
    assert shape.pairs == 28 and shape.pair_cols == 192 and shape.operand_tile(True) == 32
    assert [shape.pair_window(p) for p in (0, 1, 26, 27)] == [0, 192, 4992, 5088]
    assert shape.value_window(0, True) == (0, 0) == shape.head_window(0)
    assert shape.value_window(1, True) == (64, 32)  # the window's last 128 of 192
    assert shape.value_window(53, True) == (4992 + 64, 32)
    assert shape.value_window(54, True) == (5152, 32) == shape.head_window(54)
    for h in range(shape.heads):
        c0, delta = shape.value_window(h, True)
        first = shape.pair_window(h // 2)
        assert first <= c0 and c0 + shape.kp <= first + shape.pair_cols
        assert c0 + delta == 96 * h and 0 <= delta <= shape.kp - shape.head_dim
        assert c0 % 32 == 0 and first % 32 == 0
    small = FusedShape(512, 8, 64, 1024, 1, 8)  # heads of 64: slices of 64 at 0 and 64
    assert small.value_window(3, True) == (192, 0) and small.operand_tile(True) == 64


def test_two_head_items_split_each_window_four_ways_at_most():
    """28 windows x 4 splits = 112 items on 132 workers (55 heads x 2 without pairs); on a
    small shape with many workers the pair windows stop at 4 splits, the heads do not."""
    huginn = FusedShape(5280, 55, 96, 17920, 4, 8)
    assert attention_items(huginn, 132, True) == (112, 4)
    assert attention_items(huginn, 132, False) == (110, 2)
    small = FusedShape(512, 8, 64, 1024, 1, 8)
    assert attention_items(small, 132, True) == (16, 4)
    assert attention_items(small, 132, False) == (128, 16)


def test_two_head_items_fit_at_batch_8_beside_a_ring_of_3():
    """Pair blocks of 192 + 192 columns: 3:2 fits at huginn-0125 (two stages of pair blocks
    hold more bytes than three of 96 + 128), 3:3 does not, 3 stages of key blocks beside 2 of
    value blocks do (the tile of zeros in the products' scope, not the blocks'); neither
    overlap nor dataflow, nor heads whose windows are not whole tiles of 32 columns."""
    shape = FusedShape(5280, 55, 96, 17920, 4, 8)
    check_fused(shape, 132, PAIRS)
    check_fused(shape, 132, PAIRS, profiled_iterations=2)
    with pytest.raises(ValueError, match="bytes of smem"):
        check_fused(shape, 132, Schedule(3, 3, head_pairs=1))
    check_fused(shape, 132, Schedule(3, 3, head_pairs=1, value_stages=2))
    kernel_wide, product, *_ = scratch_types(shape, PAIRS, 2, 132)
    assert "zero" in product and "zero" not in kernel_wide
    for other in (dict(overlap=1), dict(dataflow=1)):
        with pytest.raises(ValueError, match="without overlap and dataflow"):
            check_fused(shape, 132, Schedule(3, 2, head_pairs=1, **other))
    with pytest.raises(ValueError, match="a multiple of 32"):
        check_fused(FusedShape(96, 4, 24, 160, 1, 8, 64), 1, Schedule(2, 2, head_pairs=1))
