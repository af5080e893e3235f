"""UnixFS import must match `ipfs add` (Kubo) byte for byte; decoding and verification must reject bad blocks."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.cid import CID, DAG_PB, RAW, parse_cid, varint_encode
from protocol.errors import CIDError
from protocol.unixfs import (
    CHUNK_SIZE,
    MAX_BLOCK_SIZE,
    MAX_LINKS,
    Block,
    StreamVerifier,
    child_cids,
    compute_cid,
    decode_node,
    import_bytes,
    import_file,
    iter_dfs,
    read_file,
    verify_block,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
SHARED_VECTORS = REPO_ROOT.parent / "shared" / "vectors" / "unixfs-cids.json"
IPIP_VECTORS = REPO_ROOT / "ipips" / "vectors"
VERSION_KEYS = {0: "cidv0", 1: "cidv1_raw_leaves"}


def pattern(size: int) -> bytes:
    """The shared vectors' input: byte i = (i * 31 + 7) & 0xff (period 256)."""
    period = bytes((i * 31 + 7) & 0xFF for i in range(256))
    return (period * (size // 256 + 1))[:size]


def random_bytes(size: int, seed: int = 1) -> bytes:
    return random.Random(seed).randbytes(size)


def load_shared_vectors() -> dict:
    if not SHARED_VECTORS.is_file():
        pytest.fail(
            f"Kubo UnixFS vectors not found at {SHARED_VECTORS}: the shared/ directory must sit beside the repository"
        )
    return json.loads(SHARED_VECTORS.read_text())


def subtree_size(cid: CID, store: dict[CID, bytes]) -> int:
    data = store[cid]
    if cid.codec == RAW:
        return len(data)
    return len(data) + sum(subtree_size(link.cid, store) for link in decode_node(data).links)


def depth_of(cid: CID, store: dict[CID, bytes]) -> int:
    if cid.codec == RAW:
        return 0
    links = decode_node(store[cid]).links
    return 1 + depth_of(links[0].cid, store) if links else 0


# --- Kubo vectors -------------------------------------------------------------------------------


def test_shared_kubo_vectors_reproduced_for_both_cid_versions():
    vectors = load_shared_vectors()
    assert vectors["generator"] == "byte i = (i * 31 + 7) & 0xff"
    cases = [(f"text {lit['text']!r}", lit["text"].encode(), lit) for lit in vectors["literal"]]
    cases += [(f"{vec['size']} pattern bytes", pattern(vec["size"]), vec) for vec in vectors["vectors"]]
    assert any(vec["size"] == 136_839_173 for vec in vectors["vectors"])
    wrong = []
    for label, data, expected in cases:
        for version, key in VERSION_KEYS.items():
            got = compute_cid(data, cid_version=version).encode()
            if got != expected[key]:
                wrong.append(f"{label} {key}: got {got}, Kubo gives {expected[key]}")
    assert not wrong, "\n".join(wrong)


def test_small_vectors_give_exact_blocks_in_dfs_preorder():
    vectors = json.loads((IPIP_VECTORS / "unixfs-small.json").read_text())
    assert vectors["chunk_size"] == CHUNK_SIZE and vectors["max_links"] == MAX_LINKS
    for case in vectors["cases"]:
        data = case["text"].encode() if "text" in case else pattern(case["pattern"])
        for version, key in VERSION_KEYS.items():
            expected = case[key]
            root, blocks = import_bytes(data, cid_version=version)
            assert root.encode() == expected["cid"]
            assert blocks[0].cid == root
            if "blocks" in expected:
                assert [(b.cid.encode(), b.data.hex()) for b in blocks] == [
                    (b["cid"], b["hex"]) for b in expected["blocks"]
                ]
            else:
                assert blocks[0].data.hex() == expected["root_hex"]
                assert len(blocks) == expected["block_count"]


def test_small_vectors_agree_with_the_shared_kubo_vectors():
    kubo = {vec["size"]: vec for vec in load_shared_vectors()["vectors"]}
    kubo_text = {lit["text"]: lit for lit in load_shared_vectors()["literal"]}
    for case in json.loads((IPIP_VECTORS / "unixfs-small.json").read_text())["cases"]:
        reference = kubo.get(case["pattern"]) if "pattern" in case else kubo_text.get(case["text"])
        if case.get("text") == "":
            reference = kubo[0]
        assert reference is not None, case
        for key in VERSION_KEYS.values():
            assert case[key]["cid"] == reference[key]


# --- Node encoding and layout ------------------------------------------------------------------


def test_cidv0_leaf_and_empty_file_encoding():
    root, blocks = import_bytes(b"hello world\n", cid_version=0)
    assert blocks == [Block(root, bytes.fromhex("0a120802120c") + b"hello world\n" + bytes.fromhex("180c"))]
    root, blocks = import_bytes(b"", cid_version=0)
    assert blocks[0].data == bytes.fromhex("0a0408021800")
    root, blocks = import_bytes(b"", cid_version=1)
    assert root.codec == RAW and blocks == [Block(root, b"")]


def test_one_chunk_file_is_its_leaf_and_two_chunks_get_a_root():
    for version in (0, 1):
        root, blocks = import_bytes(pattern(CHUNK_SIZE), cid_version=version)
        assert len(blocks) == 1 and root.codec == (DAG_PB if version == 0 else RAW)
        root, blocks = import_bytes(pattern(CHUNK_SIZE + 1), cid_version=version)
        node = decode_node(blocks[0].data)
        assert root.codec == DAG_PB and root.version == version
        assert node.blocksizes == (CHUNK_SIZE, 1) and node.filesize == CHUNK_SIZE + 1 and node.payload == b""
        assert [link.cid for link in node.links] == [b.cid for b in blocks[1:]]


def test_inner_node_serialization_is_links_then_data_with_empty_names():
    root, blocks = import_bytes(pattern(CHUNK_SIZE + 1), cid_version=1)
    leaf_a, leaf_b = blocks[1].cid.to_bytes(), blocks[2].cid.to_bytes()
    link_a = b"\x0a\x24" + leaf_a + b"\x12\x00\x18" + varint_encode(CHUNK_SIZE)
    link_b = b"\x0a\x24" + leaf_b + b"\x12\x00\x18\x01"
    unixfs = b"\x08\x02\x18" + varint_encode(CHUNK_SIZE + 1) + b"\x20" + varint_encode(CHUNK_SIZE) + b"\x20\x01"
    expected = b"\x12\x2c" + link_a + b"\x12\x2a" + link_b + b"\x0a" + bytes([len(unixfs)]) + unixfs
    assert blocks[0].data == expected


def test_tsize_is_the_serialized_size_of_each_subtree():
    for version in (0, 1):
        root, blocks = import_bytes(random_bytes(700_000), cid_version=version, chunk_size=1000)
        store = {b.cid: b.data for b in blocks}
        for block in blocks:
            if block.cid.codec == DAG_PB:
                for link in decode_node(block.data).links:
                    assert link.tsize == subtree_size(link.cid, store)


def test_balanced_layout_fills_174_links_then_grows_a_level():
    # 174 chunks: one level; 175: a second level whose last child is an inner node over one leaf.
    for chunks, root_links, last_child_links in ((MAX_LINKS, MAX_LINKS, None), (MAX_LINKS + 1, 2, 1)):
        root, blocks = import_bytes(pattern(chunks), cid_version=1, chunk_size=1)
        store = {b.cid: b.data for b in blocks}
        links = decode_node(store[root]).links
        assert len(links) == root_links
        if last_child_links is not None:
            assert len(decode_node(store[links[0].cid]).links) == MAX_LINKS
            assert len(decode_node(store[links[-1].cid]).links) == last_child_links


def test_balanced_layout_three_levels():
    data = random_bytes(MAX_LINKS * MAX_LINKS + 1)
    root, blocks = import_bytes(data, cid_version=1, chunk_size=1)
    store = {b.cid: b.data for b in blocks}
    top = decode_node(store[root])
    assert len(top.links) == 2 and depth_of(root, store) == 3
    full, partial = (decode_node(store[link.cid]) for link in top.links)
    assert len(full.links) == MAX_LINKS and full.filesize == MAX_LINKS * MAX_LINKS
    assert len(partial.links) == 1 and partial.filesize == 1
    assert len(decode_node(store[partial.links[0].cid]).links) == 1  # depth-1 node over the last leaf
    assert b"".join(read_file(root, store.__getitem__)) == data
    # exactly full: no extra level
    root, blocks = import_bytes(data[:-1], cid_version=1, chunk_size=1)
    store = {b.cid: b.data for b in blocks}
    assert depth_of(root, store) == 2 and len(decode_node(store[root]).links) == MAX_LINKS


class ShortReads(io.RawIOBase):
    """A pipe-like file returning at most ``step`` bytes per read."""

    def __init__(self, data: bytes, step: int) -> None:
        self.data, self.pos, self.step = data, 0, step

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        piece = self.data[self.pos : self.pos + min(self.step, len(buffer))]
        buffer[: len(piece)] = piece
        self.pos += len(piece)
        return len(piece)


class ReadOnly:
    def __init__(self, data: bytes) -> None:
        self.stream = io.BytesIO(data)

    def read(self, size: int) -> bytes:
        return self.stream.read(size)


@pytest.mark.parametrize("size", [0, 1, CHUNK_SIZE, CHUNK_SIZE + 1, 1_000_000])
@pytest.mark.parametrize("version", [0, 1])
def test_all_import_paths_agree(size, version):
    data = random_bytes(size, seed=size)
    root, blocks = import_bytes(data, cid_version=version)
    assert compute_cid(data, cid_version=version) == root
    assert compute_cid(bytearray(data), cid_version=version) == root
    assert compute_cid(io.BytesIO(data), cid_version=version) == root
    assert compute_cid(ShortReads(data, 100_000), cid_version=version) == root
    assert compute_cid(ReadOnly(data), cid_version=version) == root
    streamed: list[Block] = []
    assert import_file(io.BytesIO(data), cid_version=version, on_block=streamed.append) == root
    assert {b.cid: b.data for b in streamed} == {b.cid: b.data for b in blocks}
    assert all(b.cid.matches(b.data) for b in blocks)


def test_import_bytes_repeats_shared_blocks_in_preorder():
    # the pattern's full chunks are identical: one leaf CID used three times
    root, blocks = import_bytes(pattern(3 * CHUNK_SIZE), cid_version=1)
    assert [b.cid for b in blocks[1:]] == [blocks[1].cid] * 3
    verifier = StreamVerifier(root)
    for block in blocks:
        verifier.feed(block.data)
    assert verifier.done


def test_import_rejects_bad_settings():
    with pytest.raises(ValueError):
        compute_cid(b"x", cid_version=2)
    with pytest.raises(ValueError):
        compute_cid(b"x", chunk_size=0)


# --- Decoding untrusted bytes ------------------------------------------------------------------


def test_decode_vectors():
    vectors = json.loads((IPIP_VECTORS / "unixfs-decode.json").read_text())
    for case in vectors["reject"]:
        with pytest.raises(CIDError) as info:
            decode_node(bytes.fromhex(case["hex"]))
        assert case["error"] in str(info.value), case["name"]
    for case in vectors["accept"]:
        node = decode_node(bytes.fromhex(case["hex"]))
        assert len(node.links) == case["links"], case["name"]
        assert node.filesize == case["filesize"] and list(node.blocksizes) == case["blocksizes"]
        assert node.payload.hex() == case["payload_hex"]


def test_decode_rejects_oversized_block_and_non_bytes():
    with pytest.raises(CIDError, match="limit"):
        decode_node(b"\x0a" + varint_encode(MAX_BLOCK_SIZE) + bytes(MAX_BLOCK_SIZE))
    with pytest.raises(CIDError, match="expected bytes"):
        decode_node("0a0408021800")  # type: ignore[arg-type]


def _valid_nodes() -> list[bytes]:
    _, blocks = import_bytes(random_bytes(5000), cid_version=0, chunk_size=1000)
    _, blocks_v1 = import_bytes(random_bytes(5000), cid_version=1, chunk_size=1000)
    return [blocks[0].data, blocks[1].data, blocks_v1[0].data]


VALID_NODES = _valid_nodes()


def _decode_or_cid_error(data: bytes) -> None:
    try:
        decode_node(data)
    except CIDError:
        pass


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_decode_random_bytes_raises_only_cid_error(data):
    _decode_or_cid_error(data)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(VALID_NODES), st.data())
def test_decode_mutated_nodes_raises_only_cid_error(node, draw):
    position = draw.draw(st.integers(0, len(node) - 1))
    mutation = draw.draw(st.sampled_from(["flip", "truncate", "insert", "delete"]))
    value = draw.draw(st.integers(0, 255))
    if mutation == "flip":
        mutated = node[:position] + bytes([node[position] ^ (value or 1)]) + node[position + 1 :]
    elif mutation == "truncate":
        mutated = node[:position]
    elif mutation == "insert":
        mutated = node[:position] + bytes([value]) + node[position:]
    else:
        mutated = node[:position] + node[position + 1 :]
    _decode_or_cid_error(mutated)


def test_every_truncation_of_a_valid_node_is_rejected():
    for node in VALID_NODES:
        decode_node(node)
        for end in range(len(node)):
            with pytest.raises(CIDError):
                decode_node(node[:end])


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200), st.sampled_from([RAW, DAG_PB, 0x71]))
def test_stream_verifier_on_arbitrary_blocks_raises_only_cid_error(data, codec):
    # the CID matches, so the bytes reach the decoder and the size checks
    verifier = StreamVerifier(CID.for_block(data, codec))
    try:
        verifier.feed(data)
    except CIDError:
        assert verifier.expected() == CID.for_block(data, codec)


