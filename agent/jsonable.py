"""Values as the control channel's JSON carries them: bytes as hex, tuples as lists, keys as strings.

Below the market, the job data and the control channel alike (they all answer with such values), so
none of them imports another for it (issue 23).
"""

from __future__ import annotations

from typing import Any


def plain(value: Any) -> Any:
    """``value`` with every bytes as its hex, every tuple as a list and every key as a string."""
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value
