"""Signed envelopes: how every gossiped message is framed, signed and checked.

Wire form (canonical msgpack map, protocol/codec.py)::

    {"v": 1, "t": type tag, "k": signer Ed25519 public key (32 bytes), "ts": milliseconds since
     the Unix epoch, "n": 16-byte random nonce, "b": message body map, "s": Ed25519 signature}

Signed bytes (domain-separated, so a signature can never be reused for another purpose or type)::

    b"infernet/v1\\x00" + type tag (UTF-8) + b"\\x00" + canonical_encode({v, t, k, ts, n, b})

Rules for an incoming envelope, in this order; the first that fails rejects it with CodecError:
 1. at most MAX_ENVELOPE_BYTES (well under GossipSub's 1 MiB RPC limit), canonical msgpack;
 2. exactly the fields above with their types and lengths; ``v`` must be PROTOCOL_VERSION;
 3. the type tag is known; 4. the signature verifies under ``k``;
 5. if the transport names a sender (libp2p's message source), it must be the signer's peer ID;
 6. the timestamp lies within [now - MAX_AGE_S, now + MAX_SKEW_S];
 7. the body is a valid message of that type (protocol/messages.py);
 8. the message ID, sha256 of the signed bytes, has not been seen before. A replay cache keeps each
    ID until its timestamp leaves the acceptance window, so a replay is either remembered or too old.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

from protocol import PROTOCOL_VERSION
from protocol.codec import canonical_encode, decode_canonical
from protocol.errors import CodecError
from protocol.identity import Identity, peer_id_from_public_key, verify_signature
from protocol.messages import MESSAGE_TYPES, decode_body

NOT_MISBEHAVIOUR = frozenset({"expired", "replayed"})
"""Rejection reasons that say nothing against the peer that handed us the envelope (IPIP-0001 §4):
a message older than the window is what a neighbour's recent-message cache, or a slow path, replays
in good faith to a peer that just joined or came back; and a message we accepted before is one the
forwarder cannot know we hold (it relays what it received, as GossipSub does). Both are dropped like
any rejected envelope, but never counted against the forwarder, so no newcomer or restarted peer is
blacklisted for what the network's own caches hand it (issue 21: a network older than two minutes
blacklisted every newcomer for `replayed` envelopes). A replay attack gains nothing from this: the
copy is dropped, and the transport's seen cache (SEEN_TTL_S) drops an identical one before it is
even checked."""
DOMAIN = b"infernet/v1\x00"
MAX_ENVELOPE_BYTES = 256 * 1024
MAX_SKEW_S = 30.0
MAX_AGE_S = 300.0
SEEN_TTL_S = MAX_AGE_S + MAX_SKEW_S
"""How long a gossip transport must remember a message it has seen: at least the envelope's whole
acceptance window (rule 6), so a copy that arrives while the envelope is still valid is recognised
as a duplicate by the transport, never validated again (IPIP-0001 §4)."""


def blames_forwarder(reason: str) -> bool:
    """Does a rejection for ``reason`` count against the peer that forwarded the envelope?"""
    return reason not in NOT_MISBEHAVIOUR
NONCE_LEN = 16
_FIELDS = {"v", "t", "k", "ts", "n", "b", "s"}


@dataclass(frozen=True)
class Envelope:
    version: int
    type: str
    public_key: bytes
    timestamp_ms: int
    nonce: bytes
    body: dict
    signature: bytes

    @property
    def signer(self) -> str:
        """The signer's libp2p peer ID."""
        return peer_id_from_public_key(self.public_key)

    def signed_bytes(self) -> bytes:
        return signed_bytes(self.version, self.type, self.public_key, self.timestamp_ms, self.nonce, self.body)

    @property
    def message_id(self) -> bytes:
        return hashlib.sha256(self.signed_bytes()).digest()

    @property
    def expires_at(self) -> float:
        """When this envelope leaves the acceptance window (rule 6): its timestamp + MAX_AGE_S."""
        return self.timestamp_ms / 1000.0 + MAX_AGE_S

    def to_bytes(self) -> bytes:
        return canonical_encode({
            "v": self.version, "t": self.type, "k": self.public_key, "ts": self.timestamp_ms,
            "n": self.nonce, "b": self.body, "s": self.signature,
        })


@dataclass(frozen=True)
class Opened:
    """A verified envelope and the message it carries."""

    envelope: Envelope
    message: Any

    @property
    def signer(self) -> str:
        return self.envelope.signer


def signed_bytes(version: int, type_tag: str, public_key: bytes, timestamp_ms: int, nonce: bytes, body: Any) -> bytes:
    header = {"v": version, "t": type_tag, "k": public_key, "ts": timestamp_ms, "n": nonce, "b": body}
    return DOMAIN + type_tag.encode("utf-8") + b"\x00" + canonical_encode(header)


def seal(identity: Identity, message: Any, *, now: float, nonce: Optional[bytes] = None) -> bytes:
    """Sign ``message`` as ``identity`` at time ``now`` (seconds) and return the envelope bytes."""
    body = message.to_wire()
    nonce = os.urandom(NONCE_LEN) if nonce is None else nonce
    ts = int(round(now * 1000))
    sig = identity.sign(signed_bytes(PROTOCOL_VERSION, message.TYPE, identity.public_key, ts, nonce, body))
    data = Envelope(PROTOCOL_VERSION, message.TYPE, identity.public_key, ts, nonce, body, sig).to_bytes()
    if len(data) > MAX_ENVELOPE_BYTES:
        raise CodecError("oversize", f"{message.TYPE} envelope is {len(data)} bytes > {MAX_ENVELOPE_BYTES}")
    return data


