"""The PyTorch side of every comparison; torch is an optional dependency, imported lazily."""
