"""The request of /infernet/blocks (IPIP-0003 §4, §4.2): what a client may ask and how a server reads it.

Rules of this file:
- Pure: bytes in, the request (or CodecError naming what is wrong) out; the streams are agent/content/exchange.py's.
- A request body is canonical msgpack ``{"want": [CID bytes, ...]}``, 1..MAX_WANTS CIDs, at most
  MAX_REQUEST_BYTES; on the wire it follows its uvarint length.
- On PROTOCOL_WAIT (1.1.0) two more keys may come: ``"wait"`` (integer ms, 0..MAX_WAIT_MS: how long the server
  waits for each block it lacks yet before it says so) and ``"shallow"`` (true: each wanted CID's own block only,
  not the DAG under it). On PROTOCOL (1.0.0) either key makes the request malformed.
- A client sends a key only when it asks for something (no ``"wait": 0``, no ``"shallow": false``), so a 1.1.0
  request that asks for neither is byte for byte a 1.0.0 request.
The vectors are ``ipips/vectors/blocks-request.json`` (scripts/make_blocks_vectors.py).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from protocol.cid import CID, varint_encode
from protocol.codec import canonical_encode, decode_canonical
from protocol.errors import CIDError, CodecError

PROTOCOL = "/infernet/blocks/1.0.0"
PROTOCOL_WAIT = "/infernet/blocks/1.1.0"  # the same, and a request may ask the server to wait for blocks
MAX_REQUEST_BYTES = 64 * 1024
MAX_WANTS = 1024
MAX_WAIT_MS = 10_000


class Request(NamedTuple):
    wants: list[CID]
    wait_ms: int = 0
    shallow: bool = False


def encode_request(wants: list[CID], wait_ms: int = 0, shallow: bool = False) -> bytes:
    """A request with its uvarint length; ``wait_ms`` and ``shallow`` only on PROTOCOL_WAIT."""
    request: dict[str, Any] = {"want": [cid.to_bytes() for cid in wants]}
    if wait_ms:
        request["wait"] = wait_ms
    if shallow:
        request["shallow"] = True
    body = canonical_encode(request)
    return varint_encode(len(body)) + body


def parse_request(body: bytes, protocol: str = PROTOCOL) -> Request:
    """The request in ``body`` (without its length prefix), as ``protocol`` reads it; CodecError if malformed."""
    try:
        request = decode_canonical(body, max_bytes=MAX_REQUEST_BYTES)
        allowed = {"want", "wait", "shallow"} if protocol == PROTOCOL_WAIT else {"want"}
        if not isinstance(request, dict) or "want" not in request or not set(request) <= allowed:
            raise CodecError("bad-request", "expected a map with the key 'want'" +
                             (" and perhaps 'wait', 'shallow'" if protocol == PROTOCOL_WAIT else " only"))
        wants = request["want"]
        if not isinstance(wants, list) or not 1 <= len(wants) <= MAX_WANTS:
            raise CodecError("bad-request", f"'want' must list 1..{MAX_WANTS} CIDs")
        if not all(isinstance(w, bytes) for w in wants):
            raise CodecError("bad-request", "'want' entries must be CID bytes")
        wait = request.get("wait", 0)
        if not isinstance(wait, int) or isinstance(wait, bool) or not 0 <= wait <= MAX_WAIT_MS:
            raise CodecError("bad-request", f"'wait' must be an integer 0..{MAX_WAIT_MS} (ms)")
        shallow = request.get("shallow", False)
        if not isinstance(shallow, bool):
            raise CodecError("bad-request", "'shallow' must be true or false")
        return Request([CID.from_bytes(w) for w in wants], wait, shallow)
    except CIDError as exc:
        raise CodecError("bad-request", str(exc)) from None
