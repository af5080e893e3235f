"""The on-disk blockstore: hash-checked puts, whole files only, corrupt files never served."""

import os

import pytest

from agent.content.blockstore import BlockStore
from protocol.cid import CID, DAG_PB, RAW
from protocol.errors import CIDError


def test_put_get_and_shared_digest(tmp_path):
    store = BlockStore(tmp_path / "blocks")
    data = os.urandom(1000)
    raw = CID.for_block(data, RAW)
    store.put(raw, data)
    assert store.has(raw) and store.get(raw) == data
    assert store.has(CID.for_block(data, DAG_PB, 0))  # same bytes, same file, whatever the CID form
    assert list(store.digests()) == [raw.digest]
    assert not [p for p in store.path_for(raw).parent.iterdir() if p.name.startswith(".")]


def test_a_block_that_does_not_match_its_cid_is_refused_and_named(tmp_path):
    store = BlockStore(tmp_path / "blocks")
    cid = CID.for_block(b"the real bytes", RAW)
    with pytest.raises(CIDError, match=str(cid)):
        store.put(cid, b"other bytes")
    assert not store.has(cid)


def test_a_corrupt_block_file_is_dropped_not_served(tmp_path):
    store = BlockStore(tmp_path / "blocks")
    data = b"x" * 5000
    cid = CID.for_block(data, RAW)
    store.put(cid, data)
    store.path_for(cid).write_bytes(b"y" * 5000)  # disk rot, or someone editing the store
    assert store.get(cid) is None and not store.has(cid)


def test_a_failed_write_leaves_no_file(tmp_path, monkeypatch):
    store = BlockStore(tmp_path / "blocks")
    data = b"z" * 100
    cid = CID.for_block(data, RAW)

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError):
        store.put(cid, data)
    assert not store.has(cid)
    assert list(store.path_for(cid).parent.iterdir()) == []
