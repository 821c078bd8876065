"""Generates tokens with Huginn and reports latency, throughput and memory.

    python -m huginn_jax.generate --checkpoint=DIR --prompt="The capital of France is"
    python -m huginn_jax.generate --config=micro --random_weights --prompt_len=8 --criterion=kl

Prints each sequence's tokens (decoded with the checkpoint's tokenizer.json when there is one),
then a table: compile and prefill times, decode latency per token, tokens/s, achieved bandwidth,
cache and weight sizes and peak memory. Every flag is checked before weights are loaded; a bad
value or a damaged model file ends in one line `generate: ...` and exit status 2.
"""

from huginn_jax.generate.cli import cli

cli()
