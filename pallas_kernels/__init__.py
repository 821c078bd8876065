"""Pallas GPU kernels, each beside its plain-JAX reference."""
