"""Fingerprints of the fused Core kernel as Mosaic GPU compiles it, to check that a change of its
Python leaves the kernel the same (a refactor): no GPU needed.

    python3 tools/kernel_fingerprint.py [NAME...] > before.txt   # at one commit
    python3 tools/kernel_fingerprint.py [NAME...] > after.txt    # at the next
    diff before.txt after.txt

Per configuration (the default schedule at huginn-0125's shapes at batch 1 and 8, the
second warpgroup, the timing bound without some barriers, grid barriers without hand-overs
with L2 prefetches, blocks of 128 positions, prefetches at the barriers, one grid barrier per
iteration with the second warpgroup at batch 1 and without it at batch 8, two-head attention
items at batch 8): the kernel lowered for sm_90 (`fused_step.lowered_for_hopper`), its Mosaic
GPU module printed without source locations, then that text's length and SHA-256. Lines
moved between files change no fingerprint; an operation added, removed or reordered changes
its configuration's. The names of global semaphores count up over the kernels traced in one
process, so compare runs of the same NAMEs (all by default), not lines of runs that traced
different configurations.
"""

from __future__ import annotations

import hashlib
import sys

from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax.experimental.mosaic.gpu import dialect as mosaic_gpu_dialect

from pallas_kernels.core_step.fused_plan import FusedShape, Schedule
from pallas_kernels.core_step.fused_step import lowered_for_hopper

HUGINN = (5280, 55, 96, 17920)  # n_embd, heads, head_dim, MLP width
SMALL = (512, 8, 64, 1024)
OVERLAP = Schedule(3, 2, overlap=1)  # the second warpgroup
DATAFLOW = Schedule(3, 2, overlap=1, dataflow=1)  # and one grid barrier per iteration
CONFIGURATIONS = {  # name: (shape, cached positions per slot, kernel options)
    "default_b1": (FusedShape(*HUGINN, 1, 1), 1024, dict(workers=132)),
    "default_b8_2_layers": (FusedShape(*HUGINN, 2, 8), 1024, dict(workers=132)),
    "overlap_b8": (FusedShape(*HUGINN, 1, 8), 1024, dict(workers=132, schedule=OVERLAP)),
    "skip_barriers": (
        FusedShape(*HUGINN, 1, 1), 256, dict(workers=132, skip_barriers=("proj", "attn"))
    ),
    "grid_barriers_l2": (
        FusedShape(*HUGINN, 1, 1), 256,
        dict(workers=132, schedule=Schedule(2, 2, l2_units=1, l2_blocks=2, handover=0)),
    ),
    "kv_block_128": (
        FusedShape(*SMALL, 2, 1, 64), 256, dict(workers=16, schedule=Schedule(2, 2, kv_block=128))
    ),
    "l2_at_barriers": (
        FusedShape(*SMALL, 2, 1, 64), 128,
        dict(workers=16, schedule=Schedule(2, 2, l2_barrier=1, l2_attention=1)),
    ),
    "dataflow_b1_2_layers": (FusedShape(*HUGINN, 2, 1), 1024, dict(workers=132, schedule=DATAFLOW)),
    "dataflow_b8": (
        FusedShape(*HUGINN, 1, 8), 1024, dict(workers=132, schedule=Schedule(3, 3, dataflow=1))
    ),
    "head_pairs_b8": (
        FusedShape(*HUGINN, 1, 8), 1024, dict(workers=132, schedule=Schedule(3, 2, head_pairs=1))
    ),
}  # fmt: skip


def mosaic_modules(lowered) -> str:
    """The Mosaic GPU modules of a lowered computation's custom calls, printed without
    locations."""
    texts = []

    def visit(op):
        if op.operation.name == "stablehlo.custom_call":
            config = ir.DictAttr(op.operation.attributes["mhlo.backend_config"])
            data = ir.StringAttr(config["module"]).value_bytes
            context = mlir.make_ir_context()
            mosaic_gpu_dialect.register_dialect(context)
            context.allow_unregistered_dialects = True  # the module's stable_mosaic_gpu ops
            with context:
                module = ir.Module.parse(data)
                texts.append(module.operation.get_asm(enable_debug_info=False))
        return ir.WalkResult.ADVANCE

    lowered.compiler_ir().operation.walk(visit)
    return "\n".join(texts)


def main(names: list[str]) -> None:
    """Fingerprints of the configurations named (all where none is)."""
    if unknown := set(names) - set(CONFIGURATIONS):
        known = ", ".join(CONFIGURATIONS)
        sys.exit(f"kernel_fingerprint: unknown {', '.join(sorted(unknown))}; known: {known}")
    for name in names or CONFIGURATIONS:
        shape, positions, options = CONFIGURATIONS[name]
        text = mosaic_modules(lowered_for_hopper(shape, 2, positions, **options))
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        print(f"{name:20s} {len(text):9d} {digest}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