# --- Verification --------------------------------------------------------------------------------


def test_verify_block_and_child_cids():
    root, blocks = import_bytes(random_bytes(600_000), cid_version=1)
    verify_block(root, blocks[0].data)
    assert child_cids(root, blocks[0].data) == [b.cid for b in blocks[1:]]
    assert child_cids(blocks[1].cid, blocks[1].data) == []
    with pytest.raises(CIDError, match=str(root)):
        verify_block(root, blocks[0].data + b"\0")
    with pytest.raises(CIDError, match=str(root)):
        child_cids(root, blocks[1].data)
    big = bytes(MAX_BLOCK_SIZE + 1)
    with pytest.raises(CIDError, match="limit"):
        verify_block(CID.for_block(big, RAW), big)


def _dag(version: int) -> tuple[CID, list[Block], bytes]:
    data = random_bytes(200_000, seed=version)
    root, blocks = import_bytes(data, cid_version=version, chunk_size=1000)  # 200 leaves, two levels
    return root, blocks, data


@pytest.mark.parametrize("version", [0, 1])
def test_stream_verifier_accepts_the_full_dag(version):
    root, blocks, data = _dag(version)
    verifier = StreamVerifier(root, max_file_size=len(data))
    out = []
    for block in blocks:
        assert verifier.expected() == block.cid
        out.append(verifier.feed(block.data))
    assert verifier.done and verifier.expected() is None and verifier.remaining() == []
    assert b"".join(out) == data
    with pytest.raises(CIDError, match="complete"):
        verifier.feed(blocks[-1].data)


