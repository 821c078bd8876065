"""experiments.decode_attention on CPU: the head-major candidate computes the model's attention,
PyTorch's attention (what torch_graph captures and torch_compile compiles) matches the reference,
the PyTorch runners are put together as named, "vs best" and the ceilings, and the program runs
end to end on tiny sizes; on the GPU (marked) every PyTorch row against the reference. (The
model's own decode variants are tested in test_model.py.)"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_programs import (
    ON_GPU,
    TORCH_ROWS,
    assert_refused,
    check_compiled_whole,
    check_torch_row,
    import_torch,
    run_forked_program,
    run_program,
    write_ceilings,
)
from tolerance import rel_fro

from experiments import attention_bench as bench
from experiments import decode_attention as da
from huginn_jax.layers import DECODE_BLOCK, attend

S = 37  # cached positions in the tests below


def fresh_qkv(seed: int):
    """One float32 query [2, 1, 3, 8], keys and values [2, S, 3, 8], and the key positions."""
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (2, 1, 3, 8), jnp.float32)
    keys, values = (jax.random.normal(key, (2, S, 3, 8), jnp.float32) for key in (kk, kv))
    return q, keys, values, jnp.arange(S, dtype=jnp.int32)


def test_head_major_equals_the_models_attention():
    q, keys, values, k_pos = fresh_qkv(0)
    q_pos = jnp.array([20], jnp.int32)  # positions after 20 are masked out
    want = attend(q, keys, values, q_pos, k_pos)
    got = da.attend_head_major(
        q, jnp.swapaxes(keys, 1, 2), jnp.swapaxes(values, 1, 2), q_pos, k_pos
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # The mask matters: with every position visible the result differs.
    everything = attend(q, keys, values, jnp.array([S - 1], jnp.int32), k_pos)
    assert not np.allclose(everything, want, atol=1e-3)


run_cli = functools.partial(run_program, "decode_attention")
run_cli_forked = functools.partial(run_forked_program, "decode_attention")


def test_cli_on_cpu_writes_json(tmp_path):
    out = tmp_path / "da.json"
    ceilings = write_ceilings(tmp_path / "c.json", jax.devices()[0].device_kind, 1e9, 1e12)
    proc = run_cli(
        "--batch=1", "--context=40", "--heads=3", "--head_dim=8", "--slots=3", "--repeats=2",
        f"--json_out={out}", f"--ceilings={ceilings}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    impls = ["xla", "xla_split", "xla_head_major", "pallas"]
    if ON_GPU:  # the subprocess sees the same devices
        impls = da.expand_impls(list(da.IMPLS), [DECODE_BLOCK], [])
    else:
        assert "need(s) CUDA; skipped" in proc.stdout
    data = json.loads(out.read_text())
    assert data["ceilings"]["read_bytes_per_s"] == 1e9
    records = data["records"]
    assert [r["impl"] for r in records] == impls
    assert all(r["us"] > 0 and r["rel_err_vs_f64"] < 2e-2 and r["check_ok"] for r in records)
    for r in records:  # K and V of one slot: 2 x B x S x H x K x 2 B, at 1 GB/s
        assert r["kv_bytes"] == 2 * 40 * 3 * 8 * 2
        assert r["pct_of_read_rate"] == pytest.approx(100 * r["kv_bytes"] / r["us"] / 1e3)
    if not ON_GPU:  # JAX rows only: no rival, no vs best
        assert all(r["vs_best"] is None for r in records)
    head = next(line for line in proc.stdout.splitlines() if line.startswith("impl "))
    assert "vs best" in head and "%read" in head and "TB/s" not in head


def fake_records():
    def row(impl, context, us, ok=True):
        return {"impl": impl, "batch": 1, "context": context, "us": us, "us_p10": us,
                "us_p90": us, "gb_per_s": 1.0, "rel_err_vs_f64": 1e-3, "check_ok": ok}  # fmt: skip

    return [
        row("xla", 64, 10.0),
        row("pallas", 64, 5.0),
        row("torch_graph/flash", 64, 8.0),
        {**row("torch_compile/flash", 64, 4.0), "compile_seconds": 12.34},
        row("torch_compile/cudnn", 64, 1.0, ok=False),  # a wrong answer is no one's rival
        row("xla", 128, 10.0),  # another case: its own comparison
        {"impl": "torch_graph/cudnn", "batch": 1, "context": 128, "error": "no kernel"},
    ]


def test_vs_best_divides_the_other_frameworks_fastest_by_the_row():
    records = fake_records()
    bench.add_vs_best(records, da.CASE_KEYS)
    got = {(r["impl"], r["context"]): (r["vs_best"], r["best_rival"]) for r in records}
    assert got[("xla", 64)] == (pytest.approx(0.4), "torch_compile/flash")
    assert got[("pallas", 64)] == (pytest.approx(0.8), "torch_compile/flash")
    assert got[("torch_graph/flash", 64)] == (pytest.approx(5 / 8), "pallas")
    assert got[("torch_compile/flash", 64)] == (pytest.approx(5 / 4), "pallas")
    assert got[("torch_compile/cudnn", 64)] == (None, None)
    assert got[("xla", 128)] == (None, None)  # its only rival raised
    lines = da.format_table(records).splitlines()
    assert "0.40x" in lines[2] and "1.25x" in lines[5] and "12.3" in lines[5]
    assert "failed" in lines[-2] and lines[7].split()[-4] == "-"  # no rival: "-"


def test_expand_impls_gives_each_torch_impl_one_row_per_sdpa_backend():
    names = da.expand_impls(
        ["xla", "torch_graph", "pallas", "torch_compile"], [64, 128], ["8:64:4:2"],
        ["cudnn", "flash"],
    )  # fmt: skip
    assert names == [
        "xla", "torch_graph/cudnn", "torch_graph/flash", "pallas/8:64:4:2",
        "torch_compile/cudnn", "torch_compile/flash",
    ]  # fmt: skip
    # xla_split keeps its name at the default block
    assert da.expand_impls(["xla_split"], [DECODE_BLOCK], [], ["flash"]) == ["xla_split"]


def test_torch_attention_matches_the_reference_compiled_whole():
    """What torch_compile compiles, on the CPU: outputs [B, 1, H, K] per slot within tolerance;
    causal would mask all but the first cached position, which the check catches."""
    q, k, v = da.inputs(3, 2, S, 3, 8, seed=4)
    check_compiled_whole(da, da.checked_slots, q, k, v, causal=False)


class FakeGraph:
    """Stands in for a CUDA graph on the CPU: a replay reruns the captured function into the
    captured outputs."""

    def __init__(self, fn):
        self.fn, self.out = fn, fn()

    def replay(self):
        for dst, src in zip(self.out, self.fn(), strict=True):
            dst.copy_(src)


@pytest.mark.parametrize(
    "impl, mode", [("torch_graph", "default"), ("torch_compile", "default"),
                   ("torch_compile", "reduce-overhead")],
)  # fmt: skip
def test_torch_runner_is_put_together_as_its_name_says(monkeypatch, impl, mode):
    """TorchRunner's structure without CUDA: which function is captured (eager or compiled),
    the compile timed apart, and reduce-overhead called directly over static inputs."""
    torch = import_torch()
    captured = []

    def capture(fn, warmup):
        captured.append(fn)
        graph = FakeGraph(fn)
        return graph, graph.out

    monkeypatch.setattr(bench.torch_chain, "capture_graph", capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    compiles = []
    real_compile = torch.compile

    def compile_spy(fn, **kwargs):
        compiles.append(kwargs)
        return real_compile(fn, **kwargs)

    monkeypatch.setattr(torch, "compile", compile_spy)
    q, k, v = da.inputs(2, 1, S, 3, 8, seed=5)
    runner = bench.sdpa_runner(f"{impl}/flash", q, k, v, causal=False, mode=mode)
    ref = da.reference(q, k, v)
    for _ in range(2):
        assert rel_fro(da.checked_slots(runner()), ref) < 1e-2
    if impl == "torch_graph":
        assert compiles == [] and runner.compile_seconds is None and len(captured) == 1
        return
    assert compiles == [{"fullgraph": True, "dynamic": False, "mode": mode}]
    assert runner.compile_seconds > 0 and runner.compile_mode == mode
    if mode == "reduce-overhead":  # Inductor's own graphs; inputs static, so never copied
        assert captured == [] and runner.graph is None
        assert all(getattr(a, "_dynamo_static_input_type", None) for a in runner.args)
    else:
        assert len(captured) == 1 and runner.graph is not None


def test_ceilings_of_another_device_exit_2_with_one_line(tmp_path):
    ceilings = write_ceilings(tmp_path / "c.json", "NVIDIA A100-SXM4-80GB", 2e12, 300e12)
    proc = run_cli_forked(f"--ceilings={ceilings}", f"--json_out={tmp_path / 'x.json'}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert [line for line in proc.stderr.splitlines() if "'tpu'" not in line] == [
        f"decode_attention: --ceilings: {ceilings}: measured on 'NVIDIA A100-SXM4-80GB', "
        f"this run is on {jax.devices()[0].device_kind!r}"
    ]
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize(
    "flag, message",
    [
        ("--impls=flash", "unknown impl"),
        ("--impls=torch", "unknown impl"),
        ("--context=0", "must be >= 1"),
        ("--head_dim=7", "even"),
        ("--context=100000000", "for K and V caches of"),  # device or host memory
        ("--context=10000000000", "positions are int32"),
        ("--sdpa_backends=xformers", "--sdpa_backends: unknown 'xformers'"),
        ("--torch_compile_mode=fast", "torch_compile_mode"),
    ],
)
def test_cli_bad_flags_exit_2(tmp_path, flag, message):
    assert_refused(run_cli_forked(flag, f"--json_out={tmp_path / 'x.json'}"), message)


def test_cli_unwritable_json_exits_2_before_measuring(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = run_cli_forked("--batch=1", "--context=40", f"--json_out={blocker}/x.json")
    assert_refused(proc, "cannot write there")
    assert "rel err" not in proc.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("impl, mode, backend", TORCH_ROWS)
def test_torch_rows_match_the_reference_gpu(impl, mode, backend):
    q, k, v = da.inputs(4, 2, 1024, 55, 96, seed=6)
    check_torch_row(da, da.checked_slots, q, k, v, impl, mode, backend)
