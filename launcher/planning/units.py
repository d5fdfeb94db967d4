"""Units of the plan: bytes per GiB, and the figures as the plan's lines and JSON write them."""
from __future__ import annotations

GiB = 2**30


def count_text(n: float) -> str:
    """A count for a sentence: 1.2B, 340M, 12k."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.3g}"


def size_text(gib: float) -> str:
    """A GiB figure for a sentence: GiB up to 1024, then TiB, PiB, EiB."""
    for unit in ("GiB", "TiB", "PiB", "EiB"):
        if abs(gib) < 1024 or unit == "EiB":
            return f"{gib:.2f} {unit}" if unit == "GiB" else f"{gib:.3g} {unit}"
        gib /= 1024


def gib(x: float) -> float:
    """Bytes as GiB, rounded to 2 places (the plan's figures)."""
    return round(x / GiB, 2)
