"""huginn_jax.parallel: the Megatron layout, the model and its cache on a mesh, data-parallel
training, the cost of the split and of its all-reduces, and the programs' --mesh flags.

The multi-device checks run in child processes (tests/parallel_worker.py): a CPU jax has as many
devices as XLA_FLAGS=--xla_force_host_platform_device_count says when it starts. All children
start together at the first test that needs one, so their compilations share the machine's
cores; XLA's CPU backend optimizations are off there (compile time, not numerics, is what they
change), and each child's output is one JSON object.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh

from experiments.cli import UserError
from huginn_jax import comm_costs, huginn_0125, parallel
from huginn_jax.config import HuginnConfig
from huginn_jax.layers import Attention, GatedMLP

ROOT = Path(__file__).resolve().parent.parent
TOL = 1e-4  # float32: one device vs the mesh, max abs difference
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# name: (devices, command after `python`)
CHILDREN = {
    "model": (4, "tests/parallel_worker.py model:2,4"),
    "generation_train": (2, "tests/parallel_worker.py generation:2 program:2 train:2"),
    "allreduce": (
        2,
        "-m experiments.allreduce --context=256 --sweep=1 --chain=2 --warmup=1 --repeats=3 "
        "--json_out={tmp}/allreduce.json",
    ),
    "core": (
        2,
        "-m experiments.core --mesh=model:2 --impls=xla,xla_pallas --mode=decode --context=8 "
        "--iterations=1 --warmup=0 --repeats=1 --config=tiny --json_out={tmp}/core.json",
    ),
}


@pytest.fixture(scope="module")
def children(tmp_path_factory):
    """Every child started at once, its stdout and stderr into files (a full pipe would stall a
    child while another is awaited); `children(name)` waits for one and returns (its stdout, the
    folder its files are in)."""
    tmp = tmp_path_factory.mktemp("parallel")
    started = {}
    for name, (devices, args) in CHILDREN.items():
        env = {
            **os.environ,
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}",
            "JAX_PLATFORMS": "cpu",
        }
        command = [sys.executable, *args.format(tmp=tmp).split()]
        with open(tmp / f"{name}.out", "w") as out, open(tmp / f"{name}.err", "w") as err:
            started[name] = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=err)
    finished = {}

    def wait(name: str):
        if name not in finished:
            code = started[name].wait(timeout=600)
            err = (tmp / f"{name}.err").read_text()
            assert code == 0, f"{name} failed:\n{err[-3000:]}"
            finished[name] = ((tmp / f"{name}.out").read_text(), tmp)
        return finished[name]

    yield wait
    for process in started.values():
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def model_results(children):
    return json.loads(children("model")[0])["model"]


@pytest.fixture(scope="module")
def generation_train(children):
    return json.loads(children("generation_train")[0])


# ---------------------------------------------------------------- on 2 and 4 devices


@pytest.mark.parametrize("devices", ["2", "4"])
@pytest.mark.parametrize("model", ["tiny", "uneven"])
def test_outputs_match_one_device(model_results, devices, model):
    """Prefill logits and latents and cached decode logits: the conformance checkpoint (4 heads,
    divisible) and a random model with 3 heads and 50 MLP columns (padded on either mesh)."""
    errors = model_results[devices][model]
    assert set(errors) == {"prefill_logits", "prefill_latents", "decode_logits"}
    assert max(errors.values()) < TOL, errors
    assert model_results[devices]["tiny_vs_reference"] < TOL


@pytest.mark.parametrize("devices", [2, 4])
def test_params_and_cache_are_split(model_results, devices):
    layout = model_results[str(devices)]["layout"]
    tiny, uneven = layout["tiny"], layout["uneven"]
    assert tiny["devices"] == uneven["devices"] == devices
    for shapes in (tiny, uneven):
        d, columns = shapes["wqkv_global"]
        assert shapes["wqkv_local"] == [d, columns // devices]
        assert shapes["fc_local"] == [d, shapes["fc_global"][1] // devices]
        assert shapes["attn_proj_local"][0] == columns // 3 // devices
        slots, batch, positions, heads, head_dim = shapes["cache_global"]
        assert shapes["cache_local"] == [slots, batch, positions, heads // devices, head_dim]
        assert shapes["wte_local"][0] in (256, 40)  # the embedding stays whole
    # 3 heads -> 4; 50 MLP columns -> 50 on 2 devices, 52 on 4.
    assert model_results[str(devices)]["uneven_padded"] == [4, 50 if devices == 2 else 52]
    assert model_results[str(devices)]["gather_roundtrip"] == 0.0


@pytest.mark.parametrize("devices", ["2", "4"])
def test_two_all_reduces_per_layer(model_results, devices):
    """The compiled HLO: 2 all-reduces in one Core layer (prefill and decode), 8 in one decode
    Core iteration (4 layers; the adapter, replicated, adds none)."""
    assert model_results[devices]["hlo"] == {
        "prefill_layer": 2,
        "decode_layer": 2,
        "decode_iteration": 8,
    }


def test_generation_tokens_match_one_device(generation_train):
    """The tokens one device gives (test_generate pins them to the reference's)."""
    out = generation_train["generation"]["2"]
    assert out["greedy"] == out["reference_greedy"]
    assert out["adaptive"] == out["reference_adaptive"]
    assert out["adaptive_steps"][0] == out["reference_adaptive_steps"]
    assert out["cache_devices"] == 2
    assert out["load_vs_shard_model"] == 0.0 and out["load_same_shardings"]


def test_generate_program_on_a_mesh_matches_one_device(generation_train):
    """`python -m huginn_jax.generate --mesh=model:2 --checkpoint=...`: the reference's greedy
    tokens, which one device gives (test_generate)."""
    out = generation_train["program"]["2"]
    want = generation_train["generation"]["2"]["reference_greedy"][0]
    assert out["tokens"] == [want, want]
    assert out["counted"] == [2, 4]  # model shards, the cache's heads


def test_data_parallel_losses_match_one_device(generation_train):
    losses = generation_train["train"]["2"]
    np.testing.assert_allclose(losses["mesh"], losses["one"], rtol=1e-5)
    assert losses["one_param_devices"] == 1 and losses["mesh_param_devices"] == 2


def test_allreduce_probe_writes_a_fit(children):
    out, tmp = children("allreduce")
    data = json.loads((tmp / "allreduce.json").read_text())
    cases = {r["case"] for r in data["records"]}
    assert {"decode B=1", "prefill B=1 T=256"} <= cases
    assert {r["bytes"] for r in data["records"] if r["case"] == "decode B=1"} == {5280 * 2}
    model = comm_costs.AllReduceModel.from_results(data, 2)
    assert model.latency_s >= 0 and model.bytes_per_s > 0
    assert "fit 2 devices" in out.splitlines()[-1]


def test_core_program_runs_on_a_mesh(children):
    out, tmp = children("core")
    data = json.loads((tmp / "core.json").read_text())
    (record,) = data["records"]
    assert record["impl"] == "xla" and record["model_shards"] == 2
    assert record["comm"]["all_reduces"] == 8
    assert record["comm"]["bytes_per_all_reduce"] == 96 * 2  # decode, B=1, tiny's n_embd, bf16
    assert "skipped with --mesh=model:2" in out


# ---------------------------------------------------------------- one device: arithmetic, errors


def on(shards: int, cfg: HuginnConfig) -> HuginnConfig:
    """`cfg` laid out for `shards` devices (an abstract mesh: layout without devices)."""
    return dataclasses.replace(cfg, mesh=AbstractMesh((shards,), (parallel.MODEL_AXIS,)))


UNEVEN = HuginnConfig(n_embd=36, n_heads=3, intermediate_size=50, vocab_size=40, block_size=16)


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_group_qkv_gives_each_device_whole_heads(shards):
    cfg = on(shards, UNEVEN)
    d, h, hp, k = cfg.n_embd, cfg.n_heads, cfg.attention_heads, cfg.head_dim
    kernel = jnp.tile(jnp.arange(3 * h * k, dtype=jnp.float32) + 1, (d, 1))  # column c holds c+1
    grouped = np.asarray(parallel.group_qkv(kernel, cfg))
    assert grouped.shape == (d, 3 * hp * k)
    per_device = hp // shards
    for device, block in enumerate(np.split(grouped[0], shards)):
        block = block.reshape(3, per_device, k)
        for part in range(3):
            for local in range(per_device):
                head = device * per_device + local
                want = part * h * k + head * k + np.arange(k) + 1 if head < h else np.zeros(k)
                np.testing.assert_array_equal(block[part, local], want)
    np.testing.assert_array_equal(parallel.ungroup_qkv(jnp.asarray(grouped), cfg), kernel)


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_group_gate_up_keeps_gate_and_up_side_by_side(shards):
    cfg = on(shards, UNEVEN)
    f, fp = cfg.intermediate_size, cfg.mlp_width
    kernel = jnp.tile(jnp.arange(2 * f, dtype=jnp.float32) + 1, (cfg.n_embd, 1))
    grouped = np.asarray(parallel.group_gate_up(kernel, cfg))
    width = fp // shards
    for device, block in enumerate(np.split(grouped[0], shards)):
        columns = np.arange(device * width, (device + 1) * width)
        for half in range(2):
            want = np.where(columns < f, half * f + columns + 1, 0)
            np.testing.assert_array_equal(block[half * width : (half + 1) * width], want)
    np.testing.assert_array_equal(parallel.ungroup_gate_up(jnp.asarray(grouped), cfg), kernel)


def test_layers_built_for_a_mesh_hold_the_layout():
    """A layer constructed under a mesh config holds the grouped, zero-padded weights of the
    same draw without one."""
    cfg = on(4, UNEVEN)

    @jax.jit
    def weights():
        def of(layer, config, seed):
            return nnx.to_pure_dict(
                nnx.state(layer(config, rngs=nnx.Rngs(seed), dtype=jnp.float32))
            )

        layers = ((Attention, 0), (GatedMLP, 1))
        return [of(layer, c, seed) for layer, seed in layers for c in (UNEVEN, cfg)]

    attn, attn_split, mlp, mlp_split = weights()
    np.testing.assert_array_equal(
        attn_split["Wqkv"]["kernel"], parallel.group_qkv(attn["Wqkv"]["kernel"], cfg)
    )
    proj = attn_split["proj"]["kernel"]
    np.testing.assert_array_equal(proj[: UNEVEN.n_embd], attn["proj"]["kernel"])
    assert not np.any(proj[UNEVEN.n_embd :]) and not np.any(attn_split["qk_bias"][:, :, 3:])
    np.testing.assert_array_equal(
        mlp_split["fc"]["kernel"], parallel.group_gate_up(mlp["fc"]["kernel"], cfg)
    )


def test_mesh_config_errors():
    mesh = parallel.make_mesh({"model": 1})
    cfg = dataclasses.replace(UNEVEN, mesh=mesh)
    assert (cfg.model_shards, cfg.attention_heads, cfg.mlp_width) == (1, 3, 50)
    for choice in (dict(decode_attention_impl="pallas"), dict(attention_impl="mgpu")):
        with pytest.raises(ValueError, match="runs on one device"):
            dataclasses.replace(cfg, **choice)
    for gemv in ("pallas", "xla_rows8"):
        with pytest.raises(ValueError, match="batch-1 path of one device"):
            dataclasses.replace(cfg, decode_gemv=gemv)
    with pytest.raises(ValueError, match="needs 'model'"):
        dataclasses.replace(UNEVEN, mesh=parallel.make_mesh({"data": 1}))
    with pytest.raises(ValueError, match="needs 2 devices"):
        parallel.make_mesh("model:2")


@pytest.mark.parametrize(
    "spec, sizes",
    [
        ("model:2", {"model": 2}),
        ("data:2,model:4", {"data": 2, "model": 4}),
        (" model:1 ", {"model": 1}),
    ],
)
def test_parse_mesh_spec(spec, sizes):
    assert parallel.parse_mesh_spec(spec) == sizes


@pytest.mark.parametrize("spec", ["", "model", "model:0", "tensor:2", "model:2,model:2", "model:x"])
def test_parse_mesh_spec_errors(spec):
    with pytest.raises(ValueError, match="mesh"):
        parallel.parse_mesh_spec(spec)


def test_layout_cost_of_huginn_0125():
    """55 heads pad to 56 on 2, 4 and 8 devices; the 17920 MLP columns divide."""
    d, k = 5280, 96
    one = parallel.layout_cost(huginn_0125, 1)
    assert one.block_padding_bytes == 0 and one.core_ratio == 1.0
    block_params = 4 * d * 55 * k + 2 * 55 * k + 3 * d * 17920
    assert one.block_bytes == (block_params + 4 * d) * 2
    for shards in (2, 4, 8):
        cost = parallel.layout_cost(huginn_0125, shards)
        assert (cost.padded_heads, cost.padded_mlp_width) == (56, 17920)
        padded_head = 4 * d * k + 2 * k  # Wqkv columns, qk_bias, proj rows of one head
        assert cost.block_padding_bytes == padded_head * 2 // shards
        assert cost.block_padding_flops == 2 * 4 * d * k // shards
        assert cost.attention_padding == pytest.approx(1 / 55)
        # Per device: the replicated adapter whole, the blocks split.
        assert cost.core_bytes == cost.adapter_bytes + 4 * cost.block_bytes
        assert 1 / shards < cost.core_ratio < 1 / shards + cost.adapter_bytes / one.core_bytes


def test_core_iteration_comm():
    decode = comm_costs.core_iteration_comm(
        huginn_0125, batch=2, context=4096, mode="decode", devices=4
    )
    assert (decode.all_reduces, decode.bytes_per_all_reduce) == (8, 2 * 5280 * 2)
    assert decode.bytes == 8 * 2 * 5280 * 2 and decode.seconds is None
    model = comm_costs.AllReduceModel(devices=4, latency_s=10e-6, bytes_per_s=100e9)
    prefill = comm_costs.core_iteration_comm(
        huginn_0125, batch=1, context=1024, mode="prefill", devices=4, model=model
    )
    assert prefill.bytes_per_all_reduce == 1024 * 5280 * 2
    assert prefill.seconds == pytest.approx(8 * (10e-6 + 1024 * 5280 * 2 / 100e9))
    single = comm_costs.core_iteration_comm(
        huginn_0125, batch=1, context=1, mode="decode", devices=1
    )
    assert single.all_reduces == 0 and single.bytes == 0
    with pytest.raises(ValueError, match="for 4 devices"):
        comm_costs.core_iteration_comm(
            huginn_0125, batch=1, context=1, mode="decode", devices=2, model=model
        )


def test_allreduce_model_fit():
    sizes = [10_000, 100_000, 1_000_000, 10_000_000]
    seconds = [12e-6 + s / 50e9 for s in sizes]
    model = comm_costs.AllReduceModel.fit(2, sizes, seconds)
    assert model.latency_s == pytest.approx(12e-6) and model.bytes_per_s == pytest.approx(50e9)
    assert model.seconds(1_000) == pytest.approx(12e-6 + 1_000 / 50e9)
    with pytest.raises(ValueError, match="two distinct sizes"):
        comm_costs.AllReduceModel.fit(2, [10, 10], [1e-6, 2e-6])
    with pytest.raises(ValueError, match="do not grow"):
        comm_costs.AllReduceModel.fit(2, [10, 100], [2e-6, 1e-6])
    data = {"fits": [{"devices": 2, "latency_s": 1e-5, "bytes_per_s": 1e11}]}
    assert comm_costs.AllReduceModel.from_results(data, 2).bytes_per_s == 1e11
    with pytest.raises(ValueError, match="no fit for 4"):
        comm_costs.AllReduceModel.from_results(data, 4)


def test_programs_refuse_a_bad_mesh():
    from absl import flags

    from experiments import allreduce
    from experiments.core import mesh as core_mesh
    from experiments.train import options

    with pytest.raises(UserError, match="needs >= 2 devices"):
        allreduce.counts_of([], 1)
    with pytest.raises(UserError, match=r"must be in \[2, 4\]"):
        allreduce.counts_of(["8"], 4)
    assert allreduce.counts_of([], 4) == [2, 4] and allreduce.counts_of(["4", "2"], 8) == [2, 4]
    with pytest.raises(UserError, match="'model' axis only"):
        core_mesh.shards_of("data:2")
    with pytest.raises(UserError, match="--mesh"):
        core_mesh.shards_of("model:0")
    assert core_mesh.shards_of("") == 1 and core_mesh.shards_of("model:4") == 4
    fv = flags.FlagValues()
    options.define_flags(fv)
    for argv, message in (
        (["--mesh=data:2", "--batch=7"], "multiple of the 2 devices"),
        (["--mesh=model:2"], "'data' axis only"),
    ):
        fv.unparse_flags()
        fv(["train", *argv])
        with pytest.raises(UserError, match=message):
            options.data_devices_from_flags(fv)
    fv.unparse_flags()
    fv(["train", "--mesh=data:2", "--batch=8"])
    assert options.data_devices_from_flags(fv) == 2


def test_gather_and_shard_check_the_model_s_mesh():
    model = types.SimpleNamespace(config=UNEVEN)
    assert parallel.gather_model(model) is model
    mesh = parallel.make_mesh({"model": 1})
    model.config = dataclasses.replace(UNEVEN, mesh=mesh)
    with pytest.raises(ValueError, match="already on a mesh"):
        parallel.shard_model(model, mesh)
