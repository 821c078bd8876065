"""The package layout's import rule: pallas_kernels stands alone (jax, numpy, the standard library
and itself), and the model imports a kernel only where huginn_jax.ops chooses it, with nothing to
import beforehand."""

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KERNELS = REPO / "pallas_kernels"
# What a module under pallas_kernels may import: top-level names.
ALLOWED = {"jax", "jaxlib", "numpy", "pallas_kernels"} | set(sys.stdlib_module_names)


def imported_modules(source: str) -> list[tuple[int, str]]:
    """(line, module) for every import statement of `source`, nested ones included, in line
    order; relative imports count as pallas_kernels."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, "pallas_kernels" if node.level else node.module))
    return sorted(found)


def test_the_scan_sees_every_kind_of_import():
    """Plain, from, relative and nested imports (a scan that found nothing would let any file
    pass the test below)."""
    source = "import a.b, h\nfrom c import d\nfrom . import e\ndef f():\n    import g\n"
    want = [(1, "a.b"), (1, "h"), (2, "c"), (3, "pallas_kernels"), (5, "g")]
    assert imported_modules(source) == want


def test_pallas_kernels_imports_nothing_of_the_model():
    files = sorted(KERNELS.rglob("*.py"))
    assert any(f.parent.name == "decode_attention" for f in files)
    assert any(f.parent.name == "fused_gemv" for f in files)
    bad = [
        f"{path.relative_to(REPO)}:{line}: import {module}"
        for path in files
        for line, module in imported_modules(path.read_text())
        if module.split(".")[0] not in ALLOWED
    ]
    assert not bad, "pallas_kernels may import only jax, numpy and the standard library:\n" + (
        "\n".join(bad)
    )


def test_the_model_imports_a_kernel_only_when_a_config_asks_for_it():
    """In a fresh process: importing the model loads no kernel; a prefill and a decode step with
    decode_attention_impl="pallas" and decode_gemv="pallas" trace (the model picks its kernels
    while it traces; traced abstractly, as nothing here needs their values) with nothing
    imported first, and only then are both kernels loaded."""
    script = """
import dataclasses, sys
import jax, jax.numpy as jnp
import huginn_jax
from huginn_jax.config import HuginnConfig
assert not [m for m in sys.modules if m.startswith("pallas_kernels")], "loaded on import"
cfg = dataclasses.replace(
    HuginnConfig.from_name("micro"), decode_attention_impl="pallas", decode_gemv="pallas"
)
model = huginn_jax.random_init(cfg, jax.random.key(0))
cache = huginn_jax.KVCache.create(cfg, batch=1, max_len=8, num_steps=2)
def step(ids, cache, start):
    return model(jnp.array(ids), num_steps=2, init_scale=0.0, cache=cache, start=start)
out = jax.eval_shape(lambda cache: step([[1, 2, 3]], cache, 0), cache)
out = jax.eval_shape(lambda cache: step([[4]], cache, 3), out.cache)
assert out.logits.shape == (1, 1, cfg.vocab_size)
loaded = sorted(m for m in sys.modules if m.startswith("pallas_kernels"))
assert "pallas_kernels.decode_attention" in loaded and "pallas_kernels.fused_gemv" in loaded
print("ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
