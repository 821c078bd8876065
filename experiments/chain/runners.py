"""From one chain problem to something that runs it: weights in a layout, and one prepared
`Runner` per implementation (XLA forms, the persistent Pallas kernels; the PyTorch side lives in
experiments.torch_ref.chain and returns the same shape of runner).

Data path: `host_values` (numpy x and W) -> `make_weights` (device buffers, shared or copies)
-> `xla_runner` / `pallas_runner` / `torch_ref.chain.runner`, chosen by `build_runner`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from experiments.chain.options import PALLAS_IMPLS, ChainConfig, Options
from experiments.torch_ref import chain as torch_chain

# XLA impl (without _no_cmdbuf) -> (form of one product, how a call repeats the chain).
XLA_FORMS = {
    "xla": ("plain", "once"),
    "xla_loop": ("plain", "loop"),
    "xla_f32dot": ("f32dot", "once"),
    "xla_loop_f32dot": ("f32dot", "loop"),
    "xla_loop_unrolled": ("plain", "unrolled"),
}
# xla_loop_unrolled: at most this many products (chains x steps) in one call; the compile time
# of the unrolled function grows faster than linearly with them.
UNROLLED_MAX_PRODUCTS = 800
# Impls whose two layouts run different kernels: no bit-identity check between them.
_SPLITK_NOT_COMPARABLE = (
    "copies run the resident kernel; split-K also adds its partial sums in a run-dependent "
    "order (TMA reduce-add)"
)
LAYOUTS_NOT_COMPARABLE = {
    "pallas_splitk": _SPLITK_NOT_COMPARABLE,
    "pallas_splitk_no_cmdbuf": _SPLITK_NOT_COMPARABLE,
}


# ---------------------------------------------------------------- d -> weights


def host_values(cfg: ChainConfig) -> tuple[np.ndarray, np.ndarray]:
    """x [batch, d] and W [d, d] as numpy arrays of cfg's dtype, N(0, 1/d) so that |x| stays
    O(1) along the chain; the same seed gives the same values in every process."""
    rng = np.random.default_rng(cfg.seed)
    scale = np.float32(1.0 / math.sqrt(cfg.d))
    w = (rng.standard_normal((cfg.d, cfg.d), dtype=np.float32) * scale).astype(cfg.np_dtype)
    x = rng.standard_normal((cfg.batch, cfg.d), dtype=np.float32).astype(cfg.np_dtype)
    return x, w


def make_weights(w_host: np.ndarray, steps: int, layout: str) -> list[Any]:
    """`steps` JAX arrays [d, d]. shared: the same array object at every step (one buffer);
    copies: `steps` distinct device buffers with identical values. They reach the jitted chain
    as separate arguments, never as constants, so XLA cannot fold the copies into one."""
    import jax
    import jax.numpy as jnp

    w = jax.device_put(w_host)
    if layout == "shared":
        ws = [w] * steps
    elif layout == "copies":
        # device_put may alias host memory on CPU; jnp.array(copy=True) makes a new buffer.
        ws = [jnp.array(w, copy=True) for _ in range(steps)]
    else:
        raise ValueError(f"unknown layout {layout!r}")
    return jax.block_until_ready(ws)


def buffer_pointers(ws: Sequence[Any]) -> list[int]:
    """Device addresses of JAX arrays (to check that copies are distinct buffers)."""
    return [w.unsafe_buffer_pointer() for w in ws]


# ---------------------------------------------------------------- weights -> jitted chains


def _precision(x: Any) -> Any:
    """fp32 chains ask for true fp32 products: the default on GPUs may use TF32."""
    import jax
    import jax.numpy as jnp

    return jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None


def chain_fn(x: Any, *ws: Any) -> Any:
    """x [batch, d] through every W in order, each product `x @ w` in x's dtype (the dot
    accumulates in float32 inside): the fastest form of the chain."""
    import jax.numpy as jnp

    for w in ws:
        x = jnp.dot(x, w, precision=_precision(x))
    return x


def chain_f32dot_fn(x: Any, *ws: Any) -> Any:
    """The same math as `chain_fn`, each product a dot with a float32 result, then a cast to
    x's dtype (xla_f32dot, xla_loop_f32dot): XLA compiles it to other kernels."""
    import jax.numpy as jnp

    dtype, precision = x.dtype, _precision(x)
    for w in ws:
        x = jnp.dot(x, w, preferred_element_type=jnp.float32, precision=precision).astype(dtype)
    return x


CHAIN_FORMS = {"plain": chain_fn, "f32dot": chain_f32dot_fn}


def _loop_fn(x: Any, *ws: Any, n: int, form: str = "plain") -> Any:
    """n chains in one executable; each chain's output is the next one's input, so no chain
    can be hoisted out of the loop."""
    import jax

    return jax.lax.fori_loop(0, n, lambda _, x: CHAIN_FORMS[form](x, *ws), x)


def _unrolled_fn(x: Any, *ws: Any, n: int, form: str = "plain") -> Any:
    """As `_loop_fn`, with the n chains unrolled into one straight-line program (no while)."""
    for _ in range(n):
        x = CHAIN_FORMS[form](x, *ws)
    return x


@dataclasses.dataclass
class Runner:
    """A prepared implementation: `fn()` runs `per_call` chains; `output()` gives float32
    [batch, d] after `chains_in_output` chains from the initial state, `one_chain()` after one
    chain; `compile_seconds`: the first call, where it compiled the chain (else None)."""

    fn: Callable[[], Any]
    per_call: int
    sync: Callable[[], None] | None
    output: Callable[[], np.ndarray]
    chains_in_output: int
    one_chain: Callable[[], np.ndarray]
    compile_seconds: float | None = None


