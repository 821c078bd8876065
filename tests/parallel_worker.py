"""The multi-device half of tests/test_parallel.py, run in a process of its own as

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/parallel_worker.py model:2,4

(a CPU jax has as many devices as that flag says when it starts, so these checks cannot share
the test process). Each check runs on meshes of the given sizes against the same model on one
device (or against the reference's vectors, which one device reproduces) and the process prints
one JSON object {check: {mesh size: measured values}}; test_parallel.py asserts on them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

import huginn_jax
from huginn_jax import parallel, train
from huginn_jax.config import HuginnConfig
from huginn_jax.generate import generate
from huginn_jax.model import Core, run_core

TINY_A = Path(__file__).parent / "data" / "huginn_tiny_a"
# Heads (3) and MLP width (50) that divide by neither 2 nor 4: padded on either mesh.
UNEVEN = HuginnConfig(
    n_embd=36, n_heads=3, intermediate_size=50, vocab_size=40, block_size=16,
    n_layers_in_prelude=1, n_layers_in_recurrent_block=2, n_layers_in_coda=1,
)  # fmt: skip
ADAPTIVE = dict(num_steps=16, criterion="kl", threshold=5e-4, init_scale=0.0, cache_len=12)


def max_err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def all_reduces(hlo_text: str) -> int:
    """All-reduce instructions of an optimized HLO module (async pairs counted once)."""
    return len(re.findall(r"= \S+ all-reduce(?:-start)?\(", hlo_text))


def prefill_decode(model, ids, num_steps: int) -> dict:
    """A cached prefill of all but the last two positions (logits and latents of each), then two
    decode steps (their logits), as float64 numpy."""
    batch, tokens = ids.shape
    cache = huginn_jax.KVCache.create(
        model.config, batch=batch, max_len=tokens, num_steps=num_steps
    )
    prefill = model(ids[:, :-2], num_steps=num_steps, init_scale=0.0, cache=cache)
    out, decoded = prefill, []
    for position in (tokens - 2, tokens - 1):
        out = model(ids[:, position : position + 1], num_steps=num_steps, init_scale=0.0,
                    cache=out.cache, start=position)  # fmt: skip
        decoded.append(out.logits[:, -1])
    outputs = {"prefill_logits": prefill.logits, "prefill_latents": prefill.latents}
    return {k: np.asarray(v, np.float64) for k, v in {**outputs, "decode_logits": decoded}.items()}


def errors(one: dict, mesh: dict) -> dict:
    """Max abs difference of each output, one device vs the mesh."""
    return {name: float(np.max(np.abs(one[name] - mesh[name]))) for name in one}


def layout(sharded) -> dict:
    """Shapes of one device's shards: Wqkv and mlp.fc columns, proj rows, cache heads."""
    block = sharded.core_block[0]
    cache = huginn_jax.KVCache.create(sharded.config, batch=1, max_len=4, num_steps=1)

    def local(x):
        return list(x.addressable_shards[0].data.shape)

    return {
        "wqkv_global": list(block.attn.Wqkv.kernel[...].shape),
        "wqkv_local": local(block.attn.Wqkv.kernel[...]),
        "fc_global": list(block.mlp.fc.kernel[...].shape),
        "fc_local": local(block.mlp.fc.kernel[...]),
        "attn_proj_local": local(block.attn.proj.kernel[...]),
        "cache_global": list(cache.k.shape),
        "cache_local": local(cache.k),
        "wte_local": local(sharded.wte[...]),
        "devices": len(block.attn.Wqkv.kernel[...].sharding.device_set),
    }


