"""Byte counts as people read them, for messages and tables."""
from __future__ import annotations


def human_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it at least 1 (``"1.5 GiB"``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
