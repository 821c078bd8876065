"""The records and the table of `experiments.generate_vs_torch`: per loop the median ms/token
(p10-p90), tokens/s, prefill, compile time, whether its tokens equal JAX's (else where they
part, with the logit difference and JAX's top-1/top-2 gap there) and "vs best"; the traced
loops' kernels per token."""

from __future__ import annotations

import numpy as np

from experiments.measure import compare as compare_lib
from experiments.measure import trace as trace_lib
from huginn_jax.generate import Generation


def compare(jax_gen: Generation, torch_tokens: np.ndarray, torch_logits: np.ndarray) -> dict:
    """Token agreement and logit differences where both loops had the same inputs."""
    jax_tokens, jax_logits = jax_gen.tokens, jax_gen.logits
    differ = np.nonzero((jax_tokens != torch_tokens).any(axis=0))[0]
    first = int(differ[0]) if differ.size else None
    # Token n is computed from tokens < n: up to the first mismatch both loops saw the same ids.
    upto = jax_tokens.shape[1] if first is None else first + 1
    diff = np.abs(jax_logits[:, :upto] - torch_logits[:, :upto])
    out = {
        "tokens_agree": first is None,
        "first_mismatch": first,
        "tokens_agreeing": int((jax_tokens == torch_tokens).sum()),
        "tokens_total": int(jax_tokens.size),
        "prefill_logits_max_abs_diff": float(diff[:, 0].max()),
        "logits_max_abs_diff_same_inputs": float(diff.max()),
        "logits_abs_max": float(np.abs(jax_logits[:, :upto]).max()),
    }
    if first is not None:
        top2 = np.sort(jax_logits[:, first], axis=-1)[:, -2:]
        out["jax_top2_gap_at_mismatch"] = float((top2[:, 1] - top2[:, 0]).min())
    return out


def loop_record(
    impl: str, latencies_s: list[float], prefill_s: float, compile_s: float, batch: int
) -> dict:
    """One table row: ms/token median and p10/p90, tokens/s (batch × tokens / decode time),
    prefill ms, compile s."""
    ms = np.asarray(latencies_s) * 1e3
    return {
        "impl": impl,
        "ms_per_token": float(np.median(ms)) if ms.size else None,
        "ms_p10": float(np.percentile(ms, 10)) if ms.size else None,
        "ms_p90": float(np.percentile(ms, 90)) if ms.size else None,
        "tokens_per_s": batch * ms.size / (ms.sum() / 1e3) if ms.size else None,
        "prefill_ms": prefill_s * 1e3,
        "compile_s": compile_s,
    }


def make_records(
    jax_gen: Generation, runs: dict, comparisons: dict, checks: dict, batch: int
) -> list:
    """The rows: jax (jax_persistent where its decode steps ran the persistent Core), then each
    torch loop (tokens vs JAX, its conformance), with vs_best."""
    stats = jax_gen.stats
    compile_s = sum(v for v in stats["compile_s"].values() if v)
    name = "jax_persistent" if stats.get("core_decode") == "persistent" else "jax"
    timing = (stats["decode_latency_s"], stats["prefill_s"], compile_s, batch)
    records = [loop_record(name, *timing)]
    records[0].update(tokens_equal_jax=None, first_difference=None)
    for impl, gen in runs.items():
        rec = loop_record(impl, gen.latencies_s, gen.prefill_s, gen.setup_s, batch)
        rec["tokens_equal_jax"] = comparisons[impl]["tokens_agree"]
        rec["first_difference"] = comparisons[impl]["first_mismatch"]
        rec["conformance_passed"] = checks[impl]["passed"] if impl in checks else None
        records.append(rec)
    compare_lib.add_vs_best(records, group_keys=(), time_key="ms_per_token")
    return records


def num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def print_table(records: list[dict], comparisons: dict, checks: dict, details: dict) -> None:
    header = "impl|ms/token|p10-p90|tokens/s|prefill ms|compile s|tokens = JAX|vs best"
    rows = [tuple(header.split("|"))]
    for rec in records:
        same = rec["tokens_equal_jax"]
        equal = "-" if same is None else "yes" if same else f"no ({rec['first_difference']})"
        spread = "-" if rec["ms_p10"] is None else f"{rec['ms_p10']:.3f}-{rec['ms_p90']:.3f}"
        rows.append(
            (
                rec["impl"],
                num(rec["ms_per_token"], ".3f"),
                spread,
                num(rec["tokens_per_s"], ".1f"),
                num(rec["prefill_ms"], ".1f"),
                num(rec["compile_s"], ".1f"),
                equal,
                compare_lib.format_vs_best(rec["vs_best"]),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    for impl, info in details.items():
        print(f"{impl}: {info['loop']}")
    for impl, c in comparisons.items():
        line = (
            f"{impl} vs jax: max |logit diff| (same ids) {c['logits_max_abs_diff_same_inputs']:.3g}"
        )
        if not c["tokens_agree"]:
            line += (
                f"; tokens part at {c['first_mismatch']}, JAX's top-1/top-2 gap there "
                f"{c['jax_top2_gap_at_mismatch']:.3g}"
            )
        print(line)
    for impl, check in checks.items():
        verdict = "passed" if check["passed"] else "FAILED"
        print(
            f"conformance {impl} (huginn_tiny_a greedy tokens, float32): tokens "
            f"{'equal' if check['tokens_equal'] else 'differ'}, prefill max abs err "
            f"{check['prefill_max_abs_err']:.2e}: {verdict}"
        )


def print_traces(details: dict) -> None:
    """Each traced loop's kernels per decode token (`trace` in its details), longest first."""
    for impl, loop in details.items():
        if "trace" not in loop:
            continue
        rows = [trace_lib.Row(**row) for row in loop["trace"]]
        print(f"{impl}: {loop['trace_tokens']} decode tokens traced ({loop['trace_file']})")
        print(trace_lib.side_by_side({impl: rows}, top=15, per="token"))
        print(trace_lib.per_unit_line(loop["trace_us_per_token"], "token"))
