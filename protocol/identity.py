"""Peer identity: an Ed25519 key pair and the libp2p peer ID it maps to.

One key names a peer everywhere: the libp2p host is built from it (so a connection's remote peer
ID is this ID) and every envelope is signed with it (so a message's signer is the same peer).

Peer ID rule (libp2p peer-ids spec): serialise the public key as the protobuf
``PublicKey { KeyType Type = 1 [Ed25519]; bytes Data = 2 }``. That is 36 bytes, at most 42, so the
multihash is the *identity* multihash (code 0x00) of those bytes; the text form is base58btc of
the multihash, which for Ed25519 always starts ``12D3KooW``.

Key file rule: the file holds the protobuf ``PrivateKey { Type = Ed25519, Data = seed || pubkey }``
(64 bytes of data, the layout go-libp2p and Kubo use; py-libp2p's 32-byte seed-only form is read too), written with mode 0600 through a temp file
and rename so it is never half-written. Loading refuses a file that group or others can read.
The file handling lives in agent/keyfile.py; this module only parses the bytes
(``Identity.from_private_key_protobuf``).
"""

from __future__ import annotations

import functools

from dataclasses import dataclass, field

import nacl.exceptions
import nacl.signing

from protocol.cid import b58decode, b58encode
from protocol.errors import CIDError, KeyFileError

KEY_TYPE_ED25519 = 1
PUBLIC_KEY_LEN = 32
SIGNATURE_LEN = 64
_PB_PUBKEY_PREFIX = bytes([0x08, KEY_TYPE_ED25519, 0x12, PUBLIC_KEY_LEN])
_PB_PRIVKEY_PREFIX = bytes([0x08, KEY_TYPE_ED25519, 0x12, 64])
_IDENTITY_MH = 0x00


def public_key_protobuf(public_key: bytes) -> bytes:
    """libp2p's protobuf serialisation of an Ed25519 public key."""
    if len(public_key) != PUBLIC_KEY_LEN:
        raise ValueError("Ed25519 public key must be 32 bytes")
    return _PB_PUBKEY_PREFIX + public_key


def peer_id_bytes(public_key: bytes) -> bytes:
    """The binary peer ID: identity multihash of the protobuf public key."""
    pb = public_key_protobuf(public_key)
    return bytes([_IDENTITY_MH, len(pb)]) + pb


def peer_id_from_public_key(public_key: bytes) -> str:
    """The libp2p peer ID string (``12D3KooW...``) of an Ed25519 public key."""
    return b58encode(peer_id_bytes(public_key))


def public_key_from_peer_id(peer_id: str) -> bytes:
    """Recover the Ed25519 public key embedded in a peer ID; raise KeyFileError if it has none."""
    try:
        raw = b58decode(peer_id)
    except CIDError as exc:
        raise KeyFileError(f"invalid peer ID {peer_id!r}: {exc}") from None
    if len(raw) != 38 or raw[0] != _IDENTITY_MH or raw[1] != 36 or raw[2:6] != _PB_PUBKEY_PREFIX:
        raise KeyFileError(f"peer ID {peer_id!r} does not embed an Ed25519 public key")
    return raw[6:]


def verify_signature(public_key: bytes, message: bytes, signature: bytes) -> bool:
    """True iff ``signature`` is a valid Ed25519 signature of ``message`` by ``public_key``."""
    if len(public_key) != PUBLIC_KEY_LEN or len(signature) != SIGNATURE_LEN:
        return False
    try:
        nacl.signing.VerifyKey(public_key).verify(message, signature)
        return True
    except (nacl.exceptions.BadSignatureError, nacl.exceptions.ValueError, nacl.exceptions.TypeError):
        return False


@dataclass(frozen=True)
class Identity:
    """An Ed25519 key pair. ``seed`` is the 32-byte private seed."""

    seed: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.seed, bytes) or len(self.seed) != 32:
            raise ValueError("Ed25519 seed must be 32 bytes")

    @classmethod
    def generate(cls) -> "Identity":
        return cls(bytes(nacl.signing.SigningKey.generate()))

    # derived once per identity (a key pair from its seed is a scalar multiplication): a running agent asked for
    # its own peer ID on every gossip message it validated and every job it showed (py-spy, the demo's submitter)
    @functools.cached_property
    def _signing_key(self) -> nacl.signing.SigningKey:
        return nacl.signing.SigningKey(self.seed)

    @functools.cached_property
    def public_key(self) -> bytes:
        return bytes(self._signing_key.verify_key)

    @functools.cached_property
    def peer_id(self) -> str:
        return peer_id_from_public_key(self.public_key)

    def sign(self, message: bytes) -> bytes:
        return self._signing_key.sign(message).signature

    def private_key_protobuf(self) -> bytes:
        """libp2p's serialisation of the private key (what the key file holds)."""
        return _PB_PRIVKEY_PREFIX + self.seed + self.public_key

    @classmethod
    def from_private_key_protobuf(cls, data: bytes, where: str = "key") -> "Identity":
        """Accept go-libp2p/Kubo's layout (seed || pubkey, 64 bytes) and py-libp2p's (seed, 32 bytes)."""
        if len(data) == 36 and data[:4] == _PB_PRIVKEY_PREFIX[:3] + bytes([32]):
            return cls(bytes(data[4:36]))
        if len(data) != 68 or data[:4] != _PB_PRIVKEY_PREFIX:
            raise KeyFileError(f"{where}: not a libp2p Ed25519 private key (expected a 68-byte protobuf)")
        ident = cls(bytes(data[4:36]))
        if ident.public_key != data[36:68]:
            raise KeyFileError(f"{where}: public half does not match the private seed")
        return ident
