"""The huginn_jax.generate command line: bad input, help, flag checks, the kernel choices,
checkpoints and the JSON it writes."""

import itertools
import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from conftest import MICRO
from program_runs import run_forked

import huginn_jax


def _command(*args) -> list[str]:
    return [sys.executable, "-m", "huginn_jax.generate", "--noprogress", *args]


def _cli(*args, cwd=None):
    return subprocess.run(
        _command(*args),
        capture_output=True,
        text=True,
        cwd=cwd or Path(__file__).parents[1],
        timeout=300,
    )


def _cli_forked(*args):
    """`_cli` forked from a process that has imported JAX (tests/program_runs.py): for runs
    that end before any work."""
    return run_forked("huginn_jax.generate", "--noprogress", *args, cwd=Path(__file__).parents[1])


def _cli_all(arg_lists: list[list[str]]) -> list[subprocess.CompletedProcess]:
    """`_cli` of every argument list, the processes running side by side."""
    procs = [
        subprocess.Popen(
            _command(*args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).parents[1],
        )
        for args in arg_lists
    ]
    done = []
    for proc, args in zip(procs, arg_lists, strict=True):
        out, err = proc.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(_command(*args), proc.returncode, out, err))
    return done


def test_cli_bad_input_exits_2_with_one_line():
    result = _cli_forked(
        "--config=micro", "--random_weights", "--prompt_ids=", "--max_new_tokens=2"
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "generate: the prompt is empty (input_ids shape (1, 0)); give at least a token"
    ]


def test_cli_help_lists_its_flags_with_defaults():
    out = " ".join(_cli_forked("--help").stdout.split())  # absl wraps the help text
    assert "--prompt_len: A random prompt of this many token ids" in out
    assert "--max_new_tokens: Tokens to generate per sequence (>= 1). (default: '32')" in out
    assert "kl 0.0005" in out and "argmax-stability 5" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt_len=-4"], "--prompt_len=-4: must be positive"),
        (["--prompt_len=3", "--criterion=kl", "--threshold=-1"], "needs > 0"),
        (["--prompt_len=3", "--criterion=argmax-stability", "--threshold=0"], "needs >= 1"),
        (["--prompt_len=3", "--threshold=0.1"], "--threshold applies to an adaptive exit"),
        (["--prompt_len=3", "--min_steps=2"], "--min_steps applies to an adaptive exit"),
        (["--prompt_len=3", "--criterion=kl", "--min_steps=40"], "--min_steps=40: must lie in"),
        (["--prompt_len=3", "--cache_len=-5"], "--cache_len=-5: must be >= 0"),
        (["--prompt_len=3", "--seed=-1"], "--seed=-1: must be >= 0"),
        (["--prompt_len=3", "--batch=0"], "--batch=0: must be at least 1"),
        (["--prompt_len=3", "--temperature=nan"], "--temperature=nan: must be a number >= 0"),
        (["--prompt_len=3", "--top_k=5"], "need --temperature > 0"),
        (["--prompt_len=3", "--temperature=1", "--top_p=0"], r"--top_p=0.0: must lie in \(0, 1\]"),
        (["--prompt_ids=1,-2"], "token ids >= 0"),
        (["--prompt_len=3", "--checkpoint=x", "--random_weights"], "goes with --config"),
        (
            ["--prompt_len=3", "--json_out=/proc/none/x.json"],
            "--json_out=/proc/none/x.json: cannot",
        ),
        (["--prompt_len=3", "--mesh=data:2"], "--mesh=data:2: expected model:N"),
        (["--prompt_len=3", "--mesh=model:0"], "--mesh=model:0: expected model:N"),
        (
            ["--prompt_len=3", "--mesh=model:1", "--decode_attention=pallas"],
            "--decode_attention=pallas runs on one device",
        ),
        (
            ["--prompt_len=3", "--mesh=model:1", "--decode_gemv=xla_rows8"],
            "--decode_gemv=xla_rows8 is a batch-1 path of one device",
        ),
    ],
)
def test_cli_refuses_bad_values_before_any_loading(args, message):
    """Every flag is checked against its range before a config, weights or a compile."""
    from absl import flags

    from huginn_jax.generate import options

    fv = flags.FlagValues()
    options.define_flags(fv)
    fv(["prog", "--config=micro", *args])
    with pytest.raises(options.UsageError, match=message):
        options.check_flags(fv)


def test_cli_kernel_flags_offer_the_configs_names():
    """--decode_attention and --decode_gemv accept exactly HuginnConfig's lists of names, and
    --core_decode config.CORE_DECODE_IMPLS; --persistent_schedule is the kernel's default."""
    from absl import flags

    from huginn_jax.config import CORE_DECODE_IMPLS, DECODE_ATTENTION_IMPLS, DECODE_GEMV_IMPLS
    from huginn_jax.generate import cli

    fv = flags.FlagValues()
    cli.define_flags(fv)
    assert fv["decode_attention"].parser.enum_values == list(DECODE_ATTENTION_IMPLS)
    assert fv["decode_gemv"].parser.enum_values == list(DECODE_GEMV_IMPLS)
    fv(["prog", "--decode_attention=pallas", "--decode_gemv=pallas"])
    assert (fv.decode_attention, fv.decode_gemv) == ("pallas", "pallas")
    assert fv["core_decode"].parser.enum_values == list(CORE_DECODE_IMPLS)
    assert fv.core_decode == "xla"  # the default: run_core
    assert fv.persistent_schedule == ""  # the persistent kernel's default schedule


