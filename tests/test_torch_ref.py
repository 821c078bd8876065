"""experiments.torch_ref: Huginn in PyTorch (huginn.py) against the official reference vectors,
with the weights of the JAX model loaded from tests/data/huginn_tiny_a; the fast and compiled
Cores (core.py) against the reference-faithful one; the tensor-position compiled generation
(generation.py) against the eager one; the conformance checks (conformance.py). Skipped without
torch."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_A
from flax import nnx

import huginn_jax

torch = pytest.importorskip("torch", reason='needs PyTorch: pip install -e ".[torch]"')

from experiments.torch_ref import core as core_lib  # noqa: E402
from experiments.torch_ref import fast_layers  # noqa: E402
from experiments.torch_ref.conformance import (  # noqa: E402
    check_core_impl,
    check_generation_impl,
)
from experiments.torch_ref.core import (  # noqa: E402
    COMPILE_MODES,
    CompiledCore,
    FastCore,
    ReferenceCore,
    to_torch_fn,
)
from experiments.torch_ref.core_runner import TORCH_IMPLS  # noqa: E402
from experiments.torch_ref.generation import CompiledHuginn  # noqa: E402
from experiments.torch_ref.huginn import LOOPS, TorchHuginn, generate_greedy, run_loop  # noqa: E402
from huginn_jax.config import HuginnConfig  # noqa: E402
from huginn_jax.model import Core  # noqa: E402

TOL = dict(rtol=1e-4, atol=1e-4)  # the tolerance the conformance README states


@pytest.fixture(scope="module")
def reference():
    return np.load(TINY_A / "reference.npz")


@pytest.fixture(scope="module")
def jax_model():
    return huginn_jax.from_pretrained(TINY_A, dtype=jnp.float32)


def torch_model(jax_model, device: str) -> TorchHuginn:
    params = nnx.to_pure_dict(nnx.state(jax_model))
    return TorchHuginn(params, jax_model.config, to_torch_fn(device, torch.float32))


@pytest.fixture(scope="module")
def model(jax_model):
    return torch_model(jax_model, "cpu")  # float32 on the CPU: deterministic, no TF32


@pytest.mark.parametrize("num_steps", [1, 4, 8])
def test_full_sequence_logits(model, reference, num_steps):
    ids = torch.as_tensor(reference["input_ids"], dtype=torch.int64)
    model.setup_cache(batch=2, max_len=12, num_steps=num_steps)
    with torch.no_grad():
        logits = model.forward(ids, num_steps).numpy()
    assert logits.dtype == np.float32
    np.testing.assert_allclose(logits, reference[f"logits_steps{num_steps}"], **TOL)


@pytest.mark.parametrize("cache_steps", [4, 8])
def test_prefill_then_decode(model, reference, cache_steps):
    """As the reference's (c); a cache with more Core slots than used moves the coda slots."""
    ids = torch.as_tensor(reference["input_ids"], dtype=torch.int64)
    model.setup_cache(batch=2, max_len=12, num_steps=cache_steps)
    with torch.no_grad():
        token, last = model.prefill(ids[:, :8], num_steps=4)
        decoded = [model.decode_step(ids[:, p : p + 1], p, num_steps=4)[1] for p in range(8, 12)]
    np.testing.assert_allclose(last.numpy(), reference["logits_steps4"][:, 7], **TOL)
    np.testing.assert_array_equal(token.numpy(), reference["logits_steps4"][:, 7].argmax(-1))
    decoded = torch.stack(decoded, dim=1).numpy()
    np.testing.assert_allclose(decoded, reference["decode_logits_steps4"], **TOL)


def test_greedy_tokens(model, reference):
    gen = generate_greedy(model, reference["input_ids"][:, :6], 6, 4, graph=False)
    np.testing.assert_array_equal(gen.tokens, reference["greedy_tokens"])
    assert gen.logits.shape == (2, 6, 256) and len(gen.latencies_s) == 5 and not gen.capture_s