@pytest.mark.parametrize("version", [0, 1])
def test_stream_verifier_names_the_cid_of_any_corrupted_block(version):
    root, blocks, _ = _dag(version)
    rng = random.Random(7)
    verifier = StreamVerifier(root)
    for block in blocks:
        corrupted = bytearray(block.data)
        corrupted[rng.randrange(len(corrupted))] ^= 0x01
        with pytest.raises(CIDError, match=str(block.cid)):
            verifier.feed(bytes(corrupted))
        assert verifier.expected() == block.cid  # unchanged: the right block is still accepted
        verifier.feed(block.data)
    assert verifier.done


def test_stream_verifier_rejects_blocks_out_of_order():
    root, blocks, _ = _dag(1)
    for index in (0, 1, 2, 150):
        verifier = StreamVerifier(root)
        for earlier in blocks[:index]:
            verifier.feed(earlier.data)
        with pytest.raises(CIDError, match=str(blocks[index].cid)):
            verifier.feed(blocks[index + 1].data)


def test_truncated_stream_is_not_done_and_says_what_remains():
    root, blocks, _ = _dag(0)
    verifier = StreamVerifier(root)
    for block in blocks[:-3]:
        verifier.feed(block.data)
    assert not verifier.done
    assert verifier.expected() == blocks[-3].cid
    assert verifier.remaining() == [b.cid for b in blocks[-3:]]


