"""The cases of the looped matmul smoke program (`looped_matmul_smoke.py`), by suite.

A case is a dict: `variant` ("resident", "splitk" or "barrier"), `m`, `d`, `steps`, optional
`cfg` (overrides of the picked config's fields; `split=(tiles, k_split)` another 2-D split
filled like the picker), `stacked`, `grid_barrier=False` (an ablation), and for the barrier
probe `poll` and `warpgroups`. Suites: `table` (resident vs split-K vs XLA, then split-K
variants at 72 MiB), `resident` (the resident kernel's probes), `steps` (split-K time against
steps), `barrier` (each way of polling the grid barrier). Also the PyTorch times and targets the
table prints next to them (docs/looped_matmul.md, "Targets").
"""

from __future__ import annotations

from typing import Any

from pallas_kernels.looped_matmul.barrier import POLLS

TABLE_D = (6144, 3520, 2048, 12288)  # the 72 MiB target first
TABLE_M = (1, 8, 64)
TABLE_STEPS = 8
# The barrier probe: blocks (one per SM) and the epochs of its long run (per barrier =
# (t[BARRIER_EPOCHS] - t[1]) / (BARRIER_EPOCHS - 1)).
BARRIER_EPOCHS = 65
BARRIER_BLOCKS = 132

# name: variant, m, d, steps, optional config overrides, stacked
RESIDENT_CASES: dict[str, dict[str, Any]] = {
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


def _table_cases() -> dict[str, dict[str, Any]]:
    cases: dict[str, dict[str, Any]] = {}
    # canary: small, all in registers; if the split-K barrier hangs, this shows it first
    cases["splitk_d2048_m1"] = dict(variant="splitk", m=1, d=2048, steps=TABLE_STEPS)
    for d in TABLE_D:
        for m in TABLE_M:
            for variant in ("resident", "splitk"):
                cases.setdefault(
                    f"{variant}_d{d}_m{m}", dict(variant=variant, m=m, d=d, steps=TABLE_STEPS)
                )
    d6144_m1 = dict(variant="splitk", m=1, d=6144, steps=TABLE_STEPS)
    variants = {
        "regs9": dict(reg_units=9, smem_units=8, ring=3),  # 34 MiB on chip, 38 MiB streamed
        "smem8": dict(reg_units=0, smem_units=8, ring=3),
        "regs11": dict(reg_units=11),  # spill probe: slower than the pick => ptxas spilled
        "lag2": dict(wgmma_lag=2),
        "ksplit8": dict(split=(3, 8)),  # 32 col groups x 8 K ranges, refilled
        "leaderpoll": dict(poll="leader"),  # one polling warpgroup per block
        "flags": dict(sync="flags"),  # per-column-group counters instead of the grid barrier
        # zigzag: odd steps read the streamed chunks backwards (L2 reuse across steps)
        "zigzag": dict(zigzag=True),
        "zigzag_smem8": dict(reg_units=0, smem_units=8, ring=3, zigzag=True),
        "zigzag_regs9": dict(reg_units=9, smem_units=8, ring=3, zigzag=True),
    }
    for tag, over in variants.items():
        cases[f"splitk_d6144_m1_{tag}"] = dict(d6144_m1, cfg=over)
    cases["splitk_d12288_m1_flags"] = dict(
        variant="splitk", m=1, d=12288, steps=TABLE_STEPS, cfg=dict(sync="flags")
    )
    for d, over in ((4992, dict(x_stages=64, ring=6, smem_units=0)), (12288, {})):
        cases[f"splitk_d{d}_m1_zigzag"] = dict(
            variant="splitk", m=1, d=d, steps=TABLE_STEPS, cfg=dict(zigzag=True, **over)
        )
    cases["splitk_d4992_m1"] = dict(variant="splitk", m=1, d=4992, steps=TABLE_STEPS)
    cases["splitk_d12288_m1_regs8_ring6"] = dict(  # register units + a 6-slot ring (HBM-bound)
        variant="splitk",
        m=1,
        d=12288,
        steps=TABLE_STEPS,
        cfg=dict(reg_units=8, smem_units=3, ring=6),
    )
    cases["splitk_d12288_m1_ring3"] = dict(
        variant="splitk", m=1, d=12288, steps=TABLE_STEPS, cfg=dict(ring=3, smem_units=6)
    )
    cases["splitk_d2048_m1_npad16"] = dict(  # if n_pad=8 mismatches and this matches: N=8 B
        variant="splitk", m=1, d=2048, steps=TABLE_STEPS, cfg=dict(min_n_pad=16)
    )
    cases["splitk_d2048_m1_leaderpoll"] = dict(
        variant="splitk", m=1, d=2048, steps=TABLE_STEPS, cfg=dict(poll="leader")
    )
    cases["splitk_d6144_m8_s32"] = dict(variant="splitk", m=8, d=6144, steps=32)
    return cases


def _steps_cases() -> dict[str, dict[str, Any]]:
    """Per-step cost of the split-K kernel: the time against steps (1..32) at sizes that are all
    on chip (8 and 24 MiB), where a step is only its grid barrier and state exchange plus a
    little wgmma; and the leader-poll barrier variant at the same sizes."""
    cases: dict[str, dict[str, Any]] = {}
    for d in (2048, 3520):
        for steps in (1, 4, 8, 32):
            cases[f"splitk_d{d}_m1_s{steps}"] = dict(variant="splitk", m=1, d=d, steps=steps)
        cases[f"splitk_d{d}_m1_s32_leaderpoll"] = dict(
            variant="splitk", m=1, d=d, steps=32, cfg=dict(poll="leader")
        )
        for steps in (8, 32):  # per-column-group flags instead of the grid barrier
            cases[f"splitk_d{d}_m1_s{steps}_flags"] = dict(
                variant="splitk", m=1, d=d, steps=steps, cfg=dict(sync="flags")
            )
        if d == 3520:  # 55 x 64: ragged K ranges over 2 warpgroups per SM vs the pick's 1
            for steps in (8, 32):
                cases[f"splitk_d3520_m1_s{steps}_ragged2wg"] = dict(
                    variant="splitk", m=1, d=d, steps=steps,
                    cfg=dict(tiles=5, k_split=20, warpgroups=2, reg_units=9, smem_units=6, ring=0),
                )  # fmt: skip
        # Everything streamed from L2 (no weight on chip; it stays in L2 at these sizes): the
        # per-step time minus the on-chip variant's is what reading W from L2 costs, the
        # bound on the 72 MiB step.
        for steps in (8, 32):
            cases[f"splitk_d{d}_m1_s{steps}_streamed"] = dict(
                variant="splitk", m=1, d=d, steps=steps,
                cfg=dict(reg_units=0, smem_units=0, ring=9, zigzag=True),
            )  # fmt: skip
        # Ablation: the same kernel without its grid barrier. Steps then race (the result is
        # not expected to match: status ABLATION); the time difference is the barrier's cost.
        for steps in (8, 32):
            cases[f"splitk_d{d}_m1_s{steps}_nobarrier"] = dict(
                variant="splitk", m=1, d=d, steps=steps, grid_barrier=False
            )
    return cases


def _barrier_cases() -> dict[str, dict[str, Any]]:
    """The grid barrier alone (probe kernel: 132 blocks, 1 or 2 warpgroups, 1 and 65 epochs;
    per barrier = (t65 - t1) / 64), then split-K steps at 8 and 24 MiB with each way of polling.
    A poll that hangs in the probe is skipped in the split-K cases."""
    cases: dict[str, dict[str, Any]] = {}
    for poll in POLLS:
        for wgs in (1, 2) if poll != "leader" else (2,):  # leader needs two warpgroups
            for epochs in (1, BARRIER_EPOCHS):
                cases[f"barrier_{poll}_wg{wgs}_e{epochs}"] = dict(
                    variant="barrier", m=0, d=0, steps=epochs, poll=poll, warpgroups=wgs
                )
    for d in (2048, 3520):
        for poll in POLLS:
            for steps in (8, 32):
                cases[f"splitk_d{d}_m1_s{steps}_{poll}"] = dict(
                    variant="splitk", m=1, d=d, steps=steps, cfg=dict(poll=poll)
                )
    return cases


TABLE_CASES = _table_cases()
SUITES = {
    "table": TABLE_CASES,
    "resident": RESIDENT_CASES,
    "steps": _steps_cases(),
    "barrier": _barrier_cases(),
}
