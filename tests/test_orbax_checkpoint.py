"""Orbax training checkpoints: bit-exact round trip, keep-N, and bad steps reported and skipped."""

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from huginn_jax import train
from huginn_jax.config import HuginnConfig
from huginn_jax.files import CheckpointError
from huginn_jax.orbax_checkpoint import CheckpointMismatch, TrainCheckpoints, tree_digest

CFG = HuginnConfig(
    n_embd=16, n_heads=2, intermediate_size=24, vocab_size=16, block_size=16,
    n_layers_in_prelude=1, n_layers_in_recurrent_block=1, n_layers_in_coda=1,
)  # fmt: skip


@pytest.fixture(scope="module")
def state():
    """A TrainState whose Adam moments are non-zero (one update applied by hand)."""
    tcfg = train.TrainConfig(warmup_steps=0)
    tx = train.make_optimizer(tcfg)
    _, st = train.init_train_state(CFG, tx, seed=0)
    grads = jax.tree.map(lambda p: jnp.sin(jnp.arange(p.size, dtype=p.dtype)).reshape(p.shape),
                         st.params)  # fmt: skip
    updates, opt_state = jax.jit(tx.update)(grads, st.opt_state, st.params)
    return train.TrainState(
        jax.tree.map(jnp.add, st.params, updates), opt_state, jnp.int32(1), st.rng
    )._asdict()


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def save_steps(directory, state, steps, **kwargs):
    ckpt = TrainCheckpoints(directory, **kwargs)
    for s in steps:
        ckpt.save(s, {**state, "step": jnp.int32(s)}, {"who": "test"})
    ckpt.close()


def largest_data_file(step_dir: Path) -> Path:
    files = [Path(r) / f for r, _, fs in os.walk(step_dir / "state") for f in fs]
    return max((f for f in files if f.parent.name == "d"), key=lambda f: f.stat().st_size)


def test_round_trip_is_bit_exact(tmp_path, state):
    save_steps(tmp_path, state, [7])
    step, tree, meta = TrainCheckpoints(tmp_path).restore_latest(abstract(state))
    assert step == 7 and meta["step"] == 7 and meta["who"] == "test"
    expected = {**state, "step": jnp.int32(7)}
    assert jax.tree.structure(tree) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(tree), strict=True):
        assert np.asarray(a).dtype == np.asarray(b).dtype
        np.testing.assert_array_equal(a, b)
    assert meta["sha256"] == tree_digest(jax.device_get(expected))


def test_interval_and_keep_n(tmp_path, state):
    ckpt = TrainCheckpoints(tmp_path, max_to_keep=2, save_interval_steps=2)
    wrote = [ckpt.save(s, state, {}) for s in range(1, 7)]
    assert wrote == [False, True, False, True, False, True]
    assert ckpt.save(7, state, {}, force=True)
    ckpt.wait()
    assert ckpt.all_steps() == [6, 7]


# A failed tensorstore read leaves a callback that fires after orbax closed its event loop.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize(
    "damage, problem",
    [
        ("truncate", "unreadable"),
        ("flip", ""),  # a flipped byte: a decode error or the digest, either names the step
        ("drop_item", "incomplete"),
        ("drop_metadata", "unreadable"),
    ],
)
def test_bad_latest_step_is_reported_and_skipped(tmp_path, state, damage, problem):
    save_steps(tmp_path, state, [1, 2, 3])
    step_dir = tmp_path / "3"
    if damage == "truncate":
        f = largest_data_file(step_dir)
        os.truncate(f, f.stat().st_size // 2)
    elif damage == "flip":
        f = largest_data_file(step_dir)
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    elif damage == "drop_item":
        for p in sorted((step_dir / "state").rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
        (step_dir / "state").rmdir()
    else:
        (step_dir / "state" / "_METADATA").unlink()
    messages = []
    ckpt = TrainCheckpoints(tmp_path, max_to_keep=3, report=messages.append)
    step, tree, _ = ckpt.restore_latest(abstract(state))
    assert step == 2 and int(tree["step"]) == 2
    assert len(messages) == 1 and "\n" not in messages[0]
    assert "step 3" in messages[0] and problem in messages[0] and "trying step 2" in messages[0]
    assert (tmp_path / "corrupt-3").is_dir() and ckpt.all_steps() == [1, 2]
    # Training goes on from step 2: a new step 3 is written; keep-N never touches the bad copy.
    for s in (3, 4, 5):
        ckpt.save(s, state, {})
    ckpt.wait()
    assert ckpt.all_steps() == [3, 4, 5] and (tmp_path / "corrupt-3").is_dir()


def test_missing_and_all_bad(tmp_path, state):
    messages = []
    assert (
        TrainCheckpoints(tmp_path / "empty", report=messages.append).restore_latest(abstract(state))
        is None
    )
    assert messages == [f"checkpoint: no checkpoint in {tmp_path / 'empty'}"]
    save_steps(tmp_path / "bad", state, [1, 2])
    for step in (1, 2):
        (tmp_path / "bad" / str(step) / "meta").rename(tmp_path / "bad" / str(step) / "gone")
    messages.clear()
    ckpt = TrainCheckpoints(tmp_path / "bad", report=messages.append)
    # Nothing intact to resume from is an error naming the directory, not a fresh start.
    with pytest.raises(CheckpointError, match="every checkpoint is damaged") as error:
        ckpt.restore_latest(abstract(state))
    assert str(error.value).startswith(f"{tmp_path / 'bad'}: ") and "steps 1, 2" in str(error.value)
    assert "step 2" in messages[0] and f"{tmp_path / 'bad' / '2'}: incomplete" in messages[0]
    assert "step 1" in messages[1] and "no older checkpoint left" in messages[1]
    with pytest.raises(
        CheckpointError, match=r"only damaged ones set aside \(corrupt-1, corrupt-2\)"
    ):
        TrainCheckpoints(tmp_path / "bad").restore_latest(abstract(state))


def test_another_runs_checkpoint_is_refused_not_set_aside(tmp_path, state):
    save_steps(tmp_path, state, [1])
    ckpt = TrainCheckpoints(tmp_path)
    wrong = {**abstract(state), "rng": jax.ShapeDtypeStruct((3,), jnp.uint32)}
    with pytest.raises(CheckpointMismatch, match=r"\['rng'\] uint32\[2\].*expects.*uint32\[3\]"):
        ckpt.restore_latest(wrong)
    wrong = {**abstract(state), "step": jax.ShapeDtypeStruct((), jnp.float32)}
    with pytest.raises(CheckpointMismatch, match="float32"):
        ckpt.restore_latest(wrong)

    def validate(meta):
        if meta["who"] != "me":
            raise CheckpointMismatch(f"written by {meta['who']}")

    with pytest.raises(CheckpointMismatch, match="written by test"):
        ckpt.restore_latest(abstract(state), validate=validate)
    assert ckpt.all_steps() == [1]
