"""Sealed results: a private job's final aggregate, readable by its submitter alone (ipips/0010-sealed-results.md).

Rules of this file:
- The submitter's encryption key is derived from its identity: the X25519 public key is the
  birational map of its Ed25519 public key (``crypto_sign_ed25519_pk_to_curve25519``), which anyone
  can compute from the submitter's peer ID; the private key from its Ed25519 seed
  (``crypto_sign_ed25519_sk_to_curve25519``). No key is announced or exchanged.
- Each file of the final aggregate bundle is sealed on its own with a libsodium sealed box
  (``crypto_box_seal``: an ephemeral X25519 key, XSalsa20-Poly1305): ``NAME`` becomes
  ``NAME.sealed`` holding ``ephemeral public key (32) || ciphertext || tag (16)``, 48 bytes more.
  A sealed box is randomised: sealing the same bytes twice gives different bytes, so the CID names
  the sealed bytes, not the plaintext.
- Opening checks the tag: bytes changed in transit or sealed to another key raise ``SealError``,
  never return garbage.
"""

from __future__ import annotations

from nacl.bindings import crypto_sign_ed25519_pk_to_curve25519, crypto_sign_ed25519_sk_to_curve25519
from nacl.exceptions import CryptoError
from nacl.public import PrivateKey, PublicKey, SealedBox

from protocol.errors import KeyFileError, ProtocolError
from protocol.identity import Identity, public_key_from_peer_id

SEALED_SUFFIX = ".sealed"
SEAL_OVERHEAD = 48  # ephemeral public key + Poly1305 tag


class SealError(ProtocolError):
    """A sealed file could not be opened (another key, or changed bytes) or sealed (a bad peer ID)."""


def sealed_name(name: str) -> str:
    return name + SEALED_SUFFIX


def x25519_public_key(peer_id: str) -> bytes:
    """The X25519 public key that a peer's results are sealed to, from its peer ID alone."""
    try:
        ed25519 = public_key_from_peer_id(peer_id)
    except KeyFileError as exc:
        raise SealError(f"cannot seal to {peer_id[:60]!r}: {exc}") from None
    return crypto_sign_ed25519_pk_to_curve25519(ed25519)


def x25519_private_key(identity: Identity) -> bytes:
    """The X25519 private key that opens what was sealed to ``identity``'s peer ID."""
    return crypto_sign_ed25519_sk_to_curve25519(identity.seed + identity.public_key)


def seal(data: bytes, peer_id: str) -> bytes:
    """``data`` sealed to ``peer_id``: only that peer's identity opens it."""
    return SealedBox(PublicKey(x25519_public_key(peer_id))).encrypt(bytes(data))


def unseal(sealed: bytes, identity: Identity, what: str = "sealed file") -> bytes:
    """Open bytes sealed to ``identity``; SealError naming ``what`` otherwise."""
    if len(sealed) < SEAL_OVERHEAD:
        raise SealError(f"{what}: {len(sealed)} bytes, shorter than a sealed box ({SEAL_OVERHEAD})")
    try:
        return SealedBox(PrivateKey(x25519_private_key(identity))).decrypt(bytes(sealed))
    except CryptoError:
        raise SealError(f"{what}: cannot be opened with the key of {identity.peer_id} "
                        "(sealed to another peer, or changed)") from None