def test_cli_kernel_choices(tmp_path):
    """Every --decode_attention and --decode_gemv generates the default's float32 tokens (the
    Pallas kernels in interpret mode without a GPU), a choice of each flag per run; cuDNN (bf16
    only) runs in bf16 on a GPU and ends in one line saying so without one; an unknown name ends
    in one line listing the known ones."""
    from huginn_jax.config import DECODE_ATTENTION_IMPLS, DECODE_GEMV_IMPLS

    on_gpu = jax.default_backend() == "gpu"
    attentions = [a for a in DECODE_ATTENTION_IMPLS if a not in ("xla", "cudnn")]
    gemvs = [g for g in DECODE_GEMV_IMPLS if g != "xla"]
    runs = [
        ("xla", "xla"),
        *itertools.zip_longest(attentions, gemvs, fillvalue="xla"),
        ("cudnn", "xla"),
    ]
    assert {a for a, _ in runs} == set(DECODE_ATTENTION_IMPLS)
    assert {g for _, g in runs} == set(DECODE_GEMV_IMPLS)
    tokens = {}
    dtypes = ["bf16" if attention == "cudnn" else "f32" for attention, _ in runs]
    results = _cli_all([
        [
            "--config=micro", "--random_weights", f"--dtype={dtype}", "--prompt_len=20",
            "--max_new_tokens=4", "--num_steps=3", f"--decode_attention={attention}",
            f"--decode_gemv={gemv}", f"--json_out={tmp_path / f'{attention}_{gemv}.json'}",
        ]
        for (attention, gemv), dtype in zip(runs, dtypes, strict=True)
    ])  # fmt: skip
    for (attention, gemv), dtype, result in zip(runs, dtypes, results, strict=True):
        out = tmp_path / f"{attention}_{gemv}.json"
        if attention == "cudnn" and not on_gpu:
            assert result.returncode == 2
            assert result.stderr.strip().splitlines() == [
                "generate: decode_attention_impl='cudnn' needs an NVIDIA GPU (cuDNN's fused "
                f"attention); the backend here is {jax.default_backend()}"
            ]
            continue
        assert result.returncode == 0, result.stderr
        if dtype != "f32":  # other roundings, other tokens
            continue
        data = json.loads(out.read_text())
        flags = data["flags"]
        assert (flags["decode_attention"], flags["decode_gemv"]) == (attention, gemv)
        tokens[attention, gemv] = data["tokens"]
    assert len(tokens["xla", "xla"][0]) == 4
    assert all(t == tokens["xla", "xla"] for t in tokens.values()), tokens
    refused = _cli_forked("--config=micro", "--random_weights", "--decode_attention=flash")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        "generate: flag --decode_attention=flash: value should be one of "
        f"<{'|'.join(DECODE_ATTENTION_IMPLS)}>"
    ]


def test_cli_checkpoint_takes_the_kernel_choices(micro, tmp_path):
    """A --checkpoint model runs with the flags' kernel choices, not its config.json's defaults:
    without a GPU cuDNN is refused as with --config; on a GPU the Pallas kernels generate the
    default's tokens."""
    checkpoint = tmp_path / "ckpt"
    huginn_jax.save_pretrained(micro, checkpoint)
    args = [f"--checkpoint={checkpoint}", "--dtype=f32", "--prompt_ids=1,2,3", "--num_steps=2"]
    args.append("--max_new_tokens=3")
    if jax.default_backend() != "gpu":
        result = _cli_forked(*args, "--decode_attention=cudnn")
        assert result.returncode == 2
        assert "generate: decode_attention_impl='cudnn' needs an NVIDIA GPU" in result.stderr
        return
    tokens = []
    for impl in ("xla", "pallas"):
        out = tmp_path / f"{impl}.json"
        kernels = [f"--decode_attention={impl}", f"--decode_gemv={impl}"]
        result = _cli(*args, *kernels, f"--json_out={out}")
        assert result.returncode == 0, result.stderr
        tokens.append(json.loads(out.read_text())["tokens"])
    assert tokens[0] == tokens[1]


def test_cli_runs_and_writes_json(micro, tmp_path):
    tokenizers = pytest.importorskip(
        "tokenizers", reason='needs tokenizers: pip install -e ".[text]"'
    )
    checkpoint = tmp_path / "ckpt"
    huginn_jax.save_pretrained(micro, checkpoint)
    vocab = {f"w{i}": i for i in range(MICRO.vocab_size)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(checkpoint / "tokenizer.json"))
    out = tmp_path / "out.json"
    result = _cli(
        f"--checkpoint={checkpoint}",
        "--dtype=f32",
        "--prompt=w3 w5 w7",
        "--max_new_tokens=3",
        "--num_steps=2",
        "--criterion=kl",
        "--threshold=1e-3",
        f"--json_out={out}",
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert data["flags"]["prompt"] == "w3 w5 w7" and data["flags"]["criterion"] == "kl"
    stats = data["stats"]
    assert stats["prompt_len"] == 3 and stats["strategy"] == "latest-m4"
    assert len(data["tokens"][0]) == 3 and all(1 <= s <= 2 for s in data["steps"][0])
    for key in ("latency_median_s", "tokens_per_s", "achieved_gb_s", "cache_bytes"):
        assert stats[key] is not None
    assert result.stdout.startswith("[0] 'w")  # the decoded text, then the table
    assert "tokens/s" in result.stdout
