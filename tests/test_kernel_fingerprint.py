"""tools/kernel_fingerprint.py on CPU: the fused kernel's Mosaic GPU module, printed without
source locations, and a refusal of an unknown configuration."""

import importlib.util
from pathlib import Path

import pytest

from pallas_kernels.core_step.fused_plan import FusedShape
from pallas_kernels.core_step.fused_step import lowered_for_hopper

TOOL = Path(__file__).resolve().parent.parent / "tools" / "kernel_fingerprint.py"


def tool():
    spec = importlib.util.spec_from_file_location("kernel_fingerprint", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_kernels_module_is_printed_without_source_locations():
    lowered = lowered_for_hopper(FusedShape(512, 8, 64, 1024, 1, 1, 64), 2, 128, workers=16)
    assert "fused.py" in lowered.as_text()  # the serialized module carries its locations
    text = tool().mosaic_modules(lowered)
    assert "gpu.launch" in text and ".py" not in text


def test_refuses_an_unknown_configuration():
    with pytest.raises(SystemExit, match="unknown bogus; known: default_b1, default_b8"):
        tool().main(["bogus"])
