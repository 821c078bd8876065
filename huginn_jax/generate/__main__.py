"""`python -m huginn_jax.generate`."""

from huginn_jax.generate.cli import cli

cli()
