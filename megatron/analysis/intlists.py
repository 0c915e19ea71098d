"""Lists of integers as the command line and the reports write them: '1,3,5-8'."""

from __future__ import annotations

from typing import Iterable, List, Optional


def parse_int_list(text: Optional[str]) -> Optional[List[int]]:
    """'1,3,5-8' -> [1, 3, 5, 6, 7, 8] (None stays None)."""
    if text is None:
        return None
    out: List[int] = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part[1:]:
            lo, hi = part.split("-", 1) if not part.startswith("-") else (part, part)
            out.extend(range(int(lo), int(hi) + 1))
        else:
            out.append(int(part))
    return out


def format_int_list(values: Iterable[int]) -> str:
    """[1, 3, 5, 6, 7, 8] -> '1,3,5-8' (sorted, duplicates dropped)."""
    items = sorted(set(values))
    parts, start = [], None
    for i, value in enumerate(items):
        if start is None:
            start = value
        if i + 1 == len(items) or items[i + 1] != value + 1:
            parts.append(str(start) if start == value else f"{start}-{value}")
            start = None
    return ",".join(parts)
