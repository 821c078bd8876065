"""The Core's decode iteration as persistent Mosaic GPU kernels (Hopper).

`weight_stream`: the iteration's products in one launch, weights streamed without pause across
the grid barriers (`stream.py`); its schedule is `plan.py`, its plain-JAX reference
`reference.py` (and `pad_inputs`, the same products padded to wider weight tiles).
"""

from pallas_kernels.core_step.plan import Phase, core_phases, stream_bytes
from pallas_kernels.core_step.reference import pad_inputs, weight_stream_reference
from pallas_kernels.core_step.stream import weight_stream

__all__ = [
    "Phase",
    "core_phases",
    "pad_inputs",
    "stream_bytes",
    "weight_stream",
    "weight_stream_reference",
]