def test_bad_calls_fail_clearly(model):
    ids = torch.zeros((2, 3), dtype=torch.int64)
    model.setup_cache(batch=2, max_len=8, num_steps=2)
    with pytest.raises(ValueError, match="num_steps=3"):
        model.forward(ids, 3)
    with pytest.raises(ValueError, match="need start=0"):
        model.forward(ids, 2, start=1)
    with pytest.raises(ValueError, match="do not fit"):
        model.forward(torch.zeros((2, 9), dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="CUDA"):
        model.decode_graph(ids[:, :1], 3, 2)


@pytest.mark.gpu
def test_cuda_graph_decode_matches_eager_and_reference(jax_model, reference):
    """Weights shared with JAX through DLPack; graph replay per token = the eager loop."""
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    model = torch_model(jax_model, "cuda")
    # Zero copy: the tensor lives at the JAX buffer's address.
    wte = jax_model.wte[...]
    assert model.wte.data_ptr() == wte.unsafe_buffer_pointer()
    prompt = reference["input_ids"][:, :6]
    graph = generate_greedy(model, prompt, 6, 4, graph=True)
    eager = generate_greedy(model, prompt, 6, 4, graph=False)
    np.testing.assert_array_equal(graph.tokens, reference["greedy_tokens"])
    np.testing.assert_array_equal(eager.tokens, reference["greedy_tokens"])
    np.testing.assert_allclose(graph.logits, eager.logits, **TOL)
    assert len(graph.capture_s) == len(graph.latencies_s) == 5


# ---------------------------------------------------------------- the Core implementations

MICRO = HuginnConfig.from_name("micro")
CORE_TOL = dict(rtol=1e-5, atol=1e-5)  # float32, the same math in another order


def perturbed(params: dict, rng: np.random.Generator) -> dict:
    """The Core's pure dict as numpy, with norm weights 1 + 0.1 N(0, 1) and qk_bias 0.1 N(0, 1)
    instead of the init's ones and zeros, so that a misplaced norm weight or bias shows."""
    out = {}
    for key, value in params.items():
        if isinstance(value, dict):
            out[key] = perturbed(value, rng)
        elif key == "weight":
            out[key] = (1 + 0.1 * rng.standard_normal(value.shape)).astype(np.float32)
        elif key == "qk_bias":
            out[key] = (0.1 * rng.standard_normal(value.shape)).astype(np.float32)
        else:
            out[key] = np.asarray(value, dtype=np.float32)
    return out


def core_case(mode: str, iterations: int, seed: int = 0, *, max_len: int = 9):
    """float32 micro Core params, and inputs (state, embedded [B, T, D], start, K and V caches
    [r·L, B, max_len, H, K] full of random values: history, and stale positions past the new
    ones that attention must not read)."""
    rng = np.random.default_rng(seed)
    core = Core(MICRO, rngs=nnx.Rngs(params=seed), dtype=jnp.float32)
    params = perturbed(nnx.to_pure_dict(nnx.state(core)), rng)
    tokens, start = (1, max_len - 2) if mode == "decode" else (max_len - 3, 0)
    gen = torch.Generator().manual_seed(seed)
    state, embedded = (torch.randn(2, tokens, MICRO.n_embd, generator=gen) for _ in range(2))
    shape = (iterations * MICRO.n_core, 2, max_len, MICRO.n_heads, MICRO.head_dim)
    k, v = (torch.randn(shape, generator=gen) for _ in range(2))
    return params, (state, embedded, start, k, v)


def run_core(core, inputs, iterations: int):
    """`core.run_static` on copies of the caches: (output state, K cache, V cache)."""
    state, embedded, start, k, v = inputs
    k, v = k.clone(), v.clone()
    with torch.no_grad():
        out = core.run_static(state, embedded, iterations, start, k, v)
    return out, k, v


def assert_same_core_result(got, want):
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.numpy(), w.numpy(), **CORE_TOL)


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_fast_core_matches_the_reference_core(mode):
    """FastCore (F.rms_norm, cached complex RoPE, views, SDPA) computes what ReferenceCore
    computes: the output state and every cache slot, history and stale positions untouched."""
    params, inputs = core_case(mode, iterations=3)
    convert = to_torch_fn("cpu", torch.float32)
    want = run_core(ReferenceCore(params, MICRO, convert), inputs, 3)
    got = run_core(FastCore(params, MICRO, convert), inputs, 3)
    assert_same_core_result(got, want)
    state, _, start, k_in, _ = inputs
    new = slice(start, start + state.shape[1])
    k_out, layers = got[1], MICRO.n_core
    assert torch.equal(k_out[:, :, : new.start], k_in[:, :, : new.start])  # the history
    assert torch.equal(k_out[:, :, new.stop :], k_in[:, :, new.stop :])  # stale positions
    assert not torch.allclose(k_out[:, :, new], k_in[:, :, new])  # written
    assert not torch.allclose(k_out[:layers, :, new], k_out[layers : 2 * layers, :, new])


