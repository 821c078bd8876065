"""huginn_jax.xla_flags: the GEMM choice and command buffers go into XLA_FLAGS, and only before the
backend starts."""

import subprocess
import sys

import jax
import pytest

from huginn_jax.xla_flags import COMMAND_BUFFERS_OFF, TRITON_GEMM_OFF, add_flags, use_gemm


def test_unknown_choice_fails_clearly():
    with pytest.raises(ValueError, match="must be one of"):
        use_gemm("cutlass")


def test_a_change_after_the_backend_started_is_refused(monkeypatch):
    jax.devices()  # the backend runs in this process now
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    use_gemm("xla")  # nothing to change: accepted
    with pytest.raises(RuntimeError, match="before JAX starts"):
        use_gemm("cublas")


def test_choice_sets_and_clears_the_flag_in_a_fresh_process():
    code = (
        "import os; from huginn_jax.xla_flags import use_gemm; "
        "os.environ['XLA_FLAGS'] = '--xla_dump_to=/tmp/x'; "
        "use_gemm('cublas'); a = os.environ['XLA_FLAGS']; use_gemm('cublas'); "
        "b = os.environ['XLA_FLAGS']; use_gemm('xla'); print(a); print(b); "
        "print(os.environ['XLA_FLAGS']); import jax; jax.numpy.ones(1).block_until_ready()"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out == [f"--xla_dump_to=/tmp/x {TRITON_GEMM_OFF}"] * 2 + ["--xla_dump_to=/tmp/x"]


def test_command_buffers_off_adds_the_empty_list_and_on_removes_it():
    code = (
        "import os; from huginn_jax.xla_flags import use_command_buffers, use_gemm; "
        "os.environ['XLA_FLAGS'] = '--xla_dump_to=/tmp/x'; "
        "use_gemm('cublas'); use_command_buffers(False); print(os.environ['XLA_FLAGS']); "
        "use_command_buffers(True); print(os.environ['XLA_FLAGS'])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out == [
        f"--xla_dump_to=/tmp/x {TRITON_GEMM_OFF} {COMMAND_BUFFERS_OFF}",
        f"--xla_dump_to=/tmp/x {TRITON_GEMM_OFF}",
    ]


def test_added_flags_replace_words_of_the_same_name_in_a_fresh_process():
    code = (
        "import os; from huginn_jax.xla_flags import add_flags, use_gemm; "
        "os.environ['XLA_FLAGS'] = '--xla_dump_to=/tmp/x --xla_gpu_autotune_level=4'; "
        "use_gemm('cublas'); "
        "add_flags(' --xla_gpu_autotune_level=0  --xla_gpu_enable_triton_gemm=true --xla_a '); "
        "print(os.environ['XLA_FLAGS'])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out == [
        "--xla_dump_to=/tmp/x --xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=true --xla_a"
    ]


@pytest.mark.parametrize("text", ["xla_gpu_autotune_level=0", "--a=1 -b", "--a b=2"])
def test_a_word_that_is_no_flag_is_refused(text):
    with pytest.raises(ValueError, match="is not an XLA flag"):
        add_flags(text)
