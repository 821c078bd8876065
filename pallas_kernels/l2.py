"""L2 cache priorities from inside a Mosaic GPU kernel (Hopper): `mark_in_l2` gives a unit of
global memory L2's evict_last priority, so that lines a kernel will read again outlive the
stream of other lines through L2, or gives it back the normal priority."""

from __future__ import annotations

import math

from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

L2_LINE = 128  # bytes of an L2 cache line
WARPGROUP = 128  # threads that share a unit's lines
L2_PRIORITIES = ("evict_last", "evict_normal")  # what `mark_in_l2` gives a line


def check_priority(priority: str) -> None:
    """ValueError unless `priority` is one that `mark_in_l2` gives (`L2_PRIORITIES`)."""
    if priority not in L2_PRIORITIES:
        raise ValueError(f"priority={priority!r} is not one of {L2_PRIORITIES}")


def mark_in_l2(unit, priority: str = "evict_last") -> None:
    """Gives the lines of `unit` (a contiguous ref in global memory, whole lines) L2's eviction
    `priority`: the warpgroup's threads take its lines in turn, each prefetching its own with
    `prefetch.global.L2::<priority>` (PTX, sm_80 and later), which leaves the line in L2 with
    that priority; "evict_last" lines are evicted after all others. Only on a GPU (no
    interpret mode)."""
    check_priority(priority)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def mark(ctx, ref):
        del ctx
        i64 = ir.IntegerType.get_signless(64)
        ty = ir.MemRefType(ref.type)
        lines = math.prod(ty.shape) * mgpu.utils.bitwidth(ty.element_type) // 8 // L2_LINE
        base = llvm.ptrtoint(i64, mgpu.utils.memref_ptr(ref))
        thread = arith.extui(i64, mgpu.utils.thread_idx())
        lane = arith.remui(thread, mgpu.utils.c(WARPGROUP, i64))
        for r in range(-(-lines // WARPGROUP)):
            line = arith.addi(lane, mgpu.utils.c(r * WARPGROUP, i64))
            addr = arith.addi(base, arith.muli(line, mgpu.utils.c(L2_LINE, i64)))
            inside = None  # every thread has a line in this round
            if (r + 1) * WARPGROUP > lines:
                inside = arith.cmpi(arith.CmpIPredicate.ult, line, mgpu.utils.c(lines, i64))
            mgpu.utils.inline_ptx(
                f"prefetch.global.L2::{priority} [$0];", addr, predicate=inside,
                has_side_effects=True,
            )  # fmt: skip

    mark(unit)
