"""What fills a generation step's XLA temp memory: compiles the prefill and decode steps of a
preset against abstract weights and cache (nothing allocated), prints `memory_analysis()` and the
largest values XLA placed in temp buffers (from its dumped buffer assignment), then the temp of
the logits head written three ways: it shows whether the head makes a float32 copy of the
embedding (docs/core_layers.md).

    python3 tools/step_buffers.py --config=huginn_0125 --prompt_len=1024 --cache_len=1056
"""

from __future__ import annotations

import atexit
import dataclasses
import glob
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from absl import app, flags

_CONFIG = flags.DEFINE_string("config", "huginn_0125", "Model preset.")
_PROMPT = flags.DEFINE_integer("prompt_len", 1024, "Prompt positions (the prefill step).")
_CACHE = flags.DEFINE_integer("cache_len", 1056, "Cache positions.")
_STEPS = flags.DEFINE_integer("num_steps", 32, "Core iterations per token.")
_TOP = flags.DEFINE_integer("top", 6, "Largest temp values listed per step.")


def largest_temps(path: str, top: int) -> list[tuple[int, str]]:
    """(bytes, value) of the `top` largest values in the temp allocations of one dumped buffer
    assignment (parameters, outputs and their aliases excluded)."""
    text = Path(path).read_text().split("\nTotal bytes used")[0]
    found = {}
    for block in re.split(r"\n(?=allocation \d+:)", text):
        head = block.splitlines()[0]
        if not head.startswith("allocation") or "parameter" in head or "output" in head:
            continue
        for line in block.splitlines()[1:]:
            m = re.search(r"value: <\d+ (\S+) @\d+> \(size=(\d+),offset=\d+\): (.*)", line)
            if m:
                found[m.group(1)] = (int(m.group(2)), f"{m.group(1)}: {m.group(3)}")
    return sorted(found.values(), reverse=True)[:top]


def main(argv):
    del argv
    dump_dir = tempfile.mkdtemp(prefix="step_buffers_")
    atexit.register(shutil.rmtree, dump_dir, ignore_errors=True)  # XLA's dumps, read here only
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_dump_to={dump_dir} --xla_dump_hlo_module_re=.*step_jit.*"
        " --xla_dump_hlo_pass_re=^$"
    )
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from huginn_jax.config import HuginnConfig
    from huginn_jax.generate.step import StepSpec, _step_jit
    from huginn_jax.kv_cache import KVCache
    from huginn_jax.model import random_init
    from huginn_jax.xla_flags import use_gemm

    use_gemm("cublas")
    cfg = HuginnConfig.from_name(_CONFIG.value)
    model = nnx.eval_shape(lambda: random_init(cfg, jax.random.key(0), jnp.bfloat16))
    graphdef, params = nnx.split(model)
    cache = jax.eval_shape(
        lambda: KVCache.create(
            cfg, batch=1, max_len=_CACHE.value, num_steps=_STEPS.value, dtype=jnp.bfloat16
        )
    )
    spec = StepSpec(num_steps=_STEPS.value, init_scale=0.0)
    exit_at = (jnp.float32(5e-4), jnp.int32(0))
    key = jax.random.key(0)
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
    print(f"weights {weights / 1e9:.3f} GB, cache {cache_bytes / 1e9:.3f} GB")
    cases = {
        "prefill": (
            dataclasses.replace(spec, from_zero=True),
            jnp.zeros((1, _PROMPT.value), jnp.int32),
        ),
        "decode": (spec, jnp.zeros((1,), jnp.int32)),
    }
    seen: set[str] = set()
    for name, (step_spec, ids) in cases.items():
        compiled = _step_jit.lower(
            graphdef, params, ids, None, cache, jnp.int32(0), key, exit_at, spec=step_spec
        ).compile()
        mem = compiled.memory_analysis()
        print(f"{name}: temp {mem.temp_size_in_bytes / 1e9:.3f} GB, largest temp values:")
        dumped = set(glob.glob(f"{dump_dir}/*buffer-assignment.txt")) - seen
        seen |= dumped
        for path in dumped:
            for size, what in largest_temps(path, _TOP.value):
                print(f"  {size / 1e6:10.1f} MB  {what}")
    x = jax.ShapeDtypeStruct((1, cfg.n_embd), jnp.bfloat16)
    wte = jax.ShapeDtypeStruct((cfg.vocab_size, cfg.n_embd), jnp.bfloat16)
    heads = {
        "matmul(x, wte.T) -> f32": lambda x, w: jnp.matmul(
            x, w.T, preferred_element_type=jnp.float32
        ),
        "dot_general(x, wte, contract 1) -> f32": lambda x, w: jax.lax.dot_general(
            x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        ),
        "matmul(x, wte.T) -> bf16 -> f32": lambda x, w: jnp.matmul(x, w.T).astype(jnp.float32),
    }
    for name, fn in heads.items():
        mem = jax.jit(fn).lower(x, wte).compile().memory_analysis()
        print(f"head {name}: temp {mem.temp_size_in_bytes / 1e6:.1f} MB")
    sys.stdout.flush()


if __name__ == "__main__":
    app.run(main)
