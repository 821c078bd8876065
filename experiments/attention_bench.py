"""What the comparison programs (`adapter`, `decode_attention`, `prefill_attention`) share: which
implementations can run here, the PyTorch runners (eager replayed from a CUDA graph, and
torch.compile), PyTorch's SDPA from the model's layout, the device ceilings, the sweep over cases
and implementations (building, checking and timing each into a record), the "vs best" column,
and the end of a run: the results JSON, the table, and exit status 1 for a row that failed its
check.

A PyTorch impl name is its runner, then for attention the SDPA backend: "torch_graph/flash",
"torch_compile/cudnn"; every name that starts with "torch" counts as PyTorch in "vs best".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from absl import flags

from experiments import cli, program
from experiments.cli import UserError
from experiments.measure import ceilings as ceilings_lib
from experiments.measure import compare, timing
from experiments.torch_ref import chain as torch_chain  # imports no torch

FLAGS = flags.FLAGS
TORCH_IMPLS = ("torch_graph", "torch_compile")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
SDPA_BACKENDS = ("flash", "cudnn", "efficient", "math")
DEFAULT_SDPA_BACKENDS = ("flash", "cudnn", "efficient")  # math: the unfused reference path
TOLERANCE = 2e-2  # largest relative error (Frobenius) of a row that passes its check
TORCH_COMPILE_MODE_HELP = (
    "Mode of torch_compile: default and max-autotune-no-cudagraphs are replayed from a CUDA graph "
    "captured here, reduce-overhead from Inductor's own CUDA graphs."
)


def base_impl(impl: str) -> str:
    """The runner of an impl name: "torch_compile/flash" -> "torch_compile"."""
    return impl.partition("/")[0]


def runnable(impls: Sequence[str], gpu_only: Sequence[str], on_gpu: bool) -> list[str]:
    """`impls` less those that cannot run here (a note printed for each group left out)."""
    impls = list(impls)
    if not on_gpu and any(base_impl(i) in gpu_only for i in impls):
        skipped = [i for i in impls if base_impl(i) in gpu_only]
        print(f"note: {', '.join(dict.fromkeys(map(base_impl, skipped)))} need(s) CUDA; skipped")
        impls = [i for i in impls if i not in skipped]
    if any(compare.framework(i) == "torch" for i in impls) and not torch_chain.available():
        print(f"note: PyTorch is not installed ({torch_chain.INSTALL}); torch rows skipped")
        impls = [i for i in impls if compare.framework(i) != "torch"]
    return impls


def known_impls(values: Sequence[str], known: Sequence[str]) -> list[str]:
    """`--impls` without repeats; UserError when empty or naming the first value not in
    `known`."""
    return cli.names_in("impls", list(values), known, noun="impl")


def with_sdpa_backends(impls: Sequence[str], backends: Sequence[str]) -> list[str]:
    """Each PyTorch impl once per SDPA backend ("torch_graph" -> "torch_graph/flash", ...)."""
    return [
        name
        for impl in impls
        for name in ([f"{impl}/{b}" for b in backends] if impl in TORCH_IMPLS else [impl])
    ]


def load_ceilings(device_kind: str, path: str) -> ceilings_lib.Ceilings | None:
    """The ceilings every % of floor is stated against: `path` when given (it must be of this
    device), else the device's default file; None when the project has none for the device."""
    try:
        return ceilings_lib.for_device(device_kind, path or None)
    except ceilings_lib.CeilingsError as e:
        raise UserError(f"--ceilings: {e}") from None


def ceilings_line(ceilings: ceilings_lib.Ceilings | None, device_kind: str) -> str:
    """The table's last line: where the floors come from, or that there are none."""
    if ceilings is None:
        return f"no ceilings file for {device_kind!r}: no % of floor"
    return (
        f"floors: read {ceilings.read_bytes_per_s / 1e12:.2f} TB/s, bf16 GEMM "
        f"{ceilings.bf16_flops_per_s / 1e12:.0f} TFLOP/s ({ceilings.source})"
    )


# --- PyTorch ------------------------------------------------------------------------------