def test_fast_core_rejects_a_prefill_past_position_zero():
    params, (state, embedded, _, k, v) = core_case("prefill", iterations=1)
    core = FastCore(params, MICRO, to_torch_fn("cpu", torch.float32))
    with pytest.raises(ValueError, match="need start=0"):
        core.run_static(state, embedded, 1, 2, k, v)


def test_rope_tables_are_built_once_per_shape():
    params, inputs = core_case("decode", iterations=2)
    core = FastCore(params, MICRO, to_torch_fn("cpu", torch.float32))
    run_core(core, inputs, 2)
    run_core(core, inputs, 2)
    assert list(core._rope_tables) == [(inputs[2], 1)]
    table, freqs_cis = core.rope(inputs[2], 1)
    assert table.dtype == torch.float32 and freqs_cis.data_ptr() == table.data_ptr()


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_compiled_core_matches_the_reference_core_and_compiles_once(mode):
    """torch.compile (Inductor's C++ backend here) of one iteration, called r times with each
    iteration's slots: one graph for every iteration and call, no recompile, same numbers."""
    params, inputs = core_case(mode, iterations=3)
    convert = to_torch_fn("cpu", torch.float32)
    want = run_core(ReferenceCore(params, MICRO, convert), inputs, 3)
    core = CompiledCore(params, MICRO, convert)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = run_core(core, inputs, 3)
        again = run_core(core, inputs, 3)
    assert core.graphs_compiled() == 1
    assert_same_core_result(got, want)
    assert_same_core_result(again, got)


def test_core_factories_check_their_names():
    params, _ = core_case("decode", iterations=1)
    convert = to_torch_fn("cpu", torch.float32)
    with pytest.raises(ValueError, match="unknown core"):
        core_lib.make_core("fastest", params, MICRO, convert)
    with pytest.raises(ValueError, match="compile mode 'turbo'"):
        CompiledCore(params, MICRO, convert, mode="turbo")
    assert COMPILE_MODES[0] == "default"


def test_torch_huginn_with_the_fast_core_matches_the_reference(model, jax_model, reference):
    """TorchHuginn(core="fast"): the Core iterations by FastCore, prefill then decode."""
    fast = TorchHuginn(
        nnx.to_pure_dict(nnx.state(jax_model)),
        jax_model.config,
        to_torch_fn("cpu", torch.float32),
        core="fast",
    )
    assert isinstance(fast.core_loop, FastCore) and model.core_loop is model.core
    ids = torch.as_tensor(reference["input_ids"], dtype=torch.int64)
    fast.setup_cache(batch=2, max_len=12, num_steps=4)
    with torch.no_grad():
        fast.prefill(ids[:, :8], num_steps=4)
        decoded = [fast.decode_step(ids[:, p : p + 1], p, num_steps=4)[1] for p in range(8, 12)]
    decoded = torch.stack(decoded, dim=1).numpy()
    np.testing.assert_allclose(decoded, reference["decode_logits_steps4"], **TOL)


# ---------------------------------------------------------------- conformance


@pytest.mark.parametrize("impl", TORCH_IMPLS)
def test_conformance_check_passes_for_every_impl_on_cpu(impl):
    result = check_core_impl(impl, "cpu")
    assert result["impl"] == impl and result["tolerance"] == 1e-4
    assert result["passed"], result
    assert 0 <= result["max_abs_err"] < 1e-4  # the reference's own code may agree exactly


def test_conformance_check_fails_a_wrong_core(monkeypatch):
    """RoPE left out of FastCore: the check must notice."""
    monkeypatch.setattr(fast_layers, "_rope_complex", lambda x, freqs_cis: x)
    result = check_core_impl("torch_eager", "cpu")
    assert not result["passed"] and result["max_abs_err"] > 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("mode", COMPILE_MODES)
def test_conformance_check_passes_on_cuda(mode):
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    for impl in TORCH_IMPLS if mode == "default" else ("torch_compile",):
        result = check_core_impl(impl, "cuda", compile_mode=mode)
        assert result["passed"], result


# ---------------------------------------------------------------- compiled generation

COMPILED_TOL = dict(rtol=2e-5, atol=2e-5)  # float32, compiled vs eager: fused, reordered math


