"""What the fused Core decode kernel (`fused.py`) needs of each SM: its shared memory, as the
kernel-wide buffers and those of the step scopes that reuse the same bytes in turn
(`scratch_types`, `smem_bytes`), and the checks that a shape and schedule can run
(`check_fused`, `most_workers`)."""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.core_step.fused_plan import (
    MAX_PAIR_SPLITS,
    N_PAD,
    SCALAR_ROWS,
    SHIFT,
    FusedShape,
    Schedule,
    attention_items,
)
from pallas_kernels.core_step.plan import UNIT
from pallas_kernels.core_step.stream import MAX_RING, SWIZZLE_128
from pallas_kernels.smem import SMEM_LIMIT, aligned

REDUCTION_SCRATCH = 2048  # bytes Mosaic GPU adds for reductions across warps
# Splits' partials a head's combine copies in at once (more go in waves): both of huginn-0125's
# splits with the second warpgroup, whose combine merges every split's from global memory
MERGE_BUFFERS = 2
PROFILE_RANGE_BYTES = 16  # shared memory per range of Mosaic GPU's on-device profiler
SCOPES = ("product", "rope", "blocks", "combine")  # the step scopes of `scratch_types`
# With `Schedule.overlap`, the scopes each warpgroup enters, held at once as a union each
# (`union_layout`): a kernel of two warpgroups enters a scope with both or not at all
WARPGROUP_SCOPES = {"first": ("product", "rope", "combine"), "second": ("rope", "blocks")}


def smem_bytes(shape: FusedShape, schedule: Schedule, x_stages: int, workers: int) -> int:
    """Shared memory of one block of `workers`, from `scratch_types`: the kernel-wide buffers,
    then the largest of the step scopes (they reuse the same bytes one after the other), each
    buffer aligned to 1 KiB as Pallas allocates them, 8 bytes per mbarrier. With
    `Schedule.overlap` the two warpgroups' scopes (`WARPGROUP_SCOPES`) and reductions take
    bytes of their own, at once."""
    groups = scratch_types(shape, schedule, x_stages, workers)

    def buffer_bytes(types: dict) -> int:
        sizes = [
            math.prod(t.shape) * jnp.dtype(t.dtype).itemsize
            for t in types.values()
            if not isinstance(t, plgpu.Barrier)
        ]
        return sum(aligned(b) for b in sizes)

    def barrier_count(types: dict) -> int:
        return sum(
            math.prod(t.num_barriers) for t in types.values() if isinstance(t, plgpu.Barrier)
        )

    barriers = sum(barrier_count(types) for types in groups)
    scopes = max(buffer_bytes(types) for types in groups[1:])
    if schedule.overlap:  # each warpgroup's scopes in a union of its own, both at once
        named = dict(zip(SCOPES, groups[1:], strict=True))
        second = second_warpgroup_types(shape)
        scopes = buffer_bytes(second) + sum(
            max(buffer_bytes(named[g]) for g in names) for names in WARPGROUP_SCOPES.values()
        )
        barriers = barrier_count(groups[0]) + barrier_count(second)
        barriers += sum(  # each union's barriers, as `union_layout` lays them out
            barrier_count(named[g]) for names in WARPGROUP_SCOPES.values() for g in names
        )
    reductions = 2 if schedule.overlap else 1  # each warpgroup's reductions take bytes of their own
    return buffer_bytes(groups[0]) + scopes + reductions * REDUCTION_SCRATCH + 8 * barriers