def hlo_counts(config: HuginnConfig, mesh) -> dict:
    """All-reduces in the compiled HLO of one Core layer, prefill (4 positions from 0) and decode
    (1 position over a cache), and of one decode Core iteration (adapter + the Core layers)."""
    config = dataclasses.replace(config, mesh=mesh)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Core(config, rngs=nnx.Rngs(0))))
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(mesh, parallel.param_spec(path))
        ),
        nnx.to_pure_dict(abstract),
    )  # lowered and compiled only: shapes and shardings suffice
    d = config.n_embd
    counts = {}
    for mode, tokens, start in (("prefill", 4, 0), ("decode", 1, 3)):
        x = jnp.ones((2, tokens, d))
        cache = huginn_jax.KVCache.create(config, batch=2, max_len=4, num_steps=1)

        def layer(params, x, cache, start):
            return nnx.merge(graphdef, params).core_block[0](x, start, cache, 0)

        def iteration(params, x, cache, start):
            return run_core(nnx.merge(graphdef, params), x, x, start, cache, 1)

        for name, fn in (("layer", layer), ("iteration", iteration)):
            if (mode, name) == ("prefill", "iteration"):
                continue  # the decode iteration shows the adapter adds none
            text = jax.jit(fn).lower(params, x, cache, jnp.int32(start)).compile().as_text()
            counts[f"{mode}_{name}"] = all_reduces(text)
    return counts


def generation(n: int) -> dict:
    """Greedy (full cache) and adaptive (kl exit, latest-m4 cache) tokens of the conformance model
    on n devices, beside the reference's, which one device reproduces (test_generate)."""
    reference = np.load(TINY_A / "reference.npz")
    mesh = parallel.make_mesh({"model": n})
    sharded = huginn_jax.from_pretrained(TINY_A, mesh=mesh)  # placed tensor by tensor
    relaid = parallel.shard_model(huginn_jax.from_pretrained(TINY_A), mesh)
    pairs = list(zip(*(jax.tree.leaves(nnx.state(m)) for m in (sharded, relaid)), strict=True))
    greedy = generate(sharded, reference["input_ids"][:, :6], 6, 4, init_scale=0.0)
    adaptive = generate(sharded, reference["input_ids"][0:1, :6], 6, **ADAPTIVE)
    return {
        "greedy": greedy.tokens.tolist(),
        "adaptive": adaptive.tokens.tolist(),
        "adaptive_steps": adaptive.steps.tolist(),
        "reference_greedy": reference["greedy_tokens"].tolist(),
        "reference_adaptive": reference["adaptive_tokens"].tolist(),
        "reference_adaptive_steps": reference["adaptive_steps"].tolist(),
        "cache_devices": len(greedy.cache.k.sharding.device_set),
        "load_vs_shard_model": max(max_err(a, b) for a, b in pairs),
        "load_same_shardings": all(
            a.sharding.is_equivalent_to(b.sharding, a.ndim) for a, b in pairs
        ),
    }


def program(n: int) -> dict:
    """`python -m huginn_jax.generate --mesh=model:n` (its flags parsed, its body run in this
    process) on the conformance checkpoint: greedy tokens of two copies of the reference's first
    prompt (the shapes of `generation`'s greedy run, whose executables it reuses) and what the
    stats count."""
    from absl import flags

    from huginn_jax.generate import cli, options

    prompt = np.load(TINY_A / "reference.npz")["input_ids"][0, :6]
    fv = flags.FlagValues()
    options.define_flags(fv)
    with tempfile.TemporaryDirectory() as tmp:
        json_out = Path(tmp) / "generate.json"
        fv([
            "generate", f"--checkpoint={TINY_A}", f"--mesh=model:{n}", "--dtype=f32",
            "--gemm=xla",  # the default would change XLA_FLAGS after the backend started
            f"--prompt_ids={','.join(map(str, prompt))}", "--batch=2", "--max_new_tokens=6",
            "--num_steps=4", "--init_scale=0", "--noprogress", f"--json_out={json_out}",
        ])  # fmt: skip
        with contextlib.redirect_stdout(io.StringIO()):  # this process prints its JSON alone
            cli._main(["generate"], fv, [flag for _, flag, *_ in options.FLAGS])
        data = json.loads(json_out.read_text())
    stats = data["stats"]
    return {"tokens": data["tokens"], "counted": [stats["model_shards"], stats["kv_heads"]]}