def test_stream_verifier_enforces_max_file_size_at_the_root():
    root, blocks, data = _dag(1)
    verifier = StreamVerifier(root, max_file_size=len(data) - 1)
    with pytest.raises(CIDError, match="over the limit"):
        verifier.feed(blocks[0].data)
    leaf = b"x" * 10
    with pytest.raises(CIDError, match="over the limit"):
        StreamVerifier(CID.for_block(leaf, RAW), max_file_size=9).feed(leaf)


def test_stream_verifier_rejects_a_child_whose_size_differs_from_its_parents_claim():
    leaf = b"abc"
    leaf_cid = CID.for_block(leaf, RAW)
    cid_bytes = leaf_cid.to_bytes()
    link = b"\x0a" + bytes([len(cid_bytes)]) + cid_bytes + b"\x12\x00\x18\x03"
    unixfs = b"\x08\x02\x18\x02\x20\x02"  # claims the leaf holds 2 bytes
    root_block = b"\x12" + bytes([len(link)]) + link + b"\x0a" + bytes([len(unixfs)]) + unixfs
    root = CID.for_block(root_block, DAG_PB)
    verifier = StreamVerifier(root)
    verifier.feed(root_block)
    with pytest.raises(CIDError, match="parent says 2"):
        verifier.feed(leaf)


