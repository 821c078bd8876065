"""HuginnConfig: the shape of a Huginn model, with named presets and a Hugging Face reader."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

# The names each kernel choice accepts: HuginnConfig checks its fields against these, and the
# command lines offer them.
ATTENTION_IMPLS = ("xla", "cudnn", "mgpu")
DECODE_ATTENTION_IMPLS = ("xla", "xla_split", "cudnn", "pallas")
DECODE_GEMV_IMPLS = ("xla", "pallas")


@dataclasses.dataclass(frozen=True)
class HuginnConfig:
    """Dimensions and constants of a Huginn (RavenForCausalLM) model.

    Field names follow the reference `config.json`. Derived values (`head_dim`, init stds,
    `embed_scale`) are stored rather than recomputed, because a checkpoint's stored values are
    what the reference uses.
    """

    n_embd: int
    n_heads: int
    intermediate_size: int
    vocab_size: int
    n_layers_in_prelude: int = 2
    n_layers_in_recurrent_block: int = 4
    n_layers_in_coda: int = 2
    head_dim: int = 0  # 0: n_embd // n_heads
    block_size: int = 4096  # max positions (RoPE table length)
    rope_base: float = 50_000.0
    norm_eps: float = 1e-6
    qk_bias: bool = True
    tie_embeddings: bool = True
    mean_recurrence: int = 32
    mean_backprop_depth: int = 8
    init_std: float = 0.0  # 0: sqrt(2 / (5 n_embd))
    out_proj_std: float = 0.0  # 0: init_std / sqrt(2 * effective_expected_depth)
    embed_scale: float = 0.0  # 0: sqrt(n_embd)
    effective_expected_depth: int = 0  # 0: prelude + coda + core * mean_recurrence
    # How multi-position attention (prefill) is computed: "xla" (scores materialized, any
    # backend), "cudnn" (fused flash attention through jax.nn.dot_product_attention; NVIDIA
    # GPUs, bf16/fp16) or "mgpu" (jax's Mosaic GPU flash attention, sm_90, on float16 copies:
    # layers.attend_mgpu_causal; for T new positions with nothing cached before them, "xla"
    # otherwise).
    attention_impl: str = "xla"
    # How one new position attends over a cache (decode): "xla" (one product over all S
    # positions), "xla_split" (the positions in blocks of DECODE_BLOCK, a softmax per block, the
    # blocks combined: flash-decoding written in XLA), "cudnn" (cuDNN's fused attention, the
    # visible keys given as key_value_seq_lengths; NVIDIA GPUs, bf16/fp16) or "pallas" (a
    # split-KV kernel reading the cache slot in place: pallas_kernels.decode_attention). One of
    # DECODE_ATTENTION_IMPLS; huginn_jax.ops maps each name to its code.
    decode_attention_impl: str = "xla"
    # A Core step at batch 1 and one position: "xla" (the plain layer code) or "pallas" (each
    # matrix-vector product one kernel that returns split-K partial sums or applies the SiLU
    # gate: huginn_jax.decode_row with pallas_kernels.fused_gemv). One of DECODE_GEMV_IMPLS;
    # huginn_jax.ops maps each name to its code.
    decode_gemv: str = "xla"

    def __post_init__(self):
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(
                f"attention_impl={self.attention_impl!r} must be one of {ATTENTION_IMPLS}"
            )
        if self.decode_attention_impl not in DECODE_ATTENTION_IMPLS:
            raise ValueError(
                f"decode_attention_impl={self.decode_attention_impl!r} must be one of "
                f"{DECODE_ATTENTION_IMPLS}"
            )
        if self.decode_gemv not in DECODE_GEMV_IMPLS:
            raise ValueError(f"decode_gemv={self.decode_gemv!r} must be one of {DECODE_GEMV_IMPLS}")
        for name in ("n_embd", "n_heads", "intermediate_size", "vocab_size", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.head_dim == 0:
            if self.n_embd % self.n_heads:
                raise ValueError(
                    f"n_embd={self.n_embd} must be a multiple of n_heads={self.n_heads}"
                )
            object.__setattr__(self, "head_dim", self.n_embd // self.n_heads)
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        if self.n_heads * self.head_dim != self.n_embd:
            raise ValueError(
                f"n_heads * head_dim = {self.n_heads * self.head_dim} != n_embd={self.n_embd}"
            )
        if self.effective_expected_depth == 0:
            depth = (
                self.n_layers_in_prelude
                + self.n_layers_in_coda
                + self.n_layers_in_recurrent_block * self.mean_recurrence
            )
            object.__setattr__(self, "effective_expected_depth", depth)
        if self.init_std == 0.0:
            object.__setattr__(self, "init_std", math.sqrt(2 / (5 * self.n_embd)))
        if self.out_proj_std == 0.0:
            std = self.init_std / math.sqrt(2 * self.effective_expected_depth)
            object.__setattr__(self, "out_proj_std", std)
        if self.embed_scale == 0.0:
            object.__setattr__(self, "embed_scale", math.sqrt(self.n_embd))

    @property
    def n_core(self) -> int:
        """Layers in the recurrent Core block."""
        return self.n_layers_in_recurrent_block

    @classmethod
    def from_name(cls, name: str) -> HuginnConfig:
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None

    @classmethod
    def from_hf_json(cls, path: str | Path) -> HuginnConfig:
        """Reads a Hugging Face `config.json` written by the reference `save_pretrained()`."""
        raw = json.loads(Path(path).read_text())
        missing = [
            k for k in ("n_embd", "n_heads", "intermediate_size", "vocab_size") if k not in raw
        ]
        if missing:
            raise ValueError(f"{path}: config.json lacks {', '.join(missing)}")
        init_values = raw.get("init_values", {})
        return cls(
            n_embd=raw["n_embd"],
            n_heads=raw["n_heads"],
            intermediate_size=raw["intermediate_size"],
            vocab_size=raw.get("padded_vocab_size", raw["vocab_size"]),
            n_layers_in_prelude=raw.get("n_layers_in_prelude", 2),
            n_layers_in_recurrent_block=raw.get("n_layers_in_recurrent_block", 4),
            n_layers_in_coda=raw.get("n_layers_in_coda", 2),
            head_dim=raw.get("head_dim", 0),
            block_size=raw.get("block_size", 4096),
            rope_base=float(raw.get("rope_base", 50_000)),
            norm_eps=float(raw.get("norm_eps", 1e-6)),
            qk_bias=bool(raw.get("qk_bias", True)),
            tie_embeddings=bool(raw.get("tie_embeddings", True)),
            mean_recurrence=raw.get("mean_recurrence", 32),
            mean_backprop_depth=raw.get("mean_backprop_depth", 8),
            init_std=init_values.get("std", 0.0),
            out_proj_std=init_values.get("out_proj", 0.0),
            embed_scale=init_values.get("embed_scale", 0.0),
            effective_expected_depth=raw.get("effective_expected_depth", 0),
        )


huginn_0125 = HuginnConfig(n_embd=5280, n_heads=55, intermediate_size=17920, vocab_size=65536)

PRESETS: dict[str, HuginnConfig] = {
    "huginn_0125": huginn_0125,
    # The conformance model's shape (tests/data/huginn_tiny_a).
    "tiny": HuginnConfig(
        n_embd=96, n_heads=4, intermediate_size=160, vocab_size=256, block_size=64
    ),
    # Smaller still, for fast property tests.
    "micro": HuginnConfig(n_embd=32, n_heads=2, intermediate_size=48, vocab_size=64, block_size=32),
    # Trainable on one GPU in minutes (experiments.train).
    "small": HuginnConfig(
        n_embd=256,
        n_heads=4,
        intermediate_size=688,
        vocab_size=128,
        block_size=128,
        mean_recurrence=8,
    ),
}
