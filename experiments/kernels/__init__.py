"""Programs that measure the Pallas kernels alone: correctness against their references, device
times, tuning sweeps (`python -m experiments.kernels.NAME --help`)."""
