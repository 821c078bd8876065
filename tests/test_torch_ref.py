"""experiments.torch_ref.huginn (Huginn in PyTorch) against the official reference vectors, with
the weights of the JAX model loaded from tests/data/huginn_tiny_a; skipped without torch."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_A
from flax import nnx

import huginn_jax

torch = pytest.importorskip("torch")

from experiments.torch_ref.core import to_torch_fn  # noqa: E402
from experiments.torch_ref.huginn import TorchHuginn, generate_greedy  # noqa: E402

TOL = dict(rtol=1e-4, atol=1e-4)  # the tolerance the conformance README states


@pytest.fixture(scope="module")
def reference():
    return np.load(TINY_A / "reference.npz")


@pytest.fixture(scope="module")
def jax_model():
    return huginn_jax.from_pretrained(TINY_A, dtype=jnp.float32)


def torch_model(jax_model, device: str) -> TorchHuginn:
    params = nnx.to_pure_dict(nnx.state(jax_model))
    return TorchHuginn(params, jax_model.config, to_torch_fn(device, torch.float32))


@pytest.fixture(scope="module")
def model(jax_model):
    return torch_model(jax_model, "cpu")  # float32 on the CPU: deterministic, no TF32


@pytest.mark.parametrize("num_steps", [1, 4, 8])
def test_full_sequence_logits(model, reference, num_steps):
    ids = torch.as_tensor(reference["input_ids"], dtype=torch.int64)
    model.setup_cache(batch=2, max_len=12, num_steps=num_steps)
    with torch.no_grad():
        logits = model.forward(ids, num_steps).numpy()
    assert logits.dtype == np.float32
    np.testing.assert_allclose(logits, reference[f"logits_steps{num_steps}"], **TOL)


@pytest.mark.parametrize("cache_steps", [4, 8])
def test_prefill_then_decode(model, reference, cache_steps):
    """As the reference's (c); a cache with more Core slots than used moves the coda slots."""
    ids = torch.as_tensor(reference["input_ids"], dtype=torch.int64)
    model.setup_cache(batch=2, max_len=12, num_steps=cache_steps)
    with torch.no_grad():
        token, last = model.prefill(ids[:, :8], num_steps=4)
        decoded = [model.decode_step(ids[:, p : p + 1], p, num_steps=4)[1] for p in range(8, 12)]
    np.testing.assert_allclose(last.numpy(), reference["logits_steps4"][:, 7], **TOL)
    np.testing.assert_array_equal(token.numpy(), reference["logits_steps4"][:, 7].argmax(-1))
    decoded = torch.stack(decoded, dim=1).numpy()
    np.testing.assert_allclose(decoded, reference["decode_logits_steps4"], **TOL)


def test_greedy_tokens(model, reference):
    gen = generate_greedy(model, reference["input_ids"][:, :6], 6, 4, graph=False)
    np.testing.assert_array_equal(gen.tokens, reference["greedy_tokens"])
    assert gen.logits.shape == (2, 6, 256) and len(gen.latencies_s) == 5 and not gen.capture_s


def test_bad_calls_fail_clearly(model):
    ids = torch.zeros((2, 3), dtype=torch.int64)
    model.setup_cache(batch=2, max_len=8, num_steps=2)
    with pytest.raises(ValueError, match="num_steps=3"):
        model.forward(ids, 3)
    with pytest.raises(ValueError, match="need start=0"):
        model.forward(ids, 2, start=1)
    with pytest.raises(ValueError, match="do not fit"):
        model.forward(torch.zeros((2, 9), dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="CUDA"):
        model.decode_graph(ids[:, :1], 3, 2)


@pytest.mark.gpu
def test_cuda_graph_decode_matches_eager_and_reference(jax_model, reference):
    """Weights shared with JAX through DLPack; graph replay per token = the eager loop."""
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    model = torch_model(jax_model, "cuda")
    # Zero copy: the tensor lives at the JAX buffer's address.
    wte = jax_model.wte[...]
    assert model.wte.data_ptr() == wte.unsafe_buffer_pointer()
    prompt = reference["input_ids"][:, :6]
    graph = generate_greedy(model, prompt, 6, 4, graph=True)
    eager = generate_greedy(model, prompt, 6, 4, graph=False)
    np.testing.assert_array_equal(graph.tokens, reference["greedy_tokens"])
    np.testing.assert_array_equal(eager.tokens, reference["greedy_tokens"])
    np.testing.assert_allclose(graph.logits, eager.logits, **TOL)
    assert len(graph.capture_s) == len(graph.latencies_s) == 5


def test_generate_vs_torch_program(tmp_path):
    """The comparison program end to end at the `micro` size (CUDA graph on a GPU, else eager)."""
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [
            sys.executable, "-m", "experiments.generate_vs_torch", "--config=micro",
            "--dtype=f32", "--prompt_len=8", "--max_new_tokens=4", "--num_steps=3",
            "--torch_eager", f"--json_out={out}",
        ],
        capture_output=True, text=True, cwd=Path(__file__).parents[1], timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert len(data["jax"]["decode_latency_s"]) == 3
    torch_side = data["torch"][data["torch"]["mode"]]
    assert len(torch_side["decode_latency_s"]) == 3
    assert data["comparison"]["latency_ratio_jax_over_torch"] > 0
    # float32 on both sides: the same greedy tokens and logits within float32 rounding
    assert data["comparison"]["tokens_agree"], data["comparison"]
    assert data["comparison"]["logits_max_abs_diff_same_inputs"] < 1e-3
    assert data["torch"]["mode"] == ("graph" if jax.default_backend() == "gpu" else "eager")
    assert "JAX / PyTorch latency" in proc.stdout