def params_of(jax_model) -> dict:
    return nnx.to_pure_dict(nnx.state(jax_model))


def test_compiled_decode_matches_the_eager_decode_and_compiles_once(model, jax_model, reference):
    """The tensor-position decode (index_copy_ at `pos`, masked attention over the whole cache,
    RoPE rows gathered by `pos`) at positions 8..11 after the compiled prefill: the eager
    TorchHuginn's logits and every cache slot, the reference's decode logits; six graphs, no
    recompile for a new position (error_on_recompile)."""
    ids = torch.as_tensor(reference["input_ids"], dtype=torch.int64)
    compiled = CompiledHuginn(
        params_of(jax_model), jax_model.config, to_torch_fn("cpu", torch.float32)
    )
    compiled.setup_cache(batch=2, max_len=12, num_steps=4)
    model.setup_cache(batch=2, max_len=12, num_steps=4)
    got, want = [], []
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        token, last = compiled.prefill(ids[:, :8])
        want_token, want_last = model.prefill(ids[:, :8], num_steps=4)
        for p in range(8, 12):
            compiled.ids.copy_(ids[:, p : p + 1])
            compiled.pos.fill_(p)
            got.append(compiled.decode_token()[1])
            want.append(model.decode_step(ids[:, p : p + 1], p, num_steps=4)[1])
    assert compiled.graphs_compiled() == 6
    assert torch.equal(token, want_token)
    np.testing.assert_allclose(last.numpy(), want_last.numpy(), **COMPILED_TOL)
    got, want = torch.stack(got, dim=1).numpy(), torch.stack(want, dim=1).numpy()
    np.testing.assert_allclose(got, want, **COMPILED_TOL)
    np.testing.assert_allclose(got, reference["decode_logits_steps4"], **TOL)
    for mine, eager in ((compiled.k, model.k_cache), (compiled.v, model.v_cache)):
        cache = torch.stack(mine)  # [slots, B, 16, H, K]: 12 positions rounded up to 16
        assert cache.shape == (eager.shape[0], 2, 16, *eager.shape[3:])
        np.testing.assert_allclose(cache[:, :, :12].numpy(), eager.numpy(), **COMPILED_TOL)
        assert not cache[:, :, 12:].any()  # nothing written past the last position


def test_compiled_generation_loop_on_cpu(jax_model, reference):
    """run_loop("torch_compile"): the reference's greedy tokens, the logits of the eager loop,
    one timed latency per decode token, compilation apart in setup_s, no CUDA graph here. Its
    trace hook gets the decode step back at the first decode position: two more calls decode
    tokens 1 and 2 again. The loops that capture per position refuse a hook."""
    convert = to_torch_fn("cpu", torch.float32)
    prompt = reference["input_ids"][:, :6]
    replayed = []

    def trace(step):
        replayed.extend(step()[0].clone() for _ in range(2))

    with torch._dynamo.config.patch(error_on_recompile=True):
        gen = run_loop(
            "torch_compile", params_of(jax_model), jax_model.config, convert, prompt, 6, 4,
            trace=trace,
        )  # fmt: skip
    np.testing.assert_array_equal(torch.stack(replayed, dim=1).numpy(), gen.tokens[:, 1:3])
    eager = run_loop(
        "torch_reference", params_of(jax_model), jax_model.config, convert, prompt, 6, 4
    )
    np.testing.assert_array_equal(gen.tokens, reference["greedy_tokens"])
    np.testing.assert_allclose(gen.logits, eager.logits, **COMPILED_TOL)
    assert gen.graphs_compiled == 6 and not gen.graph and gen.capture_s == []
    assert len(gen.latencies_s) == 5 and gen.setup_s > 0 and gen.prefill_s > 0
    with pytest.raises(ValueError, match="unknown torch loop"):
        run_loop("torch_fastest", {}, jax_model.config, convert, prompt, 6, 4)
    with pytest.raises(ValueError, match="only torch_compile is traced"):
        run_loop("torch_graph", {}, jax_model.config, convert, prompt, 6, 4, trace=trace)


