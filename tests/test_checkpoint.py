"""Checkpoint loading: round trip, sharding, and one clear error for every kind of bad file."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_A
from flax import nnx
from program_runs import run_forked
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


def test_bf16_checkpoint_round_trip_is_bit_exact(tmp_path):
    """huginn-0125 ships bf16 tensors: they are read as host numpy (ml_dtypes' bfloat16)."""
    cfg = HuginnConfig.from_name("micro")
    model = huginn_jax.random_init(cfg, jax.random.key(2), dtype=jnp.bfloat16)
    huginn_jax.save_pretrained(model, tmp_path)
    loaded = huginn_jax.from_pretrained(tmp_path, dtype=jnp.bfloat16)
    want = jax.tree.leaves(nnx.state(model, nnx.Param))
    got = jax.tree.leaves(nnx.state(loaded, nnx.Param))
    assert len(got) == len(want) and all(g.dtype == jnp.bfloat16 for g in got)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


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


# ---------------------------------------------------------------- damaged files


def _damage_weights(path, how):
    """Damages path/model.safetensors in place: truncated, random bytes, empty, or a header
    length past the end of the file."""
    import struct

    file = path / "model.safetensors"
    data = file.read_bytes()
    damaged = {
        "truncated": data[: len(data) // 2],
        "random": np.random.default_rng(0).bytes(4096),
        "empty": b"",
        "header_length": struct.pack("<Q", 10**12) + data[8:],
    }[how]
    file.write_bytes(damaged)


@pytest.mark.parametrize(
    "how, message",
    [
        ("truncated", "truncated or damaged"),
        ("random", "runs past the end of the file"),
        ("empty", "0 bytes, too short for a safetensors file"),
        ("header_length", r"header length \(1000000000000 bytes\) runs past the end"),
    ],
)
def test_damaged_weights_file_is_one_error_naming_it(tiny_copy, how, message):
    path, tensors = tiny_copy
    write(path, tensors)
    _damage_weights(path, how)
    with pytest.raises(CheckpointError, match=message) as error:
        huginn_jax.from_pretrained(path)
    assert str(error.value).startswith(f"{path / 'model.safetensors'}: ")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.update(n_heads="four"), """key 'n_heads' is "four"; expected an integer"""),
        (lambda c: c.update(n_heads=2.5), "key 'n_heads' is 2.5; expected an integer"),
        (lambda c: c.pop("n_embd"), "key 'n_embd' is missing"),
        (lambda c: c.update(qk_bias="yes"), """key 'qk_bias' is "yes"; expected true or false"""),
        (lambda c: c.update(init_values=3), "key 'init_values' is 3; expected an object"),
        (lambda c: c["init_values"].update(std="x"), "key 'init_values.std' is"),
        (lambda c: c.update(n_layers_in_coda=-1), "n_layers_in_coda=-1 must be >= 0"),
        (lambda c: c.update(n_heads=5), "n_embd=96 must be a multiple of n_heads=5|head_dim"),
    ],
)
def test_bad_config_json_names_the_file_and_the_key(tiny_copy, edit, message):
    path, _ = tiny_copy
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message) as error:
        huginn_jax.from_pretrained(path)
    assert str(error.value).startswith(f"{path / 'config.json'}: ")


def test_config_json_that_is_not_json(tmp_path):
    for text, message in (("{", "not valid JSON"), ("[1]", "expected a JSON object, found list")):
        (tmp_path / "config.json").write_text(text)
        with pytest.raises(CheckpointError, match=message):
            HuginnConfig.from_hf_json(tmp_path / "config.json")


def test_missing_or_misshapen_tensor_names_file_and_key(tiny_copy):
    path, tensors = tiny_copy
    write(path, {k: v for k, v in tensors.items() if k != "transformer.ln_f.weight"})
    with pytest.raises(CheckpointError, match=r"missing key transformer\.ln_f\.weight") as error:
        huginn_jax.from_pretrained(path)
    assert str(error.value).startswith(f"{path / 'model.safetensors'}: ")


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_saved_files_get_the_usual_mode(tmp_path, umask):
    """save_pretrained and the atomic writers of huginn_jax and of the experiments (results
    JSON, plots) give a file the mode open() would (0666 less the umask), not the temporary
    file's 0600, and leave no temporary file behind."""
    import os

    from experiments.measure import results
    from huginn_jax.files import write_atomic, write_text_atomic

    previous = os.umask(umask)
    try:
        model = huginn_jax.random_init(HuginnConfig.from_name("micro"), jax.random.key(0))
        huginn_jax.save_pretrained(model, tmp_path / "out")
        write_text_atomic(tmp_path / "out" / "a.json", "{}\n")
        results.write_json_atomic(tmp_path / "out" / "b.json", {})
        write_atomic(tmp_path / "out" / "c.png", lambda tmp: tmp.write_bytes(b""))
    finally:
        os.umask(previous)
    names = ["a.json", "b.json", "c.png", "config.json", "model.safetensors"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == names
    for name in names:
        assert (tmp_path / "out" / name).stat().st_mode & 0o777 == 0o666 & ~umask, name


def test_programs_end_a_damaged_model_in_one_line(tiny_copy):
    """`python -m huginn_jax.generate` and an experiment program (through experiments.cli's
    runner, as core and generate_vs_torch use it): one line naming the file, exit status 2."""
    import subprocess
    import sys

    path, tensors = tiny_copy
    write(path, tensors)
    _damage_weights(path, "truncated")
    repo = Path(__file__).parents[1]
    generate = run_forked(
        "huginn_jax.generate", f"--checkpoint={path}", "--prompt_ids=1,2", cwd=repo
    )
    assert generate.returncode == 2
    assert generate.stderr.splitlines() == [
        f"generate: {path / 'model.safetensors'}: truncated or damaged (its header's "
        f"tensors do not fill the {(path / 'model.safetensors').stat().st_size} bytes of the file)"
    ]
    script = (
        "import sys; from absl import app; import huginn_jax; from experiments import cli; "
        "main = lambda argv: huginn_jax.from_pretrained(sys.argv[1]); "
        "app.run(cli.main_runner('prog', main), argv=sys.argv[:1])"
    )
    program = subprocess.run(
        [sys.executable, "-c", script, str(path)],
        capture_output=True, text=True, cwd=repo, timeout=120,
    )  # fmt: skip
    assert program.returncode == 2
    lines = [line for line in program.stderr.splitlines() if "tpu" not in line.lower()]
    assert len(lines) == 1, program.stderr
    assert lines[0].startswith(f"prog: {path / 'model.safetensors'}: truncated or damaged")
