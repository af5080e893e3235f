"""Canonical msgpack: the one encoding of every signed or hashed structure.

Rules of this file:
- Values are None, bool, int (-2**63 .. 2**64-1), finite float (always float64), str, bytes,
  lists (tuples encode as lists) and maps with str keys. Nothing else: no ext types, no NaN/inf.
- Canonical form: map keys sorted by their UTF-8 bytes, the shortest msgpack integer form, floats
  as float64, str as msgpack str, bytes as msgpack bin. ``canonical_encode`` produces exactly it.
- ``decode_canonical`` reads UNTRUSTED bytes: it enforces a size limit, msgpack's own length
  limits, a nesting limit, and that the input is already canonical (re-encoding gives the same
  bytes), so one value has one encoding and message IDs cannot be varied by re-encoding. Any
  failure raises ``CodecError`` and nothing else.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack

from protocol.errors import CodecError

MAX_DEPTH = 16
MAX_CONTAINER_LEN = 4096
DEFAULT_MAX_BYTES = 256 * 1024

_INT_MIN = -(2**63)
_INT_MAX = 2**64 - 1


def _canonicalize(value: Any, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise CodecError("too-deep", f"nesting deeper than {MAX_DEPTH}")
    if value is None or isinstance(value, (bool, str, bytes)):
        return value
    if isinstance(value, int):
        if not _INT_MIN <= value <= _INT_MAX:
            raise CodecError("bad-value", f"integer {value} out of 64-bit range")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CodecError("bad-value", "non-finite float")
        return value
    if isinstance(value, (list, tuple)):
        return [_canonicalize(v, depth + 1) for v in value]
    if isinstance(value, dict):
        items = []
        for k, v in value.items():
            if not isinstance(k, str):
                raise CodecError("bad-value", f"map key {k!r} is not a string")
            items.append((k.encode("utf-8"), k, _canonicalize(v, depth + 1)))
        items.sort(key=lambda item: item[0])
        return {k: v for _, k, v in items}
    raise CodecError("bad-value", f"type {type(value).__name__} is not encodable")


def canonical_encode(value: Any) -> bytes:
    """Encode ``value`` in canonical msgpack (see the module rules); raise CodecError if it can't be."""
    return msgpack.packb(_canonicalize(value, 0), use_bin_type=True, use_single_float=False)


def decode_canonical(data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    """Decode untrusted canonical msgpack; raise only CodecError."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError("bad-input", f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > max_bytes:
        raise CodecError("oversize", f"{len(data)} bytes > limit {max_bytes}")
    if not data:
        raise CodecError("truncated", "empty input")
    try:
        value = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=max_bytes,
            max_bin_len=max_bytes,
            max_array_len=MAX_CONTAINER_LEN,
            max_map_len=MAX_CONTAINER_LEN,
            max_ext_len=0,
        )
    except msgpack.ExtraData:
        raise CodecError("trailing-bytes", "extra bytes after the value") from None
    except (msgpack.OutOfData, ValueError) as exc:
        if isinstance(exc, msgpack.OutOfData) or "incomplete" in str(exc).lower():
            raise CodecError("truncated", "input ends inside a value") from None
        raise CodecError("malformed", str(exc)[:120]) from None
    except Exception as exc:  # msgpack raises assorted types (TypeError, StackError, ...) on hostile input
        raise CodecError("malformed", f"{type(exc).__name__}: {str(exc)[:100]}") from None
    if canonical_encode(value) != data:
        raise CodecError("non-canonical", "input is not in canonical msgpack form")
    return value