def test_compiled_huginn_checks_its_calls(jax_model):
    convert = to_torch_fn("cpu", torch.float32)
    with pytest.raises(ValueError, match="compile mode 'turbo'"):
        CompiledHuginn(params_of(jax_model), jax_model.config, convert, mode="turbo")
    compiled = CompiledHuginn(params_of(jax_model), jax_model.config, convert)
    with pytest.raises(ValueError, match="no KV cache"):
        compiled.prefill(torch.zeros((2, 3), dtype=torch.int64))
    compiled.setup_cache(batch=2, max_len=4, num_steps=1)
    with pytest.raises(ValueError, match="do not fit"):
        compiled.prefill(torch.zeros((2, 17), dtype=torch.int64))


@pytest.mark.parametrize(
    "impl, mode", [(impl, "default") for impl in LOOPS] + [("torch_compile", "reduce-overhead")]
)
def test_generation_conformance_on_cpu(impl, mode, reference):
    """Each loop's greedy tokens (reduce-overhead: its static inputs and steps; Inductor has no
    CUDA graphs on the CPU)."""
    result = check_generation_impl(impl, "cpu", compile_mode=mode)
    assert result["passed"], result
    assert result["tokens"] == reference["greedy_tokens"].tolist()
    assert 0 < result["prefill_max_abs_err"] < 1e-4


def test_generation_conformance_fails_a_wrong_loop(monkeypatch):
    """RoPE left out of ReferenceCore (prelude, Core, coda of torch_reference): noticed."""
    monkeypatch.setattr(core_lib, "_rope", lambda x, positions, base: x)
    result = check_generation_impl("torch_reference", "cpu")
    assert not result["passed"] and result["prefill_max_abs_err"] > 1e-2


def built_or_xfail(build, *args, **kwargs):
    """`build(*args, **kwargs)`, or an xfail naming torch.compile's own failure to build a
    graph in that mode (`compile_failure`: what the programs leave out with a note), not this
    code's."""
    try:
        return build(*args, **kwargs)
    except Exception as e:
        if (why := core_lib.compile_failure(e)) is None:
            raise
        pytest.xfail(f"torch.compile failed to build this mode here: {why}")


def test_compile_failure_names_only_torch_compile_errors():
    import inspect

    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import InductorError

    inner = RuntimeError("NoValidChoicesError: \n\nSet TORCHDYNAMO_VERBOSE=1")
    why = core_lib.compile_failure(InductorError(inner, inspect.currentframe()))
    assert why == "InductorError: RuntimeError: NoValidChoicesError:"
    failed = BackendCompilerFailed("inductor", inner, inspect.currentframe())
    assert core_lib.compile_failure(failed).startswith("BackendCompilerFailed: ")
    assert core_lib.compile_failure(inner) is None  # the code's own error: not left out
    assert core_lib.compile_failure(torch.cuda.OutOfMemoryError("out of memory")) is None


@pytest.mark.gpu
@pytest.mark.parametrize("mode", COMPILE_MODES)
def test_generation_conformance_on_cuda(mode):
    """Each loop as the program runs it on the GPU (CUDA graphs; torch_compile in each mode)
    reproduces the reference's greedy tokens in float32."""
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    for impl in LOOPS if mode == "default" else ("torch_compile",):
        result = built_or_xfail(check_generation_impl, impl, "cuda", compile_mode=mode)
        assert result["passed"], result


@pytest.mark.gpu
@pytest.mark.parametrize("mode", COMPILE_MODES)
def test_compiled_generation_replays_graphs_on_cuda(jax_model, reference, mode):
    """On CUDA the compiled decode replays CUDA graphs (one captured graph, or Inductor's), from
    one compilation: the eager loop's logits at every position."""
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    convert = to_torch_fn("cuda", torch.float32)
    args = (params_of(jax_model), jax_model.config, convert, reference["input_ids"][:, :6], 6, 4)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            gen = built_or_xfail(run_loop, "torch_compile", *args, compile_mode=mode)
        eager = run_loop("torch_graph", *args)
    finally:
        torch.set_float32_matmul_precision(precision)
    assert gen.graph and gen.graphs_compiled == 6 and len(gen.latencies_s) == 5
    np.testing.assert_array_equal(gen.tokens, reference["greedy_tokens"])
    np.testing.assert_allclose(gen.logits, eager.logits, **TOL)


def test_fastest_compile_mode_means_every_mode():
    from experiments.torch_ref.core import COMPILE_MODES, compile_modes_for

    assert compile_modes_for("fastest") == COMPILE_MODES  # each timed, the fastest kept
    for mode in COMPILE_MODES:  # a named mode is the one timed
        assert compile_modes_for(mode) == (mode,)
