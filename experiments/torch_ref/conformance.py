"""Does a PyTorch Core implementation compute Huginn? The conformance checkpoint's answer.

`check_core_impl` runs the whole tiny model of tests/data/huginn_tiny_a (made by the official
PyTorch code) in float32 through `TorchHuginn`, with the Core iterations computed by the impl's
own Core code, and compares the logits with the reference's: the timed impls of
`experiments.core` are then known to compute the model, not only to agree with one another.
`check_generation_impl` does the same for the generation loops of `experiments.generate_vs_torch`
(`huginn.LOOPS`): each runs the reference's greedy generation itself, CUDA graphs and
compiled code included. torch is imported lazily.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

TINY_A = Path(__file__).resolve().parents[2] / "tests" / "data" / "huginn_tiny_a"
TOLERANCE = 1e-4  # rtol = atol, as the checkpoint's README states
NUM_STEPS = 4
# Which Core code each impl of `core_runner.TORCH_IMPLS` times. torch_teaching runs
# ReferenceCore's layers (only its cache differs), so the reference check covers it.
CORE_OF_IMPL = {
    "torch_compile": "compiled",
    "torch_graph": "fast",
    "torch_eager": "fast",
    "torch_reference": "reference",
    "torch_teaching": "reference",
}


def check_core_impl(impl: str, device: str, compile_mode: str = "default") -> dict[str, Any]:
    """The full-sequence logits of huginn_tiny_a (num_steps 4, zero initial state) with `impl`'s
    Core on `device` ("cpu" or "cuda") against the reference's `logits_steps4`.

    Returns {"impl", "core", "max_abs_err", "tolerance", "passed"}, and "compile_mode" for the
    compiled Core (torch_compile): passed iff every logit lies
    within atol + rtol·|reference| (numpy's assert_allclose) at rtol = atol = TOLERANCE. The Core
    runs eagerly (no CUDA graph: a capture replays the same kernels), except torch_compile, which
    goes through torch.compile in `compile_mode` (three calls, the last one checked).
    """
    import jax.numpy as jnp
    import torch
    from flax import nnx

    import huginn_jax
    from experiments.torch_ref.core import CompiledCore, to_torch_fn
    from experiments.torch_ref.huginn import TorchHuginn

    if impl not in CORE_OF_IMPL:
        raise ValueError(f"unknown torch impl {impl!r}; known: {', '.join(CORE_OF_IMPL)}")
    core = CORE_OF_IMPL[impl]
    model = huginn_jax.from_pretrained(TINY_A, dtype=jnp.float32)
    reference = np.load(TINY_A / "reference.npz")
    params = nnx.to_pure_dict(nnx.state(model))
    factory = functools.partial(CompiledCore, mode=compile_mode) if core == "compiled" else core
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # float32 products, as JAX's (no TF32)
    try:
        tmodel = TorchHuginn(params, model.config, to_torch_fn(device, torch.float32), core=factory)
        ids = torch.as_tensor(reference["input_ids"], dtype=torch.int64, device=device)
        tmodel.setup_cache(batch=ids.shape[0], max_len=ids.shape[1], num_steps=NUM_STEPS)
        # torch_compile: the third call of "reduce-overhead" runs Inductor's CUDA graphs (the
        # first warms them up, the second records them); each call rewrites the same slots.
        with torch.no_grad():
            for _ in range(3 if core == "compiled" else 1):
                logits = tmodel.forward(ids, NUM_STEPS).float().cpu().numpy()
    finally:
        torch.set_float32_matmul_precision(precision)
        if core == "compiled":
            torch._dynamo.reset()  # frees the compiled code (and any CUDA-graph pools)
    expected = reference[f"logits_steps{NUM_STEPS}"]
    err = np.abs(logits - expected)
    passed = bool(
        logits.shape == expected.shape
        and np.all(np.isfinite(logits))
        and np.all(err <= TOLERANCE + TOLERANCE * np.abs(expected))
    )
    mode = {"compile_mode": compile_mode} if core == "compiled" else {}
    return {
        "impl": impl,
        "core": core,
        **mode,
        "max_abs_err": float(err.max()),
        "tolerance": TOLERANCE,
        "passed": passed,
    }


GREEDY_PROMPT = 6  # the reference's greedy generation: input_ids[:, :6], 6 new tokens


def check_generation_impl(
    impl: str, device: str, compile_mode: str = "default", warmup: int = 2
) -> dict[str, Any]:
    """The reference's greedy generation (README (d): prompt input_ids[:, :6], 6 new tokens,
    num_steps 4, zero initial state, KV cache) by the loop `impl` of `huginn.LOOPS` on
    `device`, float32, exactly as the timed loop runs (CUDA graphs on CUDA; torch_compile in
    `compile_mode`).

    Returns {"impl", "tokens", "tokens_equal", "prefill_max_abs_err", "tolerance", "passed"}:
    passed iff every token equals `greedy_tokens` and the prefill's logits (last prompt
    position) lie within TOLERANCE (atol + rtol·|reference|) of `logits_steps4[:, 5]`.
    """
    import jax.numpy as jnp
    import torch
    from flax import nnx

    import huginn_jax
    from experiments.torch_ref.core import to_torch_fn
    from experiments.torch_ref.huginn import LOOPS, run_loop

    if impl not in LOOPS:
        raise ValueError(f"unknown torch loop {impl!r}; known: {', '.join(LOOPS)}")
    model = huginn_jax.from_pretrained(TINY_A, dtype=jnp.float32)
    reference = np.load(TINY_A / "reference.npz")
    params = nnx.to_pure_dict(nnx.state(model))
    expected = reference["greedy_tokens"]
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # float32 products, as JAX's (no TF32)
    try:
        gen = run_loop(
            impl,
            params,
            model.config,
            to_torch_fn(device, torch.float32),
            reference["input_ids"][:, :GREEDY_PROMPT],
            expected.shape[1],
            NUM_STEPS,
            compile_mode=compile_mode,
            warmup=warmup,
        )
    finally:
        torch.set_float32_matmul_precision(precision)
    want = reference[f"logits_steps{NUM_STEPS}"][:, GREEDY_PROMPT - 1]
    err = np.abs(gen.logits[:, 0] - want)
    tokens_equal = bool(np.array_equal(gen.tokens, expected))
    close = bool(np.all(err <= TOLERANCE + TOLERANCE * np.abs(want)))
    return {
        "impl": impl,
        "tokens": gen.tokens.tolist(),
        "tokens_equal": tokens_equal,
        "prefill_max_abs_err": float(err.max()),
        "tolerance": TOLERANCE,
        "passed": tokens_equal and close,
    }
