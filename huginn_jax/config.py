"""HuginnConfig: the shape of a Huginn model, with named presets and a Hugging Face reader."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jax.sharding import Mesh

# The names each kernel choice accepts: HuginnConfig checks its fields against these, and the
# command lines offer them.
ATTENTION_IMPLS = ("xla", "cudnn", "mgpu")
DECODE_ATTENTION_IMPLS = ("xla", "xla_split", "cudnn", "pallas")
DECODE_GEMV_IMPLS = ("xla", "xla_rows8", "pallas")
# Generation's Core decode steps (`generate`'s core_decode; not a config field, because the
# persistent kernel reads the Core's weights packed once per run: huginn_jax.persistent):
# "xla" (run_core, a lax.scan) or "persistent" (run_core_persistent).
CORE_DECODE_IMPLS = ("xla", "persistent")


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
    # A Core step at batch 1 and one position: "xla" (the plain layer code), "xla_rows8" (each
    # matrix-vector product as the first row of an 8-row XLA product: a GEMM, not XLA's
    # one-row reduction; huginn_jax.decode_row) or "pallas" (each matrix-vector product one
    # kernel that returns split-K partial sums or applies the SiLU gate: huginn_jax.decode_row
    # with pallas_kernels.fused_gemv). One of DECODE_GEMV_IMPLS; huginn_jax.ops maps each name
    # to its code.
    decode_gemv: str = "xla"
    # Tensor parallelism (huginn_jax.parallel): a mesh whose "model" axis splits every layer's
    # heads and MLP columns across its devices, Megatron-style; None: one device. Under a mesh
    # the layers hold their heads and MLP columns in device-major groups, padded with zero
    # weights to a multiple of the "model" axis (`attention_heads`, `mlp_width`). Build such a
    # model with parallel.shard_model, or random_init / from_pretrained with `mesh=`.
    mesh: Mesh | None = None

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
        counts = ("n_layers_in_prelude", "n_layers_in_recurrent_block", "n_layers_in_coda")
        for name in (*counts, "head_dim", "mean_recurrence", "effective_expected_depth"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
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
        if self.mesh is not None:
            _check_mesh(self)
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
            if self.effective_expected_depth == 0:
                raise ValueError("effective_expected_depth=0: the model has no layers")
            std = self.init_std / math.sqrt(2 * self.effective_expected_depth)
            object.__setattr__(self, "out_proj_std", std)
        if self.embed_scale == 0.0:
            object.__setattr__(self, "embed_scale", math.sqrt(self.n_embd))

    @property
    def n_core(self) -> int:
        """Layers in the recurrent Core block."""
        return self.n_layers_in_recurrent_block

    @property
    def model_shards(self) -> int:
        """Devices along the mesh's "model" axis (1 without a mesh)."""
        return 1 if self.mesh is None else int(self.mesh.shape["model"])

    @property
    def attention_heads(self) -> int:
        """Heads the layers hold: n_heads padded to a multiple of `model_shards`."""
        return -(-self.n_heads // self.model_shards) * self.model_shards

    @property
    def mlp_width(self) -> int:
        """MLP columns the layers hold: intermediate_size padded to a multiple of `model_shards`."""
        return -(-self.intermediate_size // self.model_shards) * self.model_shards

    @classmethod
    def from_name(cls, name: str) -> HuginnConfig:
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None

    @classmethod
    def from_hf_json(cls, path: str | Path) -> HuginnConfig:
        """Reads a Hugging Face `config.json` written by the reference `save_pretrained()`.

        Raises CheckpointError naming the file and the key for an unreadable file, invalid
        JSON, a missing required key, a value of the wrong type, or values the model refuses."""
        from huginn_jax.files import CheckpointError

        try:
            return cls(**_hf_fields(Path(path)))
        except CheckpointError:
            raise
        except ValueError as e:  # the values' own checks (__post_init__)
            raise CheckpointError(f"{path}: {e}") from None


# config.json key ("init_values.std": the "std" of the "init_values" object) -> (HuginnConfig
# field, JSON type, default; _REQUIRED: the file must hold it; absent or null: the default).
# "padded_vocab_size", when present, is the vocabulary the weights hold and wins over
# "vocab_size".
_REQUIRED = object()
_HF_KEYS = (
    ("n_embd", "n_embd", int, _REQUIRED),
    ("n_heads", "n_heads", int, _REQUIRED),
    ("intermediate_size", "intermediate_size", int, _REQUIRED),
    ("vocab_size", "vocab_size", int, _REQUIRED),
    ("padded_vocab_size", "vocab_size", int, None),
    ("n_layers_in_prelude", "n_layers_in_prelude", int, 2),
    ("n_layers_in_recurrent_block", "n_layers_in_recurrent_block", int, 4),
    ("n_layers_in_coda", "n_layers_in_coda", int, 2),
    ("head_dim", "head_dim", int, 0),
    ("block_size", "block_size", int, 4096),
    ("rope_base", "rope_base", float, 50_000.0),
    ("norm_eps", "norm_eps", float, 1e-6),
    ("qk_bias", "qk_bias", bool, True),
    ("tie_embeddings", "tie_embeddings", bool, True),
    ("mean_recurrence", "mean_recurrence", int, 32),
    ("mean_backprop_depth", "mean_backprop_depth", int, 8),
    ("effective_expected_depth", "effective_expected_depth", int, 0),
    ("init_values.std", "init_std", float, 0.0),
    ("init_values.out_proj", "out_proj_std", float, 0.0),
    ("init_values.embed_scale", "embed_scale", float, 0.0),
)
_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false"}


def _has_type(value, kind: type) -> bool:
    if kind is bool or isinstance(value, bool):
        return kind is bool and isinstance(value, bool)
    if kind is int:
        return isinstance(value, int)
    return isinstance(value, int | float) and math.isfinite(value)


def _hf_fields(path: Path) -> dict:
    """HuginnConfig's fields from the `config.json` at `path`, each checked for presence and
    type; CheckpointError naming the file and the key otherwise."""
    from huginn_jax.files import CheckpointError

    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}: not a text file (expected JSON)") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
        ) from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(raw).__name__}")
    init_values = raw.get("init_values", {})
    if not isinstance(init_values, dict):
        raise CheckpointError(
            f"{path}: key 'init_values' is {_show(init_values)}; expected an object"
        )
    fields: dict = {}
    for key, field, kind, default in _HF_KEYS:
        prefix, _, name = key.rpartition(".")
        table = init_values if prefix else raw
        if table.get(name) is None:  # absent, or null: the default
            if default is _REQUIRED:
                raise CheckpointError(f"{path}: key '{key}' is missing")
            if default is not None:
                fields.setdefault(field, default)
            continue
        value = table[name]
        if not _has_type(value, kind):
            raise CheckpointError(
                f"{path}: key '{key}' is {_show(value)}; expected {_TYPE_WORDS[kind]}"
            )
        fields[field] = float(value) if kind is float else value
    return fields


def _show(value) -> str:
    """A JSON value as the file spells it, cut to a readable length."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_mesh(cfg: HuginnConfig) -> None:
    """A mesh needs a "model" axis and kernels that XLA can partition: the Pallas kernels
    (decode_attention_impl="pallas", attention_impl="mgpu") run on one device's whole arrays,
    and the batch-1 row path (decode_gemv other than "xla") splits fused weights in the
    checkpoint's column order."""
    if "model" not in cfg.mesh.axis_names:
        raise ValueError(
            f"the mesh has axes {cfg.mesh.axis_names}; tensor parallelism needs 'model'"
        )
    single = {"attention_impl": "mgpu", "decode_attention_impl": "pallas"}
    for name, impl in single.items():
        if getattr(cfg, name) == impl:
            raise ValueError(
                f"{name}={impl!r} runs on one device; a mesh needs an XLA or cuDNN choice"
            )
    if cfg.decode_gemv != "xla":  # the row path reads fused weights in the checkpoint's order
        raise ValueError(
            f"decode_gemv={cfg.decode_gemv!r} is a batch-1 path of one device; a mesh needs 'xla'"
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
