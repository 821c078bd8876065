"""GPU smoke test of the looped matmul kernel: errors vs the reference and rough timings.

    python -m pallas_kernels.looped_matmul.smoke            # all cases, each in a subprocess
    python -m pallas_kernels.looped_matmul.smoke --case NAME  # one case in this process
    python -m pallas_kernels.looped_matmul.smoke --list

Every case runs in its own subprocess with a timeout, so that a hung grid barrier or a crash
in one case leaves the others running; its exception and traceback are printed. Timings:
median of `--reps` calls after warm-up (jax.block_until_ready, time.perf_counter), kernel vs
the jitted XLA chain (`looped_matmul_reference`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import time
import traceback
from typing import Any

CASES: dict[str, dict[str, Any]] = {
    # name: m, d, steps, optional config overrides (None = pick_config), stacked, barrier
    "minimal_d2048_s1": dict(m=1, d=2048, steps=1),
    "minimal_d256_s3_1block_nobarrier": dict(
        m=1, d=256, steps=3, cfg=dict(block_cols=256, block_k=64, resident_chunks=2)
    ),
    "d2048_m1_s2": dict(m=1, d=2048, steps=2),
    "d2048_m1_s8": dict(m=1, d=2048, steps=8),
    "d2048_m1_s8_allstream": dict(m=1, d=2048, steps=8, cfg=dict(resident_chunks=0)),
    "d6144_m1_s1": dict(m=1, d=6144, steps=1),
    "d6144_m1_s8": dict(m=1, d=6144, steps=8),
    "d6144_m1_s8_bk64": dict(
        m=1, d=6144, steps=8, cfg=dict(block_k=64, resident_chunks=16, stream_stages=8)
    ),
    "d6144_m1_s8_stages8": dict(m=1, d=6144, steps=8, cfg=dict(resident_chunks=4, stream_stages=8)),
    "d6144_m1_s8_lag2": dict(m=1, d=6144, steps=8, cfg=dict(wgmma_lag=2)),
    "d6144_m1_s8_lag3_bk64": dict(
        m=1, d=6144, steps=8, cfg=dict(block_k=64, resident_chunks=12, stream_stages=8, wgmma_lag=3)
    ),
    "d2048_m1_s32": dict(m=1, d=2048, steps=32),
    # deeper state ring: the state chunks of a step are issued right after the barrier
    "d2048_m1_s8_x16": dict(m=1, d=2048, steps=8, cfg=dict(x_stages=16, resident_chunks=4)),
    "d2048_m1_s8_x8": dict(m=1, d=2048, steps=8, cfg=dict(x_stages=8, resident_chunks=6)),
    "d2048_m1_s8_x16_lag3": dict(
        m=1, d=2048, steps=8, cfg=dict(x_stages=16, resident_chunks=4, wgmma_lag=3)
    ),
    "d3520_m1_s8_x32": dict(m=1, d=3520, steps=8, cfg=dict(x_stages=32, resident_chunks=15)),
    "d6144_m1_s8_x16": dict(m=1, d=6144, steps=8, cfg=dict(x_stages=16, resident_chunks=5)),
    "d6144_m1_s8_x16_lag3": dict(
        m=1, d=6144, steps=8, cfg=dict(x_stages=16, resident_chunks=5, wgmma_lag=3)
    ),
    "d6144_m8_s32": dict(m=8, d=6144, steps=32),
    # wider state / weight swizzle for small M (see LoopedMatmulConfig.min_n_pad)
    "d6144_m1_s8_npad32": dict(m=1, d=6144, steps=8, cfg=dict(min_n_pad=32, resident_chunks=7)),
    "d6144_m1_s8_npad64": dict(m=1, d=6144, steps=8, cfg=dict(min_n_pad=64, resident_chunks=5)),
    "d2048_m1_s8_npad64": dict(m=1, d=2048, steps=8, cfg=dict(min_n_pad=64, resident_chunks=5)),
    "d6144_m64_s8": dict(m=64, d=6144, steps=8),
    "d3520_m1_s8": dict(m=1, d=3520, steps=8),
    "d12288_m1_s8": dict(m=1, d=12288, steps=8),
    "copies_d2048_m1_s8": dict(m=1, d=2048, steps=8, stacked=True),
}


def run_case(name: str, reps: int) -> None:
    """Runs one case in this process and prints one result line (or raises)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.looped_matmul import (
        describe,
        looped_matmul,
        looped_matmul_copies,
        looped_matmul_copies_reference,
        looped_matmul_reference,
        pick_config,
    )

    spec = CASES[name]
    m, d, steps = spec["m"], spec["d"], spec["steps"]
    stacked = spec.get("stacked", False)
    cfg = pick_config(m, d, stacked=stacked)
    if "cfg" in spec:
        cfg = dataclasses.replace(cfg, **spec["cfg"])
    print(f"[{name}] M={m} d={d} steps={steps} stacked={stacked}: {describe(cfg, m, d)}")
    kx, kw = jax.random.split(jax.random.key(hash(name) % 2**31))
    x = jax.random.normal(kx, (m, d), jnp.float32).astype(jnp.bfloat16)
    wshape = (steps, d, d) if stacked else (d, d)
    w = (jax.random.normal(kw, wshape, jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16)
    if stacked:
        kern = lambda: looped_matmul_copies(x, w, config=cfg)  # noqa: E731
        ref = lambda: looped_matmul_copies_reference(x, w)  # noqa: E731
    else:
        kern = lambda: looped_matmul(x, w, steps, config=cfg)  # noqa: E731
        ref = lambda: looped_matmul_reference(x, w, steps)  # noqa: E731
    t0 = time.perf_counter()
    out = jax.block_until_ready(kern())
    t_first = time.perf_counter() - t0
    want = jax.block_until_ready(ref())
    o, r = np.asarray(out, np.float32), np.asarray(want, np.float32)
    rel = float(np.linalg.norm(o - r) / max(np.linalg.norm(r), 1e-30))
    print(
        f"[{name}] first call (compile+run) {t_first:.2f} s; max|out-ref|="
        f"{np.abs(o - r).max():.3e} rel_fro={rel:.3e} |ref|={np.linalg.norm(r):.3e} "
        f"finite={bool(np.isfinite(o).all())} {'OK' if rel < 2e-2 else 'MISMATCH'}"
    )

    def timeit(fn) -> tuple[float, float]:
        """(median us per blocked call, us per call of `reps` calls blocked once)."""
        for _ in range(3):
            jax.block_until_ready(fn())
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            jax.block_until_ready(fn())
            ts.append(time.perf_counter() - t)
        t = time.perf_counter()
        outs = [fn() for _ in range(reps)]
        jax.block_until_ready(outs)
        return statistics.median(ts) * 1e6, (time.perf_counter() - t) / reps * 1e6

    @jax.jit
    def unrolled(x, w):  # the chain as `steps` separate dots, as PyTorch would launch them
        for s in range(steps):
            ws = w[s] if stacked else w
            x = jnp.dot(x, ws, preferred_element_type=jnp.float32).astype(x.dtype)
        return x

    def device_us(fn) -> str:
        """GPU time from CUPTI (no host overhead): median over `reps` of the sum of all kernels
        of one call, and of its longest kernel (the Mosaic kernel, or the biggest dot)."""
        try:
            from jax.experimental.mosaic.gpu import profiler

            _, runs = profiler.measure(lambda: fn(), aggregate=False, iterations=reps)()
            if not runs:  # XLA may hide its kernels in a command buffer (CUDA graph)
                return "n/a (CUPTI saw no kernels)"
            total = statistics.median(sum(t for _, t in it) for it in runs) * 1e3
            top = statistics.median(max(t for _, t in it) for it in runs) * 1e3
            return f"{total:.1f} us ({len(runs[0])} kernels, longest {top:.1f})"
        except Exception as e:  # CUPTI can be unavailable; the wall-clock times still print
            return f"n/a ({type(e).__name__}: {e})"

    print(
        f"[{name}] device time (CUPTI): kernel {device_us(kern)}; XLA unrolled chain "
        f"{device_us(lambda: unrolled(x, w))}"
    )
    tk, tkb = timeit(kern)
    tr, trb = timeit(ref)
    tu, tub = timeit(lambda: unrolled(x, w))
    w_bytes = d * d * 2 * (steps if stacked else 1)
    print(
        f"[{name}] time (median blocked / back-to-back) us: kernel {tk:.1f} / {tkb:.1f}, "
        f"XLA fori chain {tr:.1f} / {trb:.1f}, XLA unrolled chain {tu:.1f} / {tub:.1f}; "
        f"kernel/unrolled {tkb / tub:.2f}; W={w_bytes / 2**20:.1f} MiB; weight bytes read by "
        f"the chain / kernel time = {steps * d * d * 2 / tkb / 1e6:.2f} TB/s"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", help="run one case in this process")
    p.add_argument("--list", action="store_true")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per case")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--only", default="", help="comma list of case names (default: all)")
    args = p.parse_args()
    if args.list:
        print("\n".join(CASES))
        return
    if args.case:
        try:
            run_case(args.case, args.reps)
        except Exception:
            print(f"[{args.case}] EXCEPTION:")
            traceback.print_exc(file=sys.stdout)
            sys.exit(1)
        return

    import jax

    dev = jax.devices()[0]
    print(
        f"jax {jax.__version__}; device {dev.platform} {getattr(dev, 'device_kind', '')} "
        f"cc={getattr(dev, 'compute_capability', None)} sms={getattr(dev, 'core_count', None)} "
        f"smem_optin={getattr(dev, 'shared_memory_per_block_optin', None)}",
        flush=True,
    )
    names = [n for n in args.only.split(",") if n] or list(CASES)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name in names:
        cmd = [sys.executable, "-m", "pallas_kernels.looped_matmul.smoke", "--case", name]
        cmd += ["--reps", str(args.reps)]
        t = time.perf_counter()
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=args.timeout, env=env
            )
            out = proc.stdout + (proc.stderr[-4000:] if proc.returncode else "")
            print(out.rstrip())
            if proc.returncode:
                print(f"[{name}] exit code {proc.returncode}")
        except subprocess.TimeoutExpired as e:
            so = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            print(so.rstrip())
            print(f"[{name}] TIMEOUT after {args.timeout:.0f} s (hang? grid barrier?)")
        print(f"[{name}] wall {time.perf_counter() - t:.1f} s", flush=True)


if __name__ == "__main__":
    main()
