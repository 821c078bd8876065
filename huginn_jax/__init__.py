"""huginn-jax: the Huginn recurrent-depth transformer in JAX/Flax."""

from huginn_jax.checkpoint import CheckpointError, from_pretrained, save_pretrained
from huginn_jax.config import PRESETS, HuginnConfig, huginn_0125
from huginn_jax.kv_cache import KVCache
from huginn_jax.model import Huginn, HuginnOutput, initial_state, random_init

__all__ = [
    "PRESETS",
    "CheckpointError",
    "Huginn",
    "HuginnConfig",
    "HuginnOutput",
    "KVCache",
    "from_pretrained",
    "huginn_0125",
    "initial_state",
    "random_init",
    "save_pretrained",
]