@functools.cache
def _jitted(form: str, repeat: str) -> Any:
    """The jitted chain of one product form, repeated "once", in a "loop" or "unrolled"."""
    import jax

    if repeat == "once":
        return jax.jit(CHAIN_FORMS[form])
    fn = {"loop": _loop_fn, "unrolled": _unrolled_fn}[repeat]
    return jax.jit(functools.partial(fn, form=form), static_argnames="n")


def unrolled_chains(n: int, steps: int) -> int:
    """Chains per call of xla_loop_unrolled: n, capped at UNROLLED_MAX_PRODUCTS products."""
    return max(1, min(n, UNROLLED_MAX_PRODUCTS // steps))


def xla_runner(impl: str, x: Any, ws: Sequence[Any], *, n: int) -> Runner:
    """The XLA impls (XLA_FORMS): one chain per call ("once") or n chains per call in a
    fori_loop or unrolled (at most `unrolled_chains`). The _no_cmdbuf variants differ only in the
    XLA_FLAGS of the process that runs them. The first call is timed: the compile time when
    it compiled (the other layout or size may have compiled the same executable before)."""
    import jax

    if impl.removesuffix("_no_cmdbuf") not in XLA_FORMS:
        raise ValueError(f"unknown xla impl {impl!r}")
    form, repeat = XLA_FORMS[impl.removesuffix("_no_cmdbuf")]
    f = _jitted(form, repeat)
    if repeat == "once":
        per_call = 1

        def call() -> Any:
            return f(x, *ws)

        def one() -> Any:
            return call()

    else:
        per_call = unrolled_chains(n, len(ws)) if repeat == "unrolled" else n

        def call() -> Any:
            return f(x, *ws, n=per_call)

        def one() -> Any:
            return f(x, *ws, n=1)

    cached = f._cache_size()
    t0 = time.perf_counter()
    jax.block_until_ready(call())
    first_call = time.perf_counter() - t0
    return Runner(
        fn=call,
        per_call=per_call,
        sync=None,
        output=lambda: np.asarray(call()).astype(np.float32),
        chains_in_output=per_call,
        one_chain=lambda: np.asarray(one()).astype(np.float32),
        compile_seconds=first_call if f._cache_size() > cached else None,  # None: compiled before
    )


def pallas_supported() -> bool:
    """Whether this device runs the persistent Pallas kernels (Mosaic GPU, sm_90)."""
    from pallas_kernels.looped_matmul import device_supported

    return device_supported()


def pallas_runner(x: Any, ws: list[Any], layout: str, variant: str, *, n: int) -> Runner:
    """The persistent kernel, all steps of a chain in one launch; `n` chains per call, each
    chain's output the next one's input, in one executable (as xla_loop and torch_graph, so
    that no dispatch is timed). shared: w used at every step, kernel `variant` ("resident" or
    "splitk"); copies: the step weights stacked [steps, d, d] (one allocation holding `steps`
    distinct copies), always the resident kernel."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.looped_matmul import (
        DeviceInfo,
        looped_matmul,
        looped_matmul_copies,
        pick_any_config,
    )

    steps = len(ws)
    if layout == "shared":
        w = ws[0]
        config = pick_any_config(
            x.shape[0], w.shape[0], variant=variant, device=DeviceInfo.current()
        )

        def one_chain(y: Any, w: Any) -> Any:
            return looped_matmul(y, w, steps, config=config)

    else:
        w = jnp.stack(ws)
        ws.clear()  # the stack holds the copies now

        def one_chain(y: Any, w: Any) -> Any:
            return looped_matmul_copies(y, w)

    loop = jax.jit(lambda x, w: jax.lax.fori_loop(0, n, lambda _, y: one_chain(y, w), x))
    once = jax.jit(one_chain)

    def call() -> Any:
        return loop(x, w)

    return Runner(
        fn=call,
        per_call=n,
        sync=None,
        output=lambda: np.asarray(call()).astype(np.float32),
        chains_in_output=n,
        one_chain=lambda: np.asarray(once(x, w)).astype(np.float32),
    )


def build_runner(
    impl: str, layout: str, x_host: np.ndarray, w_host: np.ndarray, cfg: ChainConfig, opts: Options
) -> tuple[Any, Callable[[], None]]:
    """Weights in `layout` and a Runner for `impl`; plus a function that frees the weights."""
    if impl in torch_chain.IMPLS:
        ws = torch_chain.make_weights(w_host, cfg.steps, layout, cfg.dtype)
        runner = torch_chain.runner(
            impl,
            x_host,
            ws,
            dtype_name=cfg.dtype,
            n=opts.chains_per_call,
            compile_mode=opts.torch_compile_mode,
        )

        def release() -> None:
            ws.clear()
            torch_chain.release()

        return runner, release
    import jax

    ws = make_weights(w_host, cfg.steps, layout)
    if impl in PALLAS_IMPLS:
        variant = "splitk" if impl.startswith("pallas_splitk") else "resident"
        runner = pallas_runner(jax.device_put(x_host), ws, layout, variant, n=opts.chains_per_call)
        return runner, ws.clear
    runner = xla_runner(impl, jax.device_put(x_host), ws, n=opts.chains_per_call)
    return runner, ws.clear
