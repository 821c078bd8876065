"""Shared memory of one block on sm_90, as the kernels of this package count it."""

SMEM_LIMIT = 232_448  # opt-in dynamic shared memory per block (227 KiB, Mosaic GPU's bound)
SMEM_ALIGN = 1024  # Pallas aligns every scratch buffer to 1 KiB (swizzled TMA tiles need it)


def aligned(nbytes: int) -> int:
    """A scratch buffer's shared memory: `nbytes` rounded up to `SMEM_ALIGN`."""
    return -(-nbytes // SMEM_ALIGN) * SMEM_ALIGN
