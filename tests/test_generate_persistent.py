"""Generation with core_decode="persistent": the decode steps' Core in the persistent kernel
(Pallas' GPU interpret mode on CPU, on a GPU as many workers as small's shapes allow) gives the
XLA path's logits; the plan's cache length and the fallback to XLA where the kernel cannot run."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import huginn_jax
from huginn_jax.config import HuginnConfig
from huginn_jax.generate import generate, make_plan
from huginn_jax.generate.loop import persistent_core
from huginn_jax.kv_cache import KVCache
from pallas_kernels.core_step.fused_plan import Schedule
from tests.tolerance import rel_fro

SMALL = HuginnConfig.from_name("small")  # D 256, 4 heads of 64: the kernel's checks pass
RTOL = 2e-2  # bf16 products in the kernel, bf16 activations in the model


@functools.cache
def small_bf16():
    return huginn_jax.random_init(SMALL, jax.random.key(0), dtype=jnp.bfloat16)


def test_persistent_decode_steps_give_the_xla_logits():
    """3 tokens of 1 Core iteration after a 5-token prompt: the prefill is XLA's in both; the
    two decode steps (the second reads the rows the first wrote) agree with XLA's."""
    ids = np.random.default_rng(0).integers(0, SMALL.vocab_size, (1, 5))
    settings = dict(init_scale=0.0, return_logits=True)
    got = generate(small_bf16(), ids, 3, 1, core_decode="persistent", **settings)
    assert got.stats["core_decode"] == "persistent" and got.stats["core_decode_fallback"] is None
    assert got.stats["persistent_schedule"] == str(Schedule())  # the kernel's default
    assert got.cache.max_len == 64  # 8 positions rounded up to a block
    want = generate(small_bf16(), ids, 3, 1, cache_len=64, **settings)
    assert want.stats["core_decode"] == "xla"
    np.testing.assert_array_equal(got.logits[:, 0], want.logits[:, 0])  # the prefill
    differ = np.nonzero(got.tokens[0] != want.tokens[0])[0]
    upto = 3 if differ.size == 0 else differ[0] + 1  # the same ids up to the first difference
    for n in range(1, upto):
        assert rel_fro(got.logits[:, n], want.logits[:, n]) <= RTOL, n


@pytest.mark.gpu
def test_persistent_greedy_decode_gives_the_xla_tokens_and_logits_gpu():
    """32 greedy tokens of 4 Core iterations after an 8-token prompt, on a GPU (the kernel on
    the workers small's shapes allow): the tokens are XLA's, and every decode step's logits
    agree with XLA's over the same cache length."""
    # a prompt (seed 3) whose greedy choices on the XLA path all lead the runner-up by at least
    # 0.2 in logit, far above the kernel's bf16 differences: the tokens can be compared exactly
    ids = np.random.default_rng(3).integers(0, SMALL.vocab_size, (1, 8))
    settings = dict(init_scale=0.0, return_logits=True)
    got = generate(small_bf16(), ids, 32, 4, core_decode="persistent", **settings)
    assert got.stats["core_decode"] == "persistent", got.stats["core_decode_fallback"]
    want = generate(small_bf16(), ids, 32, 4, cache_len=got.cache.max_len, **settings)
    assert want.stats["core_decode"] == "xla"
    np.testing.assert_array_equal(got.tokens, want.tokens)
    for n in range(1, 32):  # logits[:, 0] is the prefill's
        assert rel_fro(got.logits[:, n], want.logits[:, n]) <= RTOL, n


def test_plan_rounds_the_default_cache_length_for_persistent():
    ids = np.zeros((1, 5), np.int32)
    assert make_plan(SMALL, ids, 3, core_decode="persistent").cache_len == 64
    assert make_plan(SMALL, ids, 3).cache_len == 8
    assert make_plan(SMALL, ids, 3, core_decode="persistent", cache_len=16).cache_len == 16
    long = make_plan(SMALL, np.zeros((1, 100), np.int32), 20, core_decode="persistent")
    assert long.cache_len == 128  # 120 positions, at most the block size
    with pytest.raises(ValueError, match="core_decode='fused' must be one of"):
        make_plan(SMALL, ids, 3, core_decode="fused")


