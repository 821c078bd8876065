"""Measurement helpers every experiment shares: timing, ncu, traces, results JSON, plots."""
