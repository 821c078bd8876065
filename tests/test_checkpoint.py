"""Checkpoint loading: round trip, sharding, and one clear error for every kind of bad file."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_A
from safetensors.numpy import load_file, save_file

import huginn_jax
from huginn_jax.checkpoint import CheckpointError, param_table
from huginn_jax.config import HuginnConfig


@pytest.fixture
def tiny_copy(tmp_path):
    shutil.copy(TINY_A / "config.json", tmp_path / "config.json")
    return tmp_path, load_file(TINY_A / "model.safetensors")


def write(path, tensors):
    save_file(tensors, path / "model.safetensors")


def test_round_trip_is_bit_exact(tmp_path):
    cfg = HuginnConfig.from_name("micro")
    model = huginn_jax.random_init(cfg, jax.random.key(0))
    huginn_jax.save_pretrained(model, tmp_path)
    loaded = huginn_jax.from_pretrained(tmp_path)
    assert loaded.config == cfg
    ids = jax.random.randint(jax.random.key(1), (1, 5), 0, cfg.vocab_size)
    a = model(ids, num_steps=2, init_scale=0.0).logits
    b = loaded(ids, num_steps=2, init_scale=0.0).logits
    np.testing.assert_array_equal(a, b)


def test_reference_layout_freqs_cis_and_no_lm_head(tiny_copy):
    """What the reference's save_pretrained writes: a freqs_cis buffer, no tied lm_head."""
    path, tensors = tiny_copy
    tensors.pop("lm_head.weight")
    tensors["freqs_cis"] = np.zeros((1, 64, 1, 12, 2), np.float32)
    write(path, tensors)
    model = huginn_jax.from_pretrained(path)
    np.testing.assert_array_equal(model.wte[...], tensors["transformer.wte.weight"])


def test_sharded_checkpoint(tiny_copy):
    path, tensors = tiny_copy
    keys = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": keys[:40],
        "model-00002-of-00002.safetensors": keys[40:],
    }
    weight_map = {}
    for name, shard_keys in shards.items():
        save_file({k: tensors[k] for k in shard_keys}, path / name)
        weight_map.update({k: name for k in shard_keys})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = huginn_jax.from_pretrained(path)
    np.testing.assert_array_equal(
        model.adapter.kernel[...], tensors["transformer.adapter.weight"].T
    )


def test_bf16_dtype_loads_params_in_bf16():
    model = huginn_jax.from_pretrained(TINY_A, dtype=jnp.bfloat16)
    assert model.core_block[0].mlp.fc.kernel[...].dtype == jnp.bfloat16


def test_param_table_covers_every_parameter():
    cfg = HuginnConfig.from_name("tiny")
    model = huginn_jax.random_init(cfg, jax.random.key(0))
    n_model = sum(x.size for x in jax.tree.leaves(huginn_jax.model.nnx.state(model)))
    n_table = sum(int(np.prod(shape)) for _, shape, _ in param_table(cfg).values())
    assert n_model == n_table


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (
            lambda t: t.pop("transformer.core_block.2.mlp.fc.weight"),
            r"missing key transformer\.core_block\.2\.mlp\.fc",
        ),
        (lambda t: t.update(extra=np.ones(3, np.float32)), "unexpected key extra"),
        (
            lambda t: t.update({"transformer.adapter.weight": np.ones((96, 96), np.float32)}),
            r"transformer\.adapter\.weight: checkpoint shape \[96, 96\], model expects \[96, 192\]",
        ),
        (
            lambda t: t.update({"transformer.ln_f.weight": np.ones(96, np.int32)}),
            r"transformer\.ln_f\.weight: dtype I32 is not a floating-point type",
        ),
    ],
)
def test_bad_checkpoint_fails_with_one_clear_error(tiny_copy, corrupt, message):
    path, tensors = tiny_copy
    corrupt(tensors)
    write(path, tensors)
    with pytest.raises(CheckpointError, match=message):
        huginn_jax.from_pretrained(path)


def test_missing_files(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        huginn_jax.from_pretrained(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no config.json"):
        huginn_jax.from_pretrained(tmp_path)
    shutil.copy(TINY_A / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="neither model.safetensors"):
        huginn_jax.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "x.safetensors"}})
    )
    with pytest.raises(CheckpointError, match="x.safetensors, which does not exist"):
        huginn_jax.from_pretrained(tmp_path)