def test_plan_takes_the_persistent_schedule_and_its_blocks():
    """A schedule's blocks of 128 cached positions round the default cache length to 128; a
    schedule that does not parse, or one without core_decode="persistent", is refused."""
    ids = np.zeros((1, 5), np.int32)
    plan = make_plan(SMALL, ids, 3, core_decode="persistent", persistent_schedule="3:2:0:0:128")
    assert (plan.persistent_schedule, plan.cache_len) == ("3:2:0:0:128", 128)
    with pytest.raises(ValueError, match="persistent_schedule: '3' is not RING:KV_STAGES"):
        make_plan(SMALL, ids, 3, core_decode="persistent", persistent_schedule="3")
    with pytest.raises(ValueError, match="persistent_schedule='2:2' needs core_decode="):
        make_plan(SMALL, ids, 3, persistent_schedule="2:2")


def test_persistent_core_is_prepared_with_the_plans_schedule():
    """The decode steps' kernel takes the plan's schedule (checked by the kernel for the case,
    then packed for it)."""
    ids = np.zeros((1, 5), np.int32)
    plan = make_plan(SMALL, ids, 3, 1, core_decode="persistent", persistent_schedule="2:2")
    model = small_bf16()
    sizes = dict(batch=1, max_len=plan.cache_len, num_steps=1, dtype=jnp.bfloat16)
    cache = jax.eval_shape(lambda: KVCache.create(SMALL, **sizes))
    prepared, reason = persistent_core(model, plan, cache)
    assert reason is None and prepared.schedule == Schedule(2, 2)


def test_falls_back_to_xla_for_an_exit_criterion(capfd):
    """An exit criterion runs a number of iterations per sequence: the decode steps run XLA's
    Core, and one line on stderr says why. No decode step (1 token): nothing to say."""
    micro_cfg = HuginnConfig.from_name("micro")
    micro = huginn_jax.random_init(micro_cfg, jax.random.key(1), dtype=jnp.bfloat16)
    ids = np.zeros((1, 3), np.int32)
    gen = generate(micro, ids, 2, 2, core_decode="persistent", criterion="kl")
    assert gen.stats["core_decode"] == "xla"
    assert "exit criterion 'kl'" in gen.stats["core_decode_fallback"]
    single = generate(micro, ids, 1, 2, core_decode="persistent", init_scale=0.0)
    assert single.stats["core_decode"] == "xla" and single.stats["core_decode_fallback"] is None
    lines = [line for line in capfd.readouterr().err.splitlines() if "core_decode" in line]
    assert lines == [
        "core_decode=persistent: decoding with xla instead: the exit criterion 'kl' runs a "
        "number of iterations per sequence; the persistent Core runs a fixed count"
    ]


def test_cli_core_decode_falls_back_with_one_line(tmp_path):
    """`python -m huginn_jax.generate --core_decode=persistent` where the kernel refuses the
    shapes (micro's heads of 16 pad to 64 columns, more than D): XLA's Core generates, one line
    on stderr says why, and the JSON records it."""
    out = tmp_path / "out.json"
    result = subprocess.run(
        [
            sys.executable, "-m", "huginn_jax.generate", "--noprogress", "--config=micro",
            "--random_weights", "--prompt_len=4", "--max_new_tokens=3", "--num_steps=2",
            "--core_decode=persistent", f"--json_out={out}",
        ],
        capture_output=True, text=True, cwd=Path(__file__).parents[1], timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert data["flags"]["core_decode"] == "persistent"
    reason = data["stats"]["core_decode_fallback"]
    assert data["stats"]["core_decode"] == "xla" and "head_dim=16" in reason
    lines = [line for line in result.stderr.splitlines() if "core_decode" in line]
    assert lines == [f"core_decode=persistent: decoding with xla instead: {reason}"]
    assert data["stats"]["cache_bytes"] > 0 and len(data["tokens"][0]) == 3
