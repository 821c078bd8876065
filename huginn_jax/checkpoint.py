"""Hugging Face safetensors checkpoints ⇄ Huginn parameters.

Key layout as the reference writes it (PyTorch Linear weights are [out, in]; ours are [in, out]).
Every key, shape and dtype is checked before any tensor is read, so a bad checkpoint fails with
one error and nothing is half-loaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.flax import save_file

from huginn_jax import parallel
from huginn_jax.config import HuginnConfig
from huginn_jax.files import CheckpointError, write_atomic, write_text_atomic
from huginn_jax.model import Huginn

_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
_IGNORED_KEYS = {"freqs_cis"}  # the reference's RoPE buffer; recomputed here
_TIED_HEAD = "lm_head.weight"


def param_table(cfg: HuginnConfig) -> dict[str, tuple[tuple, tuple[int, ...], bool]]:
    """HF key → (path in the model's nnx state, checkpoint shape, stored transposed?)."""
    d, f, h, k = cfg.n_embd, cfg.intermediate_size, cfg.n_heads, cfg.head_dim
    table = {"transformer.wte.weight": (("wte",), (cfg.vocab_size, d), False)}
    groups = (
        ("prelude", cfg.n_layers_in_prelude),
        ("core_block", cfg.n_core),
        ("coda", cfg.n_layers_in_coda),
    )
    for group, count in groups:
        for i in range(count):
            prefix = f"transformer.{group}.{i}."
            for n in (1, 2, 3, 4):
                table[f"{prefix}norm_{n}.weight"] = ((group, i, f"norm_{n}", "weight"), (d,), False)
            linears = {
                "attn.Wqkv": (3 * d, d),
                "attn.proj": (d, d),
                "mlp.fc": (2 * f, d),
                "mlp.proj": (d, f),
            }
            for name, shape in linears.items():
                path = (group, i, *name.split("."), "kernel")
                table[f"{prefix}{name}.weight"] = (path, shape, True)
            if cfg.qk_bias:
                table[f"{prefix}attn.qk_bias"] = (
                    (group, i, "attn", "qk_bias"),
                    (2, 1, h, k),
                    False,
                )
    table["transformer.adapter.weight"] = (("adapter", "kernel"), (d, 2 * d), True)
    table["transformer.ln_f.weight"] = (("ln_f", "weight"), (d,), False)
    if not cfg.tie_embeddings:
        table[_TIED_HEAD] = (("lm_head",), (cfg.vocab_size, d), True)
    return table


@contextlib.contextmanager
def _open(file: Path, framework: str = "numpy"):
    """`safe_open(file)`; a file that is not a whole safetensors file (too short, a header
    length past its end, a damaged header, tensors past its end) raises CheckpointError naming
    it. The header length is checked here, for a clearer message than the reader's."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read it ({e.strerror or e})") from None
    if len(head) < 8:
        raise CheckpointError(
            f"{file}: {size} bytes, too short for a safetensors file (truncated or empty)"
        )
    (header_len,) = struct.unpack("<Q", head)
    if 8 + header_len > size:
        raise CheckpointError(
            f"{file}: its header length ({header_len} bytes) runs past the end of the file "
            f"({size} bytes): truncated, or not a safetensors file"
        )
    try:
        handle = safe_open(file, framework=framework)
    except (SafetensorError, OSError) as e:
        reason = str(e).removeprefix("Error while deserializing header: ")
        if "not fully covered" in reason:  # the header's tensor offsets disagree with the size
            raise CheckpointError(
                f"{file}: truncated or damaged (its header's tensors do not fill the "
                f"{size} bytes of the file)"
            ) from None
        raise CheckpointError(f"{file}: not a valid safetensors file ({reason})") from None
    with handle as f:
        yield f


def _weight_files(path: Path) -> tuple[dict[str, Path], Path]:
    """(key → file, the file that lists the keys), from one `model.safetensors` or a sharded
    index; CheckpointError naming the file that is missing or damaged."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            raise CheckpointError(f"{index}: not a readable JSON object") from None
        if not isinstance(weight_map, dict) or not all(
            isinstance(name, str) for name in weight_map.values()
        ):
            raise CheckpointError(f"{index}: no 'weight_map' object of file names")
        files = {key: path / name for key, name in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.exists():
                raise CheckpointError(f"{index} names {file.name}, which does not exist")
        return files, index
    single = path / "model.safetensors"
    if not single.exists():
        raise CheckpointError(f"{path}: neither model.safetensors nor model.safetensors.index.json")
    with _open(single) as f:
        return {key: single for key in f.keys()}, single


def _check(cfg: HuginnConfig, files: dict[str, Path], source: Path) -> None:
    """Raises one CheckpointError listing every missing, unexpected, misshapen or non-float key,
    naming `source` (the weights file or the index) and the first problem's key."""
    table = param_table(cfg)
    problems = []
    present = {key for key in files if key not in _IGNORED_KEYS}
    for key in sorted(table.keys() - present):
        problems.append(f"missing key {key} (expected shape {list(table[key][1])})")
    unexpected = present - table.keys() - ({_TIED_HEAD} if cfg.tie_embeddings else set())
    for key in sorted(unexpected):
        problems.append(f"unexpected key {key}")
    for key in sorted(present & table.keys()):
        with _open(files[key]) as f:
            tensor = f.get_slice(key)
            shape, dtype = tuple(tensor.get_shape()), tensor.get_dtype()
        if shape != table[key][1]:
            problems.append(
                f"{key}: checkpoint shape {list(shape)}, model expects {list(table[key][1])}"
            )
        if dtype not in _FLOAT_DTYPES:
            problems.append(f"{key}: dtype {dtype} is not a floating-point type")
    if problems:
        more = (
            f" (and {len(problems) - 1} more: {'; '.join(problems[1:4])})"
            if len(problems) > 1
            else ""
        )
        raise CheckpointError(f"{source}: {problems[0]}{more}")


def from_pretrained(
    path: str | Path, dtype=jnp.float32, *, mesh: jax.sharding.Mesh | None = None
) -> Huginn:
    """Loads `config.json` and `model.safetensors` (or shards) from `path`, params in `dtype`.
    With `mesh`, the model split over its "model" axis as `parallel.shard_model` splits it: each
    tensor is laid out on the host as it is read and each device receives only its slices
    (`parallel.place_param`), so no device ever holds the whole model.

    A missing or damaged file, a wrong-typed config.json value and a missing or misshapen
    tensor raise CheckpointError: one line naming the file and the key."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    if not (path / "config.json").exists():
        raise CheckpointError(f"{path}: no config.json")
    cfg = HuginnConfig.from_hf_json(path / "config.json")
    files, source = _weight_files(path)
    _check(cfg, files, source)

    config = cfg if mesh is None else dataclasses.replace(cfg, mesh=mesh)
    abstract = nnx.eval_shape(lambda: Huginn(config, rngs=nnx.Rngs(0), dtype=dtype))
    graphdef, state = nnx.split(abstract)
    values: dict = {}
    for key, (param_path, _, transposed) in param_table(cfg).items():
        with _open(files[key]) as f:  # host numpy, one tensor at a time
            array = f.get_tensor(key)
        array = np.asarray(array.T if transposed else array, jnp.dtype(dtype))
        node = values
        for part in param_path[:-1]:
            node = node.setdefault(part, {})
        node[param_path[-1]] = parallel.place_param(param_path, array, config)
    nnx.replace_by_pure_dict(state, values)
    return nnx.merge(graphdef, state)


def hf_config_dict(cfg: HuginnConfig) -> dict:
    """The fields of a reference `config.json` that `HuginnConfig.from_hf_json` reads back."""
    return {
        "architectures": ["RavenForCausalLM"],
        "model_type": "huginn_raven",
        "n_embd": cfg.n_embd,
        "n_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "padded_vocab_size": cfg.vocab_size,
        "n_layers_in_prelude": cfg.n_layers_in_prelude,
        "n_layers_in_recurrent_block": cfg.n_core,
        "n_layers_in_coda": cfg.n_layers_in_coda,
        "block_size": cfg.block_size,
        "rope_base": cfg.rope_base,
        "norm_eps": cfg.norm_eps,
        "qk_bias": cfg.qk_bias,
        "tie_embeddings": cfg.tie_embeddings,
        "bias": False,
        "mean_recurrence": cfg.mean_recurrence,
        "mean_backprop_depth": cfg.mean_backprop_depth,
        "effective_expected_depth": cfg.effective_expected_depth,
        "init_values": {
            "std": cfg.init_std,
            "embedding": cfg.init_std,
            "out_proj": cfg.out_proj_std,
            "embed_scale": cfg.embed_scale,
        },
    }


def save_pretrained(model: Huginn, path: str | Path) -> None:
    """Writes `config.json` and `model.safetensors` in the reference's layout, each atomically
    with the usual file mode (`files.write_atomic`)."""
    model = parallel.gather_model(model)  # a model on a mesh: back to the checkpoint's layout
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    tensors = {}
    for key, (param_path, _, transposed) in param_table(model.config).items():
        array = state
        for part in param_path:
            array = array[part]
        tensors[key] = jnp.asarray(array.T if transposed else array)
    if model.config.tie_embeddings:
        tensors[_TIED_HEAD] = tensors["transformer.wte.weight"]
    tensors = {key: jax.device_get(value) for key, value in tensors.items()}
    arrays = {k: jnp.asarray(np.ascontiguousarray(v)) for k, v in tensors.items()}
    write_atomic(path / "model.safetensors", lambda tmp: save_file(arrays, tmp))
    write_text_atomic(
        path / "config.json", json.dumps(hf_config_dict(model.config), indent=2) + "\n"
    )