def sdpa_fn(*, causal: bool, backend: str) -> Callable[..., tuple]:
    """One layer's attention per set, from and to the model's layout, as one function (what
    torch_graph captures and torch_compile compiles): q [sets, B, T, H, K], k and v
    [sets, B, S, H, K] in; a tuple of `sets` outputs [B, T, H, K], contiguous as the model's next
    op reads them. SDPA reads [B, H, *, K] views (no copy) with only `backend` allowed; the
    final `.contiguous()` costs nothing where the backend already wrote [B, T, H, K]."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    allowed = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }[backend]

    def attention_sets(q, k, v):
        with sdpa_kernel(allowed):
            return tuple(
                F.scaled_dot_product_attention(
                    q[i].transpose(1, 2), k[i].transpose(1, 2), v[i].transpose(1, 2),
                    is_causal=causal,
                ).transpose(1, 2).contiguous()
                for i in range(q.shape[0])
            )  # fmt: skip

    return attention_sets


def compile_timed(
    fn: Callable[..., Any], args: Sequence[Any], mode: str, sync: Callable[[], None] | None = None
) -> tuple[Callable[..., Any], float]:
    """`torch.compile(fn, fullgraph=True, dynamic=False, mode=mode)` for these static `args`,
    and the seconds of its first call (tracing, compiling, one run; `sync` waits for the device).
    Dynamo's caches are reset first: every compile is timed from the start, and the programs'
    many shapes never reach its recompile limit (beyond which it would fall back to eager)."""
    import torch

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=False, mode=mode)
    start = time.perf_counter()
    compiled(*args)
    if sync is not None:
        sync()
    return compiled, time.perf_counter() - start


class TorchRunner:
    """`fn(*args)` (CUDA tensors in, a tuple of tensors out) as one PyTorch impl:
      torch_graph    eager, captured once in a CUDA graph and replayed;
      torch_compile  `compile_timed(fn, args, mode)` (its first call recorded apart, as
                     `compile_seconds`), replayed from a CUDA graph captured here; for mode
                     "reduce-overhead" called directly, as Inductor records its own CUDA graphs
                     (the inputs marked static, so that no replay copies them first).
    A call returns the output tuple, rewritten by the next call. The runner holds the inputs:
    a graph reads them at their addresses, which torch would otherwise hand to the next
    allocation (an input made here, such as a concatenation, has no other owner)."""

    def __init__(self, impl: str, fn: Callable[..., tuple], args: Sequence[Any], *, mode: str):
        import torch

        self.sync = torch.cuda.synchronize
        self.compile_seconds: float | None = None
        self.compile_mode: str | None = None
        self.graph = None
        self.args = tuple(args)
        if impl == "torch_compile":
            if mode == "reduce-overhead":
                for arg in self.args:
                    torch._dynamo.mark_static_address(arg)
            fn, self.compile_seconds = compile_timed(fn, self.args, mode, self.sync)
            self.compile_mode = mode
            if mode == "reduce-overhead":
                self.fn = fn
                return
        elif impl != "torch_graph":
            raise ValueError(f"unknown torch impl {impl!r}")
        self.fn = fn
        self.graph, self.out = torch_chain.capture_graph(lambda: fn(*self.args), warmup=1)

    def __call__(self):
        if self.graph is None:
            import torch

            torch.compiler.cudagraph_mark_step_begin()  # a new inference step: reuse the pool
            return self.fn(*self.args)
        self.graph.replay()
        return self.out

    def release(self) -> None:
        """Frees the graphs (ours, or Inductor's with Dynamo's caches) and hands torch's cached
        blocks back, for the JAX rows after it."""
        self.graph = self.out = self.fn = self.args = None
        if self.compile_mode is not None:
            import torch

            torch._dynamo.reset()
        torch_chain.release()


def sdpa_runner(impl: str, q, k, v, *, causal: bool, mode: str) -> TorchRunner:
    """The runner of "torch_graph/BACKEND" or "torch_compile/BACKEND" over the JAX arrays q, k, v
    [sets, B, *, H, K] (torch views of the same memory: no copy)."""
    import torch

    runner, _, backend = impl.partition("/")
    args = tuple(torch.from_dlpack(x) for x in (q, k, v))
    return TorchRunner(runner, sdpa_fn(causal=causal, backend=backend), args, mode=mode)


def attention_runner(
    impl: str, q, k, v, mode: str = "default", *, causal: bool, xla_runner: Callable[..., Any]
):
    """The runner of an attention impl over q, k, v [sets, B, *, H, K]: `sdpa_runner` for a
    PyTorch impl (`mode`: torch.compile's), else `xla_runner(impl, q, k, v)`."""
    if compare.framework(impl) == "torch":
        return sdpa_runner(impl, q, k, v, causal=causal, mode=mode)
    return xla_runner(impl, q, k, v)


# --- the sweep, one row, the vs best column, the end of a run -----------------------------


def sweep(
    desc: str,
    cases: Sequence[Any],
    impls: Sequence[Any],
    prepare: Callable[[Any], Any],
    measure: Callable[[Any, Any, Any], dict[str, Any]],
    records: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """`measure(case, impl, prepare(case))` for every case, then every impl, in that order, with
    a progress bar on stderr. `prepare` runs once per case, the previous case's inputs dropped
    first, so that two cases' inputs never share the device memory. Each record is appended to
    `records` (a new list when None) as it is measured, so that an interrupted run has them."""
    records = [] if records is None else records
    current, prepared = object(), None
    for case, impl in program.progress([(c, i) for c in cases for i in impls], desc):
        if case != current:
            prepared = None
            current, prepared = case, prepare(case)
        records.append(measure(case, impl, prepared))
    return records


def time_one(
    case: dict[str, Any],
    make_runner: Callable[[], Any],
    checked: Callable[[Any], np.ndarray],
    ref: np.ndarray,
    *,
    per_call: int,
    warmup: int,
    repeats: int,
) -> dict[str, Any]:
    """Builds one implementation's runner, checks `checked(output)` against `ref` and times it
    (`per_call` units per call): `case` plus the median µs per unit, its p10-p90, the relative
    error, whether it is within TOLERANCE (`check_ok`), the samples and, for torch_compile, the
    compile mode and seconds (outside the samples); or `case` plus "error" when it failed (a
    result too, e.g. a kernel refusing a shape)."""
    label = " ".join(f"{k}={v}" for k, v in case.items())
    runner = None
    try:
        runner = make_runner()
        out = checked(runner())
        samples = timing.time_fn(
            runner, warmup=warmup, repeats=repeats, sync=runner.sync, per_call=per_call
        )
    except Exception as e:
        message = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        print(f"note: {label} failed: {message}")
        return {**case, "error": message}
    finally:
        if runner is not None and hasattr(runner, "release"):
            runner.release()
    err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    ok = bool(err <= TOLERANCE)  # False for NaN too
    print(
        f"{label}: {timing.format_us(samples.median * 1e6)}, rel err {err:.1e}"
        + ("" if ok else f" FAILED (> {TOLERANCE:g})")
    )
    record = {
        **case,
        "us": samples.median * 1e6,
        "us_p10": samples.quantile(0.1) * 1e6,
        "us_p90": samples.quantile(0.9) * 1e6,
        "rel_err_vs_f64": err,
        "check_ok": ok,
        "samples_s": samples.seconds,
    }
    if getattr(runner, "compile_seconds", None) is not None:
        record.update(compile_mode=runner.compile_mode, compile_seconds=runner.compile_seconds)
    return record


def add_vs_best(records: list[dict[str, Any]], case_keys: Sequence[str]) -> None:
    """`vs_best` and `best_rival` on every record (compare.add_vs_best over the case's fields);
    a row that failed its check or raised is no one's rival and has no vs_best."""
    passed = [r for r in records if r.get("check_ok")]
    compare.add_vs_best(passed, group_keys=case_keys, time_key="us")
    for r in records:
        if not r.get("check_ok"):
            r["vs_best"], r["best_rival"] = None, None


def compile_cell(record: dict[str, Any]) -> str:
    seconds = record.get("compile_seconds")
    return "-" if seconds is None else f"{seconds:.1f}"


def fail_on_check(name: str, records: list[dict[str, Any]], case_keys: Sequence[str]) -> None:
    """Exit status 1, after the results are written, when a row differs from the reference."""
    failed = [r for r in records if r.get("check_ok") is False]
    if failed:
        rows = "; ".join(
            f"{r['impl']} " + " ".join(f"{k}={r[k]}" for k in case_keys) for r in failed
        )
        cli.fail(name, f"rel err above {TOLERANCE:g} against the reference: {rows}", code=1)


def payload(
    records: list[dict[str, Any]], ceilings: ceilings_lib.Ceilings | None
) -> dict[str, Any]:
    """What a comparison program's JSON holds besides the environment: the records, the
    ceilings and the check's tolerance (also what an interrupted run writes)."""
    return {
        "records": records,
        "ceilings": ceilings.to_dict() if ceilings else None,
        "check_tolerance": TOLERANCE,
    }


def measure_and_finish(
    name: str,
    measure: Callable[[list[dict[str, Any]], ceilings_lib.Ceilings | None], None],
    format_table: Callable[[list[dict[str, Any]]], str],
    *,
    cpu_line: str | None,
    json_out: str,
    ceilings_path: str,
    case_keys: Sequence[str],
) -> None:
    """The end of a comparison program's main: this device's ceilings, the CPU line, then
    `measure(records, ceilings)` appending its rows (kept, "complete": false, on an interrupt);
    then the results JSON (`payload`, "complete": true; none for an empty `json_out`) and its
    path, the table, the ceilings line, and exit status 1 when a row failed its check
    (`fail_on_check`), so the results are kept."""
    import jax

    device_kind = jax.devices()[0].device_kind
    ceilings = load_ceilings(device_kind, ceilings_path)
    if cpu_line:
        print(cpu_line)
    records: list[dict[str, Any]] = []
    with program.keep_partial(json_out, lambda: payload(records, ceilings)):
        measure(records, ceilings)
    if json_out:
        complete = {**payload(records, ceilings), "complete": True}
        print(f"results: {program.write_results(json_out, complete)}")
    print(format_table(records))
    print(ceilings_line(ceilings, device_kind))
    fail_on_check(name, records, case_keys)
