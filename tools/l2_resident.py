"""Whether a weight stream can keep part of its weights in L2 from one pass to the next, and what
that saves: the case of a persistent kernel that reads the same weights at every iteration.

    python3 tools/l2_resident.py [--mib=512] [--resident_mib=0,16,32,48] \
        [--persisting_mib=0,48] [--reps=20] [--json_out=PATH]

W of `mib` MiB, as [64, 256] bf16 units, is read by the TMA probe (`pallas_kernels.tma_read`:
one worker per SM, 4 units in flight each, nothing done with them), `reps` passes back to back
(CUPTI device time of a pass, median). Each worker marks the first units of its share, about
`resident_mib` MiB over all workers (0 always among them), to be evicted from L2 last as they
land (`pallas_kernels.l2.mark_in_l2`: `prefetch.global.L2::evict_last`). Where the marked lines
outlive the rest of a pass, the next pass reads them from L2: its time drops by about their
share of W, up to "if all kept" (the marked bytes / W). Before each case one pass gives every
unit that any case marks L2's normal priority back, so that no case inherits another's marks.
`persisting_mib`: the L2 set-aside for persisting lines (the driver's
cuCtxSetLimit(CU_LIMIT_PERSISTING_L2_CACHE_SIZE), 0 its default), set before the cases that
follow it, since the hardware may keep lines marked evict_last only within it; the limit the
driver took is read back and printed. "saved" is against no marked units at the same
set-aside. Rates in TB/s of W's bytes per pass.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import sys

import jax
import jax.numpy as jnp

from experiments.measure.device_time import cupti_us

COLS, RING = 256, 4  # the persistent kernels' [64, 256] weight units, 128 KiB in flight per SM
UNIT_BYTES = 64 * COLS * 2
CU_LIMIT_PERSISTING_L2_CACHE_SIZE = 0x06  # CUlimit, cuda.h


def set_persisting_l2(nbytes: int) -> int:
    """The primary context's L2 set-aside for persisting lines, set to `nbytes` through the CUDA
    driver (the context JAX runs in); returns what the driver reads back (it may clamp)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    device, context = ctypes.c_int(), ctypes.c_void_p()
    for call in (
        lambda: cuda.cuDeviceGet(ctypes.byref(device), 0),
        lambda: cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device),
        lambda: cuda.cuCtxPushCurrent_v2(context),
    ):
        if rc := call():
            raise RuntimeError(f"CUDA driver error {rc} before setting the persisting L2 limit")
    limit = ctypes.c_size_t()
    try:
        if rc := cuda.cuCtxSetLimit(CU_LIMIT_PERSISTING_L2_CACHE_SIZE, ctypes.c_size_t(nbytes)):
            raise RuntimeError(f"cuCtxSetLimit(persisting L2, {nbytes}) failed: CUDA error {rc}")
        cuda.cuCtxGetLimit(ctypes.byref(limit), CU_LIMIT_PERSISTING_L2_CACHE_SIZE)
    finally:
        cuda.cuCtxPopCurrent_v2(ctypes.byref(context))
    return limit.value


def resident_per_worker(mib: float, workers: int) -> int:
    """Units each worker marks so that about `mib` MiB are marked over all workers."""
    return math.floor(mib * 2**20 / UNIT_BYTES / workers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=512, help="W's size, MiB (several x L2)")
    parser.add_argument("--resident_mib", default="0,16,32,48", help="MiB marked per pass")
    parser.add_argument("--persisting_mib", default="0,48", help="L2 set-asides, in turn")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json_out", default="")
    args = parser.parse_args()
    device = jax.devices()[0]
    capability = float(getattr(device, "compute_capability", None) or 0)
    if device.platform != "gpu" or capability < 9.0:
        raise SystemExit(f"l2_resident: needs a Hopper GPU (TMA); the device is {device}")
    from pallas_kernels.tma_read import check_read, tma_read

    workers = device.core_count
    units = int(args.mib * 2**20) // UNIT_BYTES
    marks = sorted(
        {0} | {resident_per_worker(float(m), workers) for m in args.resident_mib.split(",")}
    )
    for r in marks:
        check_read(units, COLS, workers, RING, r)  # before any pass
    w = jax.random.normal(jax.random.key(0), (units, 64, COLS), jnp.bfloat16)
    nbytes = w.nbytes
    print(f"device {device.device_kind}, {workers} SMs; W {nbytes / 2**20:.0f} MiB in [64, {COLS}]")
    print("set-aside MiB  marked MiB  us/pass   TB/s   saved  if all kept")
    rows = []
    unmark = jax.jit(
        lambda w: tma_read(
            w, workers=workers, ring=RING, resident=marks[-1], priority="evict_normal"
        )
    )
    for persisting in (float(p) for p in args.persisting_mib.split(",")):
        taken = set_persisting_l2(int(persisting * 2**20))
        base = None
        for r in marks:
            fn = jax.jit(lambda w, r=r: tma_read(w, workers=workers, ring=RING, resident=r))
            jax.block_until_ready(unmark(w))
            us, _, note = cupti_us(fn, args.reps, w)
            if us is None:
                raise SystemExit(f"l2_resident: no device time ({note})")
            base = us if r == 0 else base  # marks start at 0
            marked = r * workers * UNIT_BYTES
            saved = 1 - us / base
            row = dict(
                persisting_bytes=taken, marked_bytes=marked, units_per_worker=r, us=us,
                tbps=nbytes / us / 1e6, saved=saved, bound=marked / nbytes, w_bytes=nbytes,
            )  # fmt: skip
            rows.append(row)
            print(
                f"{taken / 2**20:13.1f}  {marked / 2**20:10.1f}  {us:7.1f}  {row['tbps']:5.2f}"
                f"  {100 * saved:5.1f}%  {100 * row['bound']:10.1f}%"
            )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(
                dict(argv=sys.argv, device=device.device_kind, workers=workers, rows=rows),
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
