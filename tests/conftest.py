"""Shared test set-up: GPU-only tests (marked `gpu`) are skipped where JAX has no GPU; the data
folder, the micro model and helpers that several test files use."""

import dataclasses
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import huginn_jax
from huginn_jax.config import HuginnConfig

# Without a GPU (no nvidia-smi, as the Makefile decides), XLA's CPU backend compiles without
# LLVM's costly optimizations, in this process and in the programs the tests start (they inherit
# the environment): the tests' programs are small and run a few times each, so compiling them is
# most of the suite's time. The flags change how fast the compiled code runs, not what it
# computes (as in tests/test_parallel.py's children). JAX reads XLA_FLAGS when its backend
# starts, after this.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if shutil.which("nvidia-smi") is None:
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()

DATA = Path(__file__).parent / "data"
TINY_A = DATA / "huginn_tiny_a"
MICRO = HuginnConfig.from_name("micro")


@pytest.fixture(scope="module")
def micro():
    return huginn_jax.random_init(MICRO, jax.random.key(0))


def micro_prompt(batch, tokens, seed=1):
    return np.asarray(
        jax.random.randint(jax.random.key(seed), (batch, tokens), 0, MICRO.vocab_size)
    )


def prefill_then_decode(
    cfg, *, prompt_len: int, steps: int, max_len: int, seed: int, batch: int = 2
):
    """A fresh float32 model of `cfg` (weights from `seed`, the same for any cfg of one shape):
    prefill `prompt_len` random tokens into a `max_len` cache, then decode `steps` tokens one at
    a time, 2 Core iterations each. Returns the decode steps' logits [batch, steps, V] and the
    cache."""
    from huginn_jax.model import initial_state

    total = prompt_len + steps
    ids = jax.random.randint(jax.random.key(seed), (batch, total), 0, cfg.vocab_size)
    state = initial_state(
        cfg, (batch, total), init_scale=1.0, key=jax.random.key(seed + 1), dtype=jnp.float32
    )
    model = huginn_jax.random_init(cfg, jax.random.key(seed + 2))
    cache = huginn_jax.KVCache.create(cfg, batch=batch, max_len=max_len, num_steps=2)
    out = model(ids[:, :prompt_len], num_steps=2, init_state=state[:, :prompt_len], cache=cache)
    logits = []
    for position in range(prompt_len, total):
        out = model(
            ids[:, position : position + 1],
            num_steps=2,
            init_state=state[:, position : position + 1],
            cache=out.cache,
            start=position,
        )
        logits.append(out.logits)
    return np.concatenate(logits, axis=1), out.cache


def micro_decode_runs(field: str, impls, **run) -> list:
    """`prefill_then_decode(cfg, **run)` of the micro preset (blocks of 64) with the config
    field `field` set to each of `impls`, in order: the runs an impl is compared by."""
    micro = dataclasses.replace(MICRO, block_size=64)
    return [prefill_then_decode(dataclasses.replace(micro, **{field: i}), **run) for i in impls]


def core_step_jaxpr(cfg, batch: int) -> str:
    """The jaxpr, as text, of a decode Core step (2 iterations, no cache) of a Core of `cfg`
    (weights from seed 0) on `batch` sequences: what the model traces for that batch."""
    from flax import nnx

    from huginn_jax.model import Core, run_core

    core = Core(cfg, rngs=nnx.Rngs(0))
    state = jnp.ones((batch, 1, cfg.n_embd))
    return str(jax.make_jaxpr(lambda s: run_core(core, s, s, 0, None, 2))(state))


# The test items this run selected (after -k and -m), for fixtures that start work for them ahead.
SELECTED_ITEMS = pytest.StashKey[list]()


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected
def pytest_collection_modifyitems(config, items):
    config.stash[SELECTED_ITEMS] = items  # the list pytest runs
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