class ReplayCache:
    """Remembers message IDs until they expire; bounded, oldest expiry evicted first when full.

    Eviction before expiry could re-admit a replay of the evicted message, so the bound should be
    far above the number of messages seen in one MAX_AGE_S + MAX_SKEW_S window.
    """

    def __init__(self, max_entries: int = 200_000) -> None:
        self.max_entries = max_entries
        self._expiry: OrderedDict[bytes, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._expiry)

    def check_and_add(self, message_id: bytes, expires_at: float, now: float) -> bool:
        """Record ``message_id``; return False if it was already recorded (a replay)."""
        while self._expiry:
            oldest_id, oldest_exp = next(iter(self._expiry.items()))
            if oldest_exp > now and len(self._expiry) < self.max_entries:
                break
            del self._expiry[oldest_id]
        if message_id in self._expiry:
            return False
        self._expiry[message_id] = expires_at
        # keep insertion order ~ expiry order: envelopes arrive roughly in time order
        return True


def open_envelope(
    data: bytes,
    *,
    now: float,
    replay: Optional[ReplayCache] = None,
    expected_signer: Optional[str] = None,
    max_bytes: int = MAX_ENVELOPE_BYTES,
) -> Opened:
    """Check untrusted envelope bytes against every rule above; return the verified message."""
    raw = decode_canonical(data, max_bytes=max_bytes)
    env = _parse(raw)
    if env.type not in MESSAGE_TYPES:
        raise CodecError("unknown-type", f"message type {env.type[:40]!r}")
    if not verify_signature(env.public_key, env.signed_bytes(), env.signature):
        raise CodecError("bad-signature", f"{env.type} signature does not verify")
    signer = env.signer
    if expected_signer is not None and expected_signer != signer:
        raise CodecError("wrong-signer", f"signed by {signer}, sent by {expected_signer}")
    ts = env.timestamp_ms / 1000.0
    if ts > now + MAX_SKEW_S:
        raise CodecError("future", f"timestamp {ts - now:.1f} s in the future (max skew {MAX_SKEW_S:.0f} s)")
    if env.expires_at < now:
        raise CodecError("expired", f"timestamp {now - ts:.1f} s old (max age {MAX_AGE_S:.0f} s)")
    message = decode_body(env.type, env.body)
    if replay is not None and not replay.check_and_add(env.message_id, env.expires_at, now):
        raise CodecError("replayed", f"{env.type} message {env.message_id.hex()[:16]} by {signer[-8:]} already seen "
                                     f"({now - ts:.0f} s old)")
    return Opened(env, message)


def envelope_expiry(data: bytes, *, max_bytes: int = MAX_ENVELOPE_BYTES) -> float:
    """When the envelope ``data`` leaves the acceptance window (``Envelope.expires_at``), read without
    checking its signature: for bytes already checked once (a gossip cache). Never (inf) for bytes
    that are no well-formed envelope."""
    try:
        return _parse(decode_canonical(data, max_bytes=max_bytes)).expires_at
    except CodecError:
        return float("inf")


def _parse(raw: Any) -> Envelope:
    if not isinstance(raw, dict):
        raise CodecError("bad-envelope", "envelope is not a map")
    missing = _FIELDS - raw.keys()
    if missing:
        raise CodecError("bad-envelope", f"missing field {sorted(missing)[0]!r}")
    extra = raw.keys() - _FIELDS
    if extra:
        raise CodecError("bad-envelope", f"unknown field {sorted(extra)[0][:40]!r}")
    v, t, k, ts, n, b, s = (raw[f] for f in ("v", "t", "k", "ts", "n", "b", "s"))
    if not isinstance(v, int) or isinstance(v, bool):
        raise CodecError("bad-envelope", "field 'v' must be an integer")
    if v != PROTOCOL_VERSION:
        raise CodecError("bad-version", f"protocol version {v} (this agent speaks {PROTOCOL_VERSION})")
    if not isinstance(t, str) or not 0 < len(t) <= 32:
        raise CodecError("bad-envelope", "field 't' must be a short string")
    if not isinstance(k, bytes) or len(k) != 32:
        raise CodecError("bad-envelope", "field 'k' must be a 32-byte Ed25519 public key")
    if not isinstance(ts, int) or isinstance(ts, bool) or ts < 0:
        raise CodecError("bad-envelope", "field 'ts' must be a non-negative integer (ms)")
    if not isinstance(n, bytes) or len(n) != NONCE_LEN:
        raise CodecError("bad-envelope", f"field 'n' must be a {NONCE_LEN}-byte nonce")
    if not isinstance(b, dict):
        raise CodecError("bad-envelope", "field 'b' must be a map")
    if not isinstance(s, bytes) or len(s) != 64:
        raise CodecError("bad-envelope", "field 's' must be a 64-byte signature")
    return Envelope(v, t, k, ts, n, b, s)
