"""Byte sizes: parsing what people type and printing what people read.

Binary and decimal units are kept distinct on purpose: a "512GB" Mac Studio
has 512 GiB of RAM, and a planner that silently treated GB as GiB (or the
reverse) would be off by 7% at exactly the scale where that matters.
Single-letter suffixes (``K``, ``M``, ``G``, ``T``) are binary, like
``truncate``, ``dd`` and llama.cpp's own MiB/GiB logs.
"""

from __future__ import annotations

import re

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": KiB,
    "kib": KiB,
    "kb": 1000,
    "m": MiB,
    "mib": MiB,
    "mb": 1000**2,
    "g": GiB,
    "gib": GiB,
    "gb": 1000**3,
    "t": TiB,
    "tib": TiB,
    "tb": 1000**4,
}

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Parse ``"512GiB"``, ``"1.5T"``, ``"200GB"`` or a plain byte count."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative: {text}")
        return text
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ValueError(f"not a size: {text!r} (expected e.g. 512GiB, 200GB, 64M)")
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"unknown size unit {unit!r} in {text!r} (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")
    return int(float(number) * factor)


def format_size(n_bytes: int | float) -> str:
    """Human-readable binary size, e.g. ``"578.3 GiB"``; negative sizes keep their sign."""
    sign = "-" if n_bytes < 0 else ""
    value = float(abs(n_bytes))
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{sign}{value:.0f} {unit}" if unit == "B" else f"{sign}{value:.1f} {unit}"
        value /= 1024
    return f"{sign}{value:.2f} TiB"


def pad(n: int, alignment: int) -> int:
    """Round ``n`` up to a multiple of ``alignment`` (GGML_PAD)."""
    return (n + alignment - 1) // alignment * alignment