def test_stream_verifier_rejects_non_file_codec():
    block = b"\xa0"
    with pytest.raises(CIDError, match="not a UnixFS file codec"):
        StreamVerifier(CID.for_block(block, 0x71)).feed(block)


def test_iter_dfs_and_read_file_from_a_store():
    root, blocks, data = _dag(0)
    store = {b.cid: b.data for b in blocks}
    assert [cid for cid, _ in iter_dfs(root, store.__getitem__)] == [b.cid for b in blocks]
    assert b"".join(read_file(root, store.__getitem__)) == data
    victim = blocks[5].cid
    store[victim] = store[victim][:-1]
    with pytest.raises(CIDError, match=str(victim)):
        b"".join(read_file(root, store.__getitem__))


@settings(max_examples=40, deadline=None)
@given(st.binary(max_size=4000), st.integers(1, 300), st.sampled_from([0, 1]))
def test_any_import_round_trips_through_the_verifier(data, chunk_size, version):
    root, blocks = import_bytes(data, cid_version=version, chunk_size=chunk_size)
    assert compute_cid(data, cid_version=version, chunk_size=chunk_size) == root
    assert parse_cid(root.encode()) == root
    store = {b.cid: b.data for b in blocks}
    assert b"".join(read_file(root, store.__getitem__)) == data
