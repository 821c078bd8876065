"""Tests of experiments.chain.runners and the torch chain: weights, layouts, the XLA forms of the
chain against the NumPy reference, one chain's output, compile times, torch.compile and graphs."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from chain_config import small_config

from experiments.chain import options, report, runners

# ---------------------------------------------------------------- weights


def test_copies_are_distinct_buffers_and_shared_is_one():
    cfg = small_config()
    _, w = runners.host_values(cfg)
    shared = runners.make_weights(w, cfg.steps, "shared")
    copies = runners.make_weights(w, cfg.steps, "copies")
    assert len(set(runners.buffer_pointers(shared))) == 1
    assert all(s is shared[0] for s in shared)
    assert len(set(runners.buffer_pointers(copies))) == cfg.steps
    for c in copies:
        assert np.array_equal(np.asarray(c).view(np.uint16), w.view(np.uint16))


def test_host_values_are_deterministic_and_not_zero():
    cfg = small_config(d=64)
    x1, w1 = runners.host_values(cfg)
    x2, w2 = runners.host_values(cfg)
    assert x1.shape == (1, 64) and w1.shape == (64, 64) and w1.dtype == cfg.np_dtype
    assert np.array_equal(w1.view(np.uint16), w2.view(np.uint16))
    assert np.array_equal(x1.view(np.uint16), x2.view(np.uint16))
    assert np.std(w1.astype(np.float32)) == pytest.approx(1 / 8, rel=0.1)  # N(0, 1/d)


# ---------------------------------------------------------------- outputs


def _outputs(cfg, impl, n=3):
    x, w = runners.host_values(cfg)
    out = {}
    for layout in options.LAYOUTS:
        ws = runners.make_weights(w, cfg.steps, layout)
        out[layout] = runners.xla_runner(impl, jax.device_put(x), ws, n=n).output()
    return x, w, out


@pytest.mark.parametrize("impl", ["xla", "xla_loop"])
def test_layouts_give_bit_identical_outputs(impl):
    _, _, out = _outputs(small_config(), impl)
    assert report.same_bits(out["shared"], out["copies"])
    assert np.all(np.isfinite(out["shared"])) and np.any(out["shared"] != 0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("impl, chains", [("xla", 1), ("xla_loop", 3)])
def test_xla_matches_numpy_reference(dtype, impl, chains):
    cfg = small_config(d=192, steps=8, dtype=dtype)
    x, w, out = _outputs(cfg, impl, n=3)
    ref = report.reference_chain(x, w, cfg.steps * chains)
    rel = np.max(np.abs(out["shared"] - ref)) / np.max(np.abs(ref))
    assert rel <= report.tolerance(dtype, cfg.steps * chains)
    # the state stays O(1): scaled weights neither vanish nor blow up
    assert 0.05 < np.max(np.abs(ref)) < 100


# ---------------------------------------------------------------- XLA forms


def _xla(impl, cfg, layout="shared", n=3):
    x, w = runners.host_values(cfg)
    ws = runners.make_weights(w, cfg.steps, layout)
    return x, w, runners.xla_runner(impl, jax.device_put(x), ws, n=n)


def test_plain_form_is_a_bf16_dot_and_f32dot_casts():
    cfg = small_config(d=128, steps=4)
    x, w = runners.host_values(cfg)
    args = (x, *[w] * cfg.steps)
    plain = jax.jit(runners.chain_fn).lower(*args).as_text()
    f32dot = jax.jit(runners.chain_f32dot_fn).lower(*args).as_text()
    assert plain.count("stablehlo.dot_general") == f32dot.count("stablehlo.dot_general") == 4
    assert "stablehlo.convert" not in plain and "-> tensor<1x128xf32>" not in plain
    assert f32dot.count("stablehlo.convert") == 4


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("impls", [("xla", "xla_f32dot"), ("xla_loop", "xla_loop_f32dot")])
def test_plain_form_equals_f32dot_form_within_tolerance(dtype, impls):
    cfg = small_config(d=256, steps=8, dtype=dtype)
    outs = [_xla(impl, cfg)[2] for impl in impls]
    chains = outs[0].chains_in_output
    assert chains == outs[1].chains_in_output == (1 if impls[0] == "xla" else 3)
    a, b = (r.output() for r in outs)
    tol = report.tolerance(dtype, cfg.steps * chains)
    assert np.max(np.abs(a - b)) / np.max(np.abs(b)) <= tol
    assert np.any(a != 0) and np.all(np.isfinite(a))


def test_xla_loop_unrolled_matches_xla_loop():
    cfg, n = small_config(d=192, steps=8), 5
    x, w, loop = _xla("xla_loop", cfg, n=n)
    unrolled = _xla("xla_loop_unrolled", cfg, n=n)[2]
    assert loop.per_call == unrolled.per_call == unrolled.chains_in_output == n
    a, b = loop.output(), unrolled.output()
    ref = report.reference_chain(x, w, cfg.steps * n)
    tol = report.tolerance(cfg.dtype, cfg.steps * n)
    assert np.max(np.abs(a - b)) / np.max(np.abs(ref)) <= tol
    assert np.max(np.abs(b - ref)) / np.max(np.abs(ref)) <= tol
    # one straight-line program: no while loop, n x steps dots
    ws = runners.make_weights(w, cfg.steps, "shared")
    lowered = jax.jit(runners._unrolled_fn, static_argnames="n").lower(x, *ws, n=n).as_text()
    assert "stablehlo.while" not in lowered
    assert lowered.count("stablehlo.dot_general") == n * cfg.steps
    looped = jax.jit(runners._loop_fn, static_argnames="n").lower(x, *ws, n=n).as_text()
    assert "stablehlo.while" in looped


def test_xla_loop_unrolled_caps_its_chains_per_call(monkeypatch):
    assert runners.unrolled_chains(100, 8) == 100
    assert runners.unrolled_chains(1000, 8) == runners.UNROLLED_MAX_PRODUCTS // 8
    assert runners.unrolled_chains(10, 10_000) == 1
    monkeypatch.setattr(runners, "UNROLLED_MAX_PRODUCTS", 12)
    runner = _xla("xla_loop_unrolled", small_config(d=64, steps=4), n=10)[2]
    assert runner.per_call == runner.chains_in_output == 3


@pytest.mark.parametrize("impl", ["xla", "xla_loop", "xla_loop_f32dot", "xla_loop_unrolled"])
def test_one_chain_output_is_one_chain(impl):
    cfg, n = small_config(d=192, steps=8), 3
    x, w, runner = _xla(impl, cfg, n=n)
    one = runner.one_chain()
    ref1 = report.reference_chain(x, w, cfg.steps)
    assert report.agreement(one, ref1, cfg.dtype, cfg.steps)["ok"]
    if runner.chains_in_output > 1:  # not the output of the whole call
        ref_n = report.reference_chain(x, w, cfg.steps * n)
        assert not report.agreement(one, ref_n, cfg.dtype, cfg.steps * n)["ok"]


def test_compile_seconds_only_when_it_compiled():
    cfg = small_config(d=320, steps=3)
    first = _xla("xla_loop_f32dot", cfg, n=7)[2]
    again = _xla("xla_loop_f32dot", cfg, layout="copies", n=7)[2]  # same shapes: cached
    assert first.compile_seconds is not None and first.compile_seconds > 0
    assert again.compile_seconds is None


# ---------------------------------------------------------------- torch


def test_torch_compile_is_one_graph_equal_to_eager():
    torch = pytest.importorskip("torch", reason='needs PyTorch: pip install -e ".[torch]"')
    from experiments.torch_ref import chain as torch_chain

    assert torch_chain.IMPLS == ("torch_eager", "torch_graph", "torch_compile")
    x = torch.randn(1, 128, dtype=torch.bfloat16)
    w = torch.randn(128, 128, dtype=torch.bfloat16) / 11.3
    copies = [w] + [w.clone() for _ in range(3)]
    compiled = torch_chain.compile_chain("default", backend="aot_eager")  # Inductor: GPU test
    for ws in ([w] * 4, copies):
        assert torch.equal(compiled(x, *ws), torch_chain.chain(x, ws))
    with pytest.raises(ValueError, match="mode"):
        torch_chain.compile_chain("fastest")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead", "max-autotune-no-cudagraphs"])
def test_torch_compile_runner_matches_the_reference(mode):
    from experiments.torch_ref import chain as torch_chain

    if not torch_chain.cuda_available():
        pytest.skip("torch without CUDA")
    cfg, n = small_config(d=256, steps=8), 3
    x, w = runners.host_values(cfg)
    ref = report.reference_chain(x, w, cfg.steps)
    outputs = {}
    for layout in options.LAYOUTS:
        ws = torch_chain.make_weights(w, cfg.steps, layout, cfg.dtype)
        runner = torch_chain.runner(
            "torch_compile", x, ws, dtype_name=cfg.dtype, n=n, compile_mode=mode
        )
        assert runner.per_call == n and runner.compile_seconds > 0
        runner.fn()
        runner.sync()
        outputs[layout] = runner.output()
        assert report.agreement(runner.one_chain(), ref, cfg.dtype, cfg.steps)["ok"]
    assert report.same_bits(outputs["shared"], outputs["copies"])


@pytest.mark.gpu
def test_torch_graph_runner_keeps_what_its_graph_reads():
    """A captured graph holds raw pointers: the runner must keep x alive, or the allocator hands
    its memory to the next tensor and later replays read that tensor instead."""
    from experiments.torch_ref import chain as torch_chain

    if not torch_chain.cuda_available():
        pytest.skip("torch without CUDA")
    import torch

    cfg = small_config(d=256, steps=8)
    x, w = runners.host_values(cfg)
    ref = report.reference_chain(x, w, cfg.steps)
    ws = torch_chain.make_weights(w, cfg.steps, "shared", cfg.dtype)
    runner = torch_chain.runner("torch_graph", x, ws, dtype_name=cfg.dtype, n=2)
    clobber = [torch.full((1, 256), 7.0, device="cuda") for _ in range(64)]  # reuse freed blocks
    for _ in range(2):
        assert report.agreement(runner.output(), ref, cfg.dtype, cfg.steps)["ok"]
    del clobber
