"""Content identifiers: multihash, CIDv0 and CIDv1, multibase base58btc and base32.

Only what the protocol uses: sha2-256 multihashes, codecs dag-pb (0x70) and raw (0x55).
CIDv0 is ``base58btc(multihash)`` of a dag-pb node ("Qm..."); CIDv1 is ``'b' + base32lower(
varint(1) varint(codec) multihash)`` ("bafy..." for dag-pb, "bafk..." for raw). See ipips/0003.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass

from protocol.errors import CIDError

SHA2_256 = 0x12
DAG_PB = 0x70
RAW = 0x55
CODEC_NAMES = {DAG_PB: "dag-pb", RAW: "raw"}
MAX_CID_TEXT = 128

_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {c: i for i, c in enumerate(_B58)}


def b58encode(data: bytes) -> str:
    n = int.from_bytes(data, "big")
    out = []
    while n:
        n, r = divmod(n, 58)
        out.append(_B58[r])
    pad = len(data) - len(data.lstrip(b"\0"))
    return "1" * pad + "".join(reversed(out))


def b58decode(text: str) -> bytes:
    n = 0
    for ch in text:
        try:
            n = n * 58 + _B58_INDEX[ch]
        except KeyError:
            raise CIDError(f"invalid base58 character {ch!r}") from None
    pad = len(text) - len(text.lstrip("1"))
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    return b"\0" * pad + body


def varint_encode(n: int) -> bytes:
    if n < 0:
        raise ValueError("varint must be non-negative")
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def varint_decode(data: bytes, pos: int = 0) -> tuple[int, int]:
    """Decode an unsigned LEB128 varint at ``pos``; return (value, next position)."""
    result = 0
    shift = 0
    while True:
        if pos >= len(data):
            raise CIDError("truncated varint")
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise CIDError("varint too long")


def multihash_sha256(digest: bytes) -> bytes:
    return bytes([SHA2_256, 32]) + digest


@dataclass(frozen=True)
class CID:
    """A parsed CID. ``digest`` is the sha2-256 digest of the block the CID names."""

    version: int
    codec: int
    digest: bytes

    @classmethod
    def for_block(cls, block: bytes, codec: int, version: int = 1) -> "CID":
        return cls(version, codec, hashlib.sha256(block).digest())

    @property
    def multihash(self) -> bytes:
        return multihash_sha256(self.digest)

    def to_bytes(self) -> bytes:
        if self.version == 0:
            return self.multihash
        return varint_encode(1) + varint_encode(self.codec) + self.multihash

    def encode(self) -> str:
        if self.version == 0:
            return b58encode(self.multihash)
        return "b" + base64.b32encode(self.to_bytes()).decode("ascii").lower().rstrip("=")

    def __str__(self) -> str:
        return self.encode()

    def matches(self, block: bytes) -> bool:
        return hashlib.sha256(block).digest() == self.digest

    @classmethod
    def from_bytes(cls, data: bytes) -> "CID":
        if len(data) == 34 and data[0] == SHA2_256 and data[1] == 32:
            return cls(0, DAG_PB, bytes(data[2:]))
        version, pos = varint_decode(data, 0)
        if version != 1:
            raise CIDError(f"unsupported CID version {version}")
        codec, pos = varint_decode(data, pos)
        if codec not in CODEC_NAMES:
            raise CIDError(f"unsupported CID codec 0x{codec:x}")
        code, pos = varint_decode(data, pos)
        length, pos = varint_decode(data, pos)
        if code != SHA2_256 or length != 32:
            raise CIDError("unsupported multihash (only sha2-256 is accepted)")
        digest = data[pos:]
        if len(digest) != 32:
            raise CIDError("multihash digest length does not match")
        return cls(1, codec, bytes(digest))


def parse_cid(text: str) -> CID:
    """Parse a CID string (CIDv0 ``Qm...`` or CIDv1 base32 ``b...``); raise CIDError naming it."""
    if not isinstance(text, str) or not text or len(text) > MAX_CID_TEXT:
        raise CIDError(f"not a CID: {str(text)[:80]!r}")
    try:
        if len(text) == 46 and text.startswith("Qm"):
            cid = CID.from_bytes(b58decode(text))
            if cid.version != 0:
                raise CIDError("bad CIDv0")
            return cid
        if text[0] == "b":
            body = text[1:].upper()
            raw = base64.b32decode(body + "=" * (-len(body) % 8))
            cid = CID.from_bytes(raw)
            if cid.encode() != text:
                raise CIDError("non-canonical encoding")
            return cid
        raise CIDError("unsupported multibase (expected CIDv0 'Qm...' or base32 CIDv1 'b...')")
    except CIDError as exc:
        raise CIDError(f"invalid CID {text!r}: {exc}") from None
    except (ValueError, TypeError) as exc:
        raise CIDError(f"invalid CID {text!r}: {exc}") from None
