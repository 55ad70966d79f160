"""The demo models' two sizes: "small" (the stack and the benchmarks) and "tiny" (tests)."""

from __future__ import annotations

from typing import Any

SIZES = ("small", "tiny")


def by_size(size: str, *, small: dict[str, Any], tiny: dict[str, Any]) -> dict[str, Any]:
    """A family's demo dimensions for `size`; any other size is refused, naming the two."""
    if size not in SIZES:
        raise ValueError(f"demo size {size!r} is unknown (use 'small' or 'tiny')")
    return dict(small if size == "small" else tiny)
