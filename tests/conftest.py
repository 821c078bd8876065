"""Shared test set-up: GPU-only tests (marked `gpu`) are skipped where JAX has no GPU."""

from pathlib import Path

import jax
import pytest

TINY_A = Path(__file__).parent / "data" / "huginn_tiny_a"


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
