"""The Core's decode iteration as persistent Mosaic GPU kernels (Hopper).

`weight_stream`: the iteration's products in one launch, weights streamed without pause across
the grid barriers (`stream.py`); its schedule is `plan.py`, its plain-JAX reference
`reference.py` (and `pad_inputs`, the same products padded to wider weight tiles).
`core_iteration`: the plain-JAX specification of the whole fused iteration, as the steps between
its grid barriers (`step_program.py`).
The whole iteration in one kernel: `fused_step.fused_core_decode` over `pack_weights`' packed
weights (the kernel's steps and barriers `fused.py`, its products `fused_products.py` and their
weight ring `fused_ring.py`, its attention step `fused_attention.py` and the attention's cached
blocks `fused_blocks.py`, what each product reads `fused_inputs.py`, its layout `fused_plan.py`,
its shared memory and what fits `fused_fit.py`, register tiles `tiles.py`).
"""

from pallas_kernels.core_step.plan import Phase, core_phases, stream_bytes
from pallas_kernels.core_step.reference import pad_inputs, weight_stream_reference
from pallas_kernels.core_step.step_program import (
    LayerWeights,
    Pending,
    StepWeights,
    barriers_per_iteration,
    core_iteration,
    embedded_part,
    rope_row,
    step_names,
)
from pallas_kernels.core_step.stream import weight_stream

__all__ = [
    "LayerWeights",
    "Pending",
    "Phase",
    "StepWeights",
    "barriers_per_iteration",
    "core_iteration",
    "core_phases",
    "embedded_part",
    "pad_inputs",
    "rope_row",
    "step_names",
    "stream_bytes",
    "weight_stream",
    "weight_stream_reference",
]
