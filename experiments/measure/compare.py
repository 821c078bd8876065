"""The "vs best" column of every comparison table.

For each row: the fastest time of the *other* framework (JAX vs PyTorch) measured in the same run
and case, divided by this row's time. Above 1 the row beats the other framework's best; below 1
it loses to it. A row with no rival of the other framework in its case gets None.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any


def framework(impl: str) -> str:
    """ "torch" for the PyTorch rows (impl names start with "torch"), "jax" for every other."""
    return "torch" if impl.startswith("torch") else "jax"


def add_vs_best(
    records: Sequence[dict[str, Any]],
    *,
    group_keys: Iterable[str],
    time_key: str,
    impl_key: str = "impl",
    framework_of: Callable[[str], str] = framework,
) -> None:
    """Sets `record["vs_best"]` (and `record["best_rival"]`, the impl it is compared with) in place.

    Records are grouped by the values of `group_keys` (the case: size, batch, mode, ...); within a
    group, a record's rival is the other framework's record with the smallest `time_key`.
    """
    keys = tuple(group_keys)
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for rec in records:
        groups.setdefault(tuple(rec.get(k) for k in keys), []).append(rec)
    for group in groups.values():
        for rec in group:
            mine = framework_of(rec[impl_key])
            rivals = [r for r in group if framework_of(r[impl_key]) != mine and r.get(time_key)]
            if not rivals or not rec.get(time_key):
                rec["vs_best"], rec["best_rival"] = None, None
                continue
            best = min(rivals, key=lambda r: r[time_key])
            rec["vs_best"] = best[time_key] / rec[time_key]
            rec["best_rival"] = best[impl_key]


def format_vs_best(value: float | None) -> str:
    """ "1.23x", or "-" where the row has no rival in its case."""
    return "-" if value is None else f"{value:.2f}x"