def most_workers(shape: FusedShape, schedule: Schedule) -> int:
    """The most workers `check_fused` lets `schedule` run `shape` on (0 where not even one):
    each worker must own more units of every product than the ring and its furthest L2
    prefetch reach (ring + `Schedule.l2_reach`). Of a product's u
    units the fewest a worker owns among w is u // w, which stays above that reach for every w
    up to u // (reach + 1)."""
    reach = schedule.ring + schedule.l2_reach
    return min(p.units(shape.unit_cols) // (reach + 1) for p in shape.phases)


ATTENTION_PARTS = ("rope", "blocks", "combine")  # the attention step's profiled parts
# `Schedule.dataflow`'s profiled waits: per product (named kind_part, qkv_inputs, ...), the
# owners' chunks at its start, its first units' inputs and the norms' scalars; per attention
# item, its head's tiles
DATAFLOW_PRODUCT_PARTS = ("own", "inputs", "wait_owned")
DATAFLOW_ITEM_PARTS = ("wait_head",)
# With `Schedule.overlap`, the second warpgroup's ranges per layer (`blocks_ahead`): the
# item's, and its wait for q, RoPE, blocks and partials out
SECOND_WARPGROUP_PARTS = ("ahead", "wait_q", "rope", "blocks", "partials_out")


def profile_ranges(shape: FusedShape, workers: int, iterations: int, schedule: Schedule) -> int:
    """Ranges the on-device profiler keeps room for, per warpgroup: each step's, each barrier's
    twice (as a barrier and by the kind of step it follows), the parts (`ATTENTION_PARTS`) of
    each of a worker's attention items (two-head items with `Schedule.head_pairs`), with
    `Schedule.dataflow` the waits on counters (`DATAFLOW_PRODUCT_PARTS`, `DATAFLOW_ITEM_PARTS`),
    with `Schedule.overlap` each qkv's wait for the second warpgroup's partials (whose own
    ranges, `SECOND_WARPGROUP_PARTS` per layer, are fewer), and a few more."""
    items = -(-attention_items(shape, workers, bool(schedule.head_pairs))[0] // workers)
    item_parts = len(ATTENTION_PARTS) + (len(DATAFLOW_ITEM_PARTS) if schedule.dataflow else 0)
    per_iteration = 3 * shape.steps_per_iteration + item_parts * items * shape.layers
    if schedule.dataflow:
        per_iteration += len(DATAFLOW_PRODUCT_PARTS) * len(shape.phases)
    if schedule.overlap:
        per_iteration += shape.layers  # wait_parts
        per_iteration = max(per_iteration, len(SECOND_WARPGROUP_PARTS) * shape.layers)
    return iterations * per_iteration + 8


def check_fused(
    shape: FusedShape,
    workers: int,
    schedule: Schedule,
    x_stages: int = 2,
    profiled_iterations: int = 0,
) -> None:
    """ValueError unless the schedule can run (as `stream.check_schedule`): a ring longer than
    the wgmma lag, the ring and the L2 lookahead shorter than every worker's units of each
    product (the lookahead reaches into the next product only), so at least 1 and at most
    `most_workers` workers, at least 2 stages of cached key blocks and of value blocks, no
    more adapter units kept in L2 than a worker copies after the ring's depth, buffers that
    fit (with the profiler's records of `profiled_iterations`, where it runs: each
    warpgroup's; with `Schedule.overlap`, both warpgroups' buffers at once, one attention item
    per worker)."""
    ring, kv_stages, lag = schedule.ring, schedule.kv_stages, schedule.lag
    if not 1 <= ring <= MAX_RING or not 0 <= lag < ring or not 1 <= x_stages <= ring:
        raise ValueError(f"need 0 <= lag={lag} < ring={ring} <= {MAX_RING}, x_stages <= ring")
    if not 2 <= kv_stages <= MAX_RING:
        raise ValueError(f"kv_stages={kv_stages} must be in [2, {MAX_RING}]")
    if not 2 <= schedule.stages_of_values <= MAX_RING:
        raise ValueError(f"value_stages={schedule.value_stages} must be 0 or in [2, {MAX_RING}]")
    if min(schedule.l2_units, schedule.l2_barrier, schedule.l2_attention) < 0:
        raise ValueError(f"schedule {schedule}: the L2 prefetches must be >= 0")
    if schedule.handover < 0:
        raise ValueError(f"schedule {schedule}: handover must be >= 0")
    if schedule.counter_tiles < 1:
        raise ValueError(f"schedule {schedule}: counter_tiles must be >= 1")
    for flag in ("overlap", "dataflow", "head_pairs", "late_inputs", "known_complete"):
        if getattr(schedule, flag) not in (0, 1):
            raise ValueError(f"schedule {schedule}: {flag} must be 0 or 1")
    if schedule.known_complete and not (schedule.overlap and schedule.dataflow):
        raise ValueError(
            f"schedule {schedule}: known_complete leaves out waits of one grid barrier per "
            f"iteration (dataflow) that the second warpgroup (overlap) has made"
        )
    if schedule.head_pairs and (schedule.overlap or schedule.dataflow):
        raise ValueError(f"schedule {schedule}: two-head items run without overlap and dataflow")
    if schedule.head_pairs and (unfit := shape.pairs_unfit()):
        raise ValueError(f"schedule {schedule}: {unfit}")
    items = attention_items(shape, workers, bool(schedule.head_pairs))[0]
    if schedule.overlap and items > workers:
        raise ValueError(
            f"schedule {schedule}: overlap runs one attention item per worker, not {items} on "
            f"{workers} workers"
        )
    if workers < 1:
        raise ValueError(f"workers={workers} must be at least 1")
    most = most_workers(shape, schedule)
    if workers > most:
        fewest = min(p.units(shape.unit_cols) // workers for p in shape.phases)
        fits = f"{most} workers at most fit" if most else "not even one worker fits"
        raise ValueError(
            f"a worker owns {fewest} units of some product with {workers} workers: the ring "
            f"({ring}) and the L2 lookahead ({schedule.l2_reach}) must be shorter ({fits})"
        )
    adapter_units = shape.phases[0].units(shape.unit_cols) // workers
    if not 0 <= schedule.l2_keep <= adapter_units - ring:
        raise ValueError(
            f"schedule {schedule}: l2_keep must be in [0, {adapter_units - ring}], the adapter "
            f"units a worker copies after the ring's depth"
        )
    need = smem_bytes(shape, schedule, x_stages, workers)
    if need > SMEM_LIMIT:
        raise ValueError(f"schedule {schedule}: {need} bytes of smem > {SMEM_LIMIT}")
    if profiled_iterations:
        ranges = profile_ranges(shape, workers, profiled_iterations, schedule)
        profiler = PROFILE_RANGE_BYTES * ranges * (2 if schedule.overlap else 1)  # per warpgroup
        if need + profiler > SMEM_LIMIT:
            raise ValueError(
                f"schedule {schedule}: {need} bytes of smem and {profiler} for the profiler's "
                f"records of {profiled_iterations} iterations > {SMEM_LIMIT}"
            )


def scratch_types(shape: FusedShape, schedule: Schedule, x_stages: int, workers: int):
    """The kernel's shared memory and barriers, by name, as five dicts: the kernel-wide ones
    (the weight ring, scalar tiles; with one worker, which has no TMA reduce-add, the tile its
    adds read and write back through, `KernelContext.add_into`), then those of four scopes
    that take the same bytes in turn: a product's (with the tile of zeros that the zeroing
    copies read, `fused_zeros.Zeros`), the attention's RoPE (its windows and tables), its
    blocks and its combine (`smem_bytes` counts them). With `Schedule.head_pairs` the
    attention's windows, tables and blocks are a pair window's."""
    pairs = bool(schedule.head_pairs)
    attention = attention_transforms(shape, pairs)
    bf16, f32, cols = jnp.bfloat16, jnp.float32, shape.unit_cols
    ring, kv_stages, kv_block = schedule.ring, schedule.kv_stages, schedule.kv_block
    value_stages = schedule.stages_of_values
    kp, chunk = shape.kp, (UNIT, N_PAD)
    rows = shape.pair_cols if pairs else kp  # of a window, its tables and its q
    key_cols, value_cols = (rows, rows) if pairs else (shape.key_cols, kp)
    win = rows + 2 * SHIFT
    kernel_wide = dict(
        ring=plgpu.SMEM((ring, UNIT, cols), bf16, transforms=SWIZZLE_128),
        wbar=plgpu.Barrier(num_barriers=ring),
        sc=plgpu.SMEM((2, *chunk), f32),
        scbar=plgpu.Barrier(),
    )
    if workers == 1:
        kernel_wide |= dict(pin=plgpu.SMEM((kp + SCALAR_ROWS, N_PAD), f32), pbar=plgpu.Barrier())
    product = dict(
        zero=plgpu.SMEM(chunk, f32),  # written at each product's start (`fused_zeros.Zeros`)
        xa=plgpu.SMEM((x_stages, 2 * UNIT, N_PAD), f32),  # 2 chunks: the MLP's gate and up
        xbb=plgpu.SMEM((x_stages, *chunk), f32),
        xg=plgpu.SMEM((x_stages, *chunk), f32),
        bara=plgpu.Barrier(num_barriers=x_stages),
        barb=plgpu.Barrier(num_barriers=x_stages),
        barg=plgpu.Barrier(num_barriers=x_stages),
        bt=plgpu.SMEM((schedule.lag + 1, N_PAD, UNIT), bf16, transforms=SWIZZLE_128),
        out=plgpu.SMEM((cols, N_PAD), f32),
        vst=plgpu.SMEM(chunk, f32),
        sst=plgpu.SMEM(chunk, f32),
        rx=plgpu.SMEM((2, *chunk), f32),
        rbar=plgpu.Barrier(num_arrivals=2),
        rsum=plgpu.SMEM(chunk, f32),
    )
    rope = dict(
        win=plgpu.SMEM((3, win, N_PAD), f32),
        tab=plgpu.SMEM((5, rows, N_PAD), f32),
        abar=plgpu.Barrier(num_arrivals=5),
    )
    blocks = dict(
        kblk=plgpu.SMEM((kv_stages, kv_block, key_cols), bf16, transforms=attention),
        vblk=plgpu.SMEM((value_stages, kv_block, value_cols), bf16, transforms=attention),
        kbar=plgpu.Barrier(num_barriers=kv_stages),
        vbar=plgpu.Barrier(num_barriers=value_stages),
        btq=plgpu.SMEM((N_PAD, rows), bf16, transforms=attention),
        pb=plgpu.SMEM((N_PAD, kv_block), bf16, transforms=attention),
    )
    merging = MAX_PAIR_SPLITS - 1 if pairs else MERGE_BUFFERS  # other splits' partials at once
    combine = dict(
        pout=plgpu.SMEM((kp + SCALAR_ROWS, N_PAD), f32),  # partials, the head's rows
        krow=plgpu.SMEM((N_PAD, rows), bf16, transforms=attention),  # new k rows, transposed
        vrow=plgpu.SMEM((N_PAD, kp), bf16, transforms=attention),  # new v rows, transposed
        pins=plgpu.SMEM((merging, kp + SCALAR_ROWS, N_PAD), f32),
        pinbar=plgpu.Barrier(num_barriers=merging),
    )
    return kernel_wide, product, rope, blocks, combine


def second_warpgroup_types(shape: FusedShape) -> dict:
    """What the second warpgroup of `Schedule.overlap` has besides its RoPE's and blocks'
    scopes: its own scalar tiles and partials buffer, and the barrier it tells the first
    warpgroup on that its item's partials are out."""
    f32 = jnp.float32
    return dict(
        sc=plgpu.SMEM((2, SCALAR_ROWS, N_PAD), f32),
        scbar=plgpu.Barrier(),
        pin=plgpu.SMEM((shape.kp + SCALAR_ROWS, N_PAD), f32),
        parts_ready=plgpu.Barrier(),
    )


def attention_transforms(shape: FusedShape, head_pairs: bool = False) -> tuple:
    """The shared-memory tiling and swizzle of the attention's wgmma operands (a wgmma's
    operands share a swizzle): tiles of `FusedShape.operand_tile` bf16 columns, 128 bytes
    (64 columns), 64 bytes (32, huginn-0125: head_dim 96) or 32 (16: the kernel needs
    multiples of 16)."""
    cols = shape.operand_tile(head_pairs)
    return plgpu.TilingTransform((8, cols)), plgpu.SwizzleTransform(2 * cols)


def union_layout(prefix: str, groups: dict) -> dict:
    """Scratch entries for scopes that run at once with another warpgroup's (`Schedule.overlap`;
    a multithreaded kernel cannot enter a scope in one warpgroup alone): `prefix`, a union of
    the groups' buffers, in order, and each group's barriers as "prefix.group.name"."""

    def buffers(types):
        return {n: t for n, t in types.items() if not isinstance(t, plgpu.Barrier)}

    out = {prefix: plgpu.RefUnion(*(buffers(types) for types in groups.values()))}
    for group, types in groups.items():
        for name, t in types.items():
            if isinstance(t, plgpu.Barrier):
                out[f"{prefix}.{group}.{name}"] = t
    return out


def scoped(types: dict, fn):
    """fn(refs) inside a scope that holds the buffers and barriers of `types` (a dict of
    scratch types, as `scratch_types` gives) by name; returns what fn returns."""
    names = tuple(types)
    return pl.run_scoped(lambda *refs: fn(dict(zip(names, refs, strict=True))), *types.values())