def data_parallel_losses(n: int, steps: int = 3) -> dict:
    """The first `steps` training losses on one device and data-parallel over n devices, from the
    same initial state."""
    from huginn_jax import tasks

    config = HuginnConfig(
        n_embd=16, n_heads=2, intermediate_size=16, vocab_size=48, block_size=32,
        n_layers_in_prelude=1, n_layers_in_recurrent_block=1, n_layers_in_coda=1,
    )  # fmt: skip
    task = tasks.make_task("root", nodes=6, max_chain=3, queries=3)
    cfg = train.TrainConfig(batch=8, lr=3e-3, warmup_steps=1, mean_recurrence=2.0, backprop_depth=1)
    tx = train.make_optimizer(cfg)
    graphdef, state0 = train.init_train_state(train.run_config(config, cfg), tx, seed=0)
    losses = {}
    for name, mesh in (("one", None), ("mesh", parallel.make_mesh({"data": n}))):
        state = jax.tree.map(jnp.array, state0)  # fresh buffers: the step donates its state
        if mesh is not None:
            state = parallel.replicate(state, mesh)
        step = train.make_train_step(graphdef, task, tx, cfg, mesh)
        losses[name] = []
        for _ in range(steps):
            state, metrics = step(state)
            losses[name].append(float(metrics["loss"]))
        losses[f"{name}_param_devices"] = len(jax.tree.leaves(state.params)[0].sharding.device_set)
    return losses


def model_checks(sizes: list[int]) -> dict:
    """Per mesh size: prefill and decode against one device, layout, gather and HLO, for the
    conformance model and for UNEVEN (one device's outputs computed once)."""
    reference = np.load(TINY_A / "reference.npz")
    ids = jnp.asarray(reference["input_ids"])
    models = {
        "tiny": (huginn_jax.from_pretrained(TINY_A), ids, 4),
        "uneven": (
            nnx.merge(*train.init_params(UNEVEN, jax.random.key(0))),
            ids[:, :8] % UNEVEN.vocab_size,
            3,
        ),
    }
    one = {name: prefill_decode(*args) for name, args in models.items()}
    results = {}
    for n in sizes:
        mesh = parallel.make_mesh({"model": n})
        sharded = {name: parallel.shard_model(m, mesh) for name, (m, _, _) in models.items()}
        out = {name: prefill_decode(sharded[name], *models[name][1:]) for name in models}
        uneven, back = models["uneven"][0], parallel.gather_model(sharded["uneven"])
        pairs = zip(
            jax.tree.leaves(nnx.state(uneven)), jax.tree.leaves(nnx.state(back)), strict=True
        )
        core_only = dataclasses.replace(
            UNEVEN, n_layers_in_prelude=0, n_layers_in_recurrent_block=4, n_layers_in_coda=0
        )
        config = sharded["uneven"].config
        results[n] = {
            **{name: errors(one[name], out[name]) for name in models},
            "tiny_vs_reference": max_err(
                out["tiny"]["prefill_logits"], reference["logits_steps4"][:, : ids.shape[1] - 2]
            ),
            "uneven_padded": [config.attention_heads, config.mlp_width],
            "gather_roundtrip": max(max_err(a, b) for a, b in pairs),
            "layout": {name: layout(m) for name, m in sharded.items()},
            "hlo": hlo_counts(core_only, mesh),
        }
    return results


def main(checks: list[str]) -> None:
    """checks: "model:2,4" (model_checks on meshes of 2 and 4 devices), "generation:N",
    "program:N", "train:N"; prints {check: {N: results}} as JSON."""
    results: dict = {}
    for check in checks:
        name, _, sizes = check.partition(":")
        sizes = [int(n) for n in sizes.split(",")]
        assert len(jax.devices()) >= max(sizes), f"{len(jax.devices())} devices; set XLA_FLAGS"
        if name == "model":
            results[name] = model_checks(sizes)
        elif name == "generation":
            results[name] = {n: generation(n) for n in sizes}
        elif name == "program":
            results[name] = {n: program(n) for n in sizes}
        elif name == "train":
            results[name] = {n: data_parallel_losses(n) for n in sizes}
        else:
            raise ValueError(f"unknown check {check!r}")
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
