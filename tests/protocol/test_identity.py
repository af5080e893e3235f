import os
import stat

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from agent.keyfile import load_identity, save_identity
from protocol.errors import KeyFileError
from protocol.identity import (
    Identity,
    peer_id_from_public_key,
    public_key_from_peer_id,
    verify_signature,
)


@pytest.mark.parametrize("seed", [bytes(32), bytes(range(32)), b"\xff" * 32, None],
                         ids=["zeros", "range", "ones", "random"])
def test_peer_id_matches_py_libp2p(seed):
    seed = os.urandom(32) if seed is None else seed  # a fresh random key each run (ids stay stable)
    ours = Identity(seed)
    keypair = create_new_key_pair(seed)
    assert keypair.public_key.to_bytes() == ours.public_key
    assert ID.from_pubkey(keypair.public_key).to_base58() == ours.peer_id
    assert ours.peer_id.startswith("12D3KooW")
    # and py-libp2p's own serialised private key loads as the same identity
    assert Identity.from_private_key_protobuf(keypair.private_key.serialize()).peer_id == ours.peer_id


def test_peer_id_round_trips_to_public_key():
    ident = Identity.generate()
    assert public_key_from_peer_id(ident.peer_id) == ident.public_key
    assert peer_id_from_public_key(ident.public_key) == ident.peer_id
    with pytest.raises(KeyFileError):
        public_key_from_peer_id("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")  # an RSA-style ID
    with pytest.raises(KeyFileError):
        public_key_from_peer_id("not-a-peer-id!")


def test_sign_and_verify():
    ident = Identity.generate()
    sig = ident.sign(b"hello")
    assert verify_signature(ident.public_key, b"hello", sig)
    assert not verify_signature(ident.public_key, b"hellO", sig)
    assert not verify_signature(Identity.generate().public_key, b"hello", sig)
    assert not verify_signature(ident.public_key, b"hello", sig[:-1])


def test_key_file_written_0600_and_loaded(tmp_path):
    path = tmp_path / "home" / "identity.key"
    ident = Identity.generate()
    save_identity(ident, path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_identity(path) == ident
    assert not list(path.parent.glob(".*tmp*")), "no temp file left behind"
    with pytest.raises(KeyFileError, match="already exists"):
        save_identity(Identity.generate(), path)
    assert load_identity(path) == ident, "refused overwrite kept the old key"


def test_key_file_readable_by_others_is_refused(tmp_path):
    path = tmp_path / "identity.key"
    save_identity(Identity.generate(), path)
    os.chmod(path, 0o644)
    with pytest.raises(KeyFileError, match=r"accessible by others \(mode 0644\).*chmod 600"):
        load_identity(path)


def test_key_file_errors_are_clear(tmp_path):
    with pytest.raises(KeyFileError, match="no key file here"):
        load_identity(tmp_path / "missing.key")
    bad = tmp_path / "bad.key"
    bad.write_bytes(b"garbage")
    os.chmod(bad, 0o600)
    with pytest.raises(KeyFileError, match="not a libp2p Ed25519 private key"):
        load_identity(bad)
    mismatched = tmp_path / "mismatch.key"
    data = bytearray(Identity.generate().private_key_protobuf())
    data[-1] ^= 1
    mismatched.write_bytes(bytes(data))
    os.chmod(mismatched, 0o600)
    with pytest.raises(KeyFileError, match="does not match"):
        load_identity(mismatched)
