"""Experiments: absl programs that measure the Huginn JAX port and its kernels on a GPU."""
