"""UnixFS files exactly as ``ipfs add`` (Kubo) builds them, and strict checking of untrusted blocks.

Rules of this file (the spec is ipips/0003-content-addressing.md; vectors in ipips/vectors/ and
../shared/vectors/unixfs-cids.json):

Building (what we produce)
- Chunking: fixed-size chunks of ``CHUNK_SIZE`` (256 KiB) bytes; the last one may be shorter.
  An empty file is one empty chunk.
- Leaves: CIDv1 (our default) uses raw leaves, the chunk itself under codec raw. CIDv0 wraps each
  chunk in a dag-pb node holding UnixFS ``{Type: File, Data: chunk, filesize: len(chunk)}``
  (``Data`` omitted for the empty chunk).
- Layout: Kubo's balanced layout, at most ``MAX_LINKS`` (174) links per node. Leaves fill a
  node of depth 1; when a node is full it becomes the first child of a node one level higher,
  which is filled with sub-trees of the same depth, and so on. A subtree below the root is
  always a node of its full depth, even when it holds one child. A one-chunk file is its leaf.
- Inner nodes: dag-pb, CID of the same version as the leaves. Serialized as Kubo does:
  every PBLink (field 2) before Data (field 1); each PBLink as Hash(1), Name(2) = "" (present),
  Tsize(3); the UnixFS Data as Type(1) = File, filesize(3) = sum of children's file bytes,
  blocksizes(4), one per link, not packed. Tsize = length of the serialized subtree (the
  child's own block plus the Tsizes of its links; a raw leaf's Tsize is its length).

Checking (what we accept from peers; every block is hash-checked before it is used or stored)
- A block must hash (sha2-256) to the digest of the CID it was asked for, and be at most
  ``MAX_BLOCK_SIZE`` bytes.
- Codec raw: a leaf, its bytes are file bytes. Codec dag-pb: decoded strictly (``decode_node``):
  PBNode fields Links* then Data once, nothing else; PBLink fields Hash (required), Name (must
  be empty when present), Tsize (required), in that order, once each; minimal varints; at most
  ``MAX_NODE_LINKS`` links. UnixFS Data: Type must be File or Raw (files only); fields Type,
  Data, filesize, blocksizes (plain or packed), mode and mtime (ignored); one blocksize per
  link; filesize, when present, equal to len(Data) + sum(blocksizes). Anything else raises
  CIDError and nothing but CIDError.
- A file is walked in DFS pre-order, root first (``StreamVerifier``). Each child's file bytes
  must equal the blocksize its parent gave it, so the bytes read always add up to the root's
  filesize; depth is at most ``MAX_DEPTH``. The root's filesize is checked against the fetch's
  bound (``max_file_size``, or ``exact_size``) when the root arrives, before any other block is
  asked for; a violation raises FileSizeError (a CIDError), and the bytes delivered are counted
  against the root's filesize as they arrive.

py-libp2p's MerkleDag is NOT Kubo's layout for files over one chunk (it writes leaf links' Tsize
as 0 and promotes a lone trailing subtree instead of wrapping it), so its CIDs differ from
``ipfs add``: it must never be used to build or check DAGs; this module is the only place that does.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import BinaryIO, Callable, Iterator, NamedTuple, Sequence

from protocol.cid import CID, DAG_PB, RAW, varint_encode
from protocol.errors import CIDError, FileSizeError

CHUNK_SIZE = 262144
MAX_LINKS = 174
MAX_CHUNK_SIZE = 1 << 20  # Kubo's own chunker limit
MAX_BLOCK_SIZE = MAX_CHUNK_SIZE + 1024  # a 1 MiB chunk wrapped in a CIDv0 leaf fits with room
MAX_NODE_LINKS = 1024  # accepted on decode; we write at most MAX_LINKS
MAX_DEPTH = 32  # accepted tree depth; 174**4 chunks of 256 KiB already exceed 200 TB

# UnixFS Data.Type values (unixfs.proto)
UNIXFS_RAW = 0
UNIXFS_FILE = 2
_UNIXFS_TYPE_NAMES = {0: "Raw", 1: "Directory", 2: "File", 3: "Metadata", 4: "Symlink", 5: "HAMTShard"}

_VARINT, _BYTES = 0, 2  # protobuf wire types used by dag-pb and UnixFS


@dataclass(frozen=True)
class Block:
    cid: CID
    data: bytes


@dataclass(frozen=True)
class Link:
    cid: CID
    tsize: int


@dataclass(frozen=True)
class DagNode:
    """A decoded dag-pb UnixFS file node. ``filesize`` = len(payload) + sum(blocksizes)."""

    links: tuple[Link, ...]
    data_type: int
    filesize: int
    blocksizes: tuple[int, ...]
    payload: bytes


# ---------------------------------------------------------------------------------------------
# Building


class _Child(NamedTuple):
    cid: CID
    tsize: int
    filesize: int


def _leaf_v0_frame(length: int) -> tuple[bytes, bytes]:
    """Bytes around a chunk of ``length`` bytes in its CIDv0 leaf: block = prefix + chunk + suffix."""
    if length == 0:
        return b"\x0a\x04\x08\x02\x18\x00", b""
    size = varint_encode(length)
    unixfs_len = 2 + 1 + len(size) + length + 1 + len(size)
    return b"\x0a" + varint_encode(unixfs_len) + b"\x08\x02\x12" + size, b"\x18" + size


_FULL_CHUNK_FRAME = _leaf_v0_frame(CHUNK_SIZE)


def _encode_inner(children: list[_Child]) -> bytes:
    parts = []
    for child in children:
        cid_bytes = child.cid.to_bytes()
        link = b"\x0a" + varint_encode(len(cid_bytes)) + cid_bytes + b"\x12\x00\x18" + varint_encode(child.tsize)
        parts.append(b"\x12" + varint_encode(len(link)) + link)
    filesize = sum(child.filesize for child in children)
    unixfs = b"\x08\x02\x18" + varint_encode(filesize)
    unixfs += b"".join(b"\x20" + varint_encode(child.filesize) for child in children)
    parts.append(b"\x0a" + varint_encode(len(unixfs)) + unixfs)
    return b"".join(parts)


class _BalancedTree:
    """Takes leaves left to right; closes nodes as Kubo's balanced layout does.

    ``levels[d]`` holds the finished children of the open node at depth d + 1. A node is closed
    as soon as it is full (its shape can no longer change) and at the end of the file.
    """

    def __init__(self, cid_version: int, on_block: Callable[[Block], None] | None) -> None:
        self.cid_version = cid_version
        self.on_block = on_block
        self.levels: list[list[_Child]] = [[]]

    def add_leaf(self, leaf: _Child) -> None:
        self.levels[0].append(leaf)
        depth = 0
        while len(self.levels[depth]) == MAX_LINKS:
            self._close(depth)
            depth += 1

    def finish(self) -> CID:
        top = max(d for d, children in enumerate(self.levels) if children)
        for depth in range(top):
            if self.levels[depth]:
                self._close(depth)
        if len(self.levels[top]) == 1:
            return self.levels[top][0].cid
        self._close(top)
        return self.levels[top + 1][0].cid

    def _close(self, depth: int) -> None:
        children = self.levels[depth]
        node = _encode_inner(children)
        cid = CID(self.cid_version, DAG_PB, hashlib.sha256(node).digest())
        if self.on_block is not None:
            self.on_block(Block(cid, node))
        if depth + 1 == len(self.levels):
            self.levels.append([])
        tsize = len(node) + sum(child.tsize for child in children)
        self.levels[depth + 1].append(_Child(cid, tsize, sum(child.filesize for child in children)))
        self.levels[depth] = []


def _chunks(source: bytes | bytearray | memoryview | BinaryIO, chunk_size: int) -> Iterator[memoryview]:
    """Fixed-size chunks as views (no copies); at least one, empty for empty input.

    A view over a file's chunk is only valid until the next one is produced.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        view = memoryview(source).cast("B")
        yield view[:chunk_size]
        for offset in range(chunk_size, len(view), chunk_size):
            yield view[offset : offset + chunk_size]
        return
    buffer = bytearray(chunk_size)
    view = memoryview(buffer)
    first = True
    while True:
        filled = 0
        while filled < chunk_size:  # like Kubo's splitter: short reads still make full chunks
            if hasattr(source, "readinto"):
                got = source.readinto(view[filled:])
            else:
                piece = source.read(chunk_size - filled)
                got = len(piece)
                view[filled : filled + got] = piece
            if not got:
                break
            filled += got
        if filled or first:
            yield view[:filled]
        first = False
        if filled < chunk_size:
            return


def _import(source, cid_version: int, chunk_size: int, on_block: Callable[[Block], None] | None) -> CID:
    if cid_version not in (0, 1):
        raise ValueError(f"cid_version must be 0 or 1, not {cid_version!r}")
    if not 1 <= chunk_size <= MAX_CHUNK_SIZE:
        raise ValueError(f"chunk_size must be 1..{MAX_CHUNK_SIZE}, not {chunk_size!r}")
    tree = _BalancedTree(cid_version, on_block)
    sha256 = hashlib.sha256
    for chunk in _chunks(source, chunk_size):
        length = len(chunk)
        if cid_version == 1:
            cid = CID(1, RAW, sha256(chunk).digest())
            if on_block is not None:
                on_block(Block(cid, bytes(chunk)))
            tree.add_leaf(_Child(cid, length, length))
            continue
        prefix, suffix = _FULL_CHUNK_FRAME if length == CHUNK_SIZE else _leaf_v0_frame(length)
        hasher = sha256(prefix)
        hasher.update(chunk)
        hasher.update(suffix)
        cid = CID(0, DAG_PB, hasher.digest())
        if on_block is not None:
            on_block(Block(cid, b"".join((prefix, chunk, suffix))))
        tree.add_leaf(_Child(cid, len(prefix) + length + len(suffix), length))
    return tree.finish()


def compute_cid(data_or_fileobj, *, cid_version: int = 1, chunk_size: int = CHUNK_SIZE) -> CID:
    """The CID ``ipfs add`` would give these bytes (or this binary file), keeping no blocks."""
    return _import(data_or_fileobj, cid_version, chunk_size, None)


def import_file(
    fileobj: BinaryIO,
    *,
    cid_version: int = 1,
    on_block: Callable[[Block], None],
    chunk_size: int = CHUNK_SIZE,
) -> CID:
    """Stream a binary file into a DAG; ``on_block`` gets every block (leaves before parents)."""
    return _import(fileobj, cid_version, chunk_size, on_block)


def import_bytes(data: bytes, *, cid_version: int = 1, chunk_size: int = CHUNK_SIZE) -> tuple[CID, list[Block]]:
    """The whole DAG of ``data`` in memory, in DFS pre-order, root first.

    The list is the exact sequence a ``StreamVerifier`` expects: a block that the DAG uses twice
    (identical chunks) appears twice, as the same object.
    """
    by_cid: dict[CID, Block] = {}
    root = _import(data, cid_version, chunk_size, lambda block: by_cid.setdefault(block.cid, block))
    ordered = []
    pending = [root]
    while pending:
        block = by_cid[pending.pop()]
        ordered.append(block)
        if block.cid.codec == DAG_PB:
            pending.extend(link.cid for link in reversed(decode_node(block.data).links))
    return root, ordered


# ---------------------------------------------------------------------------------------------
# Decoding untrusted bytes


class _Reader:
    """Protobuf wire reader over untrusted bytes; every failure is a CIDError."""

    def __init__(self, data: bytes, what: str) -> None:
        self.data = data
        self.pos = 0
        self.what = what

    def fail(self, reason: str) -> CIDError:
        return CIDError(f"malformed {self.what}: {reason} at byte {self.pos}")

    def more(self) -> bool:
        return self.pos < len(self.data)

    def varint(self) -> int:
        data, pos = self.data, self.pos
        result = 0
        for shift in range(0, 70, 7):
            if pos >= len(data):
                raise self.fail("truncated varint")
            byte = data[pos]
            pos += 1
            result |= (byte & 0x7F) << shift
            if not byte & 0x80:
                if byte == 0 and shift:
                    raise self.fail("non-minimal varint")
                if result >= 1 << 64:
                    raise self.fail("varint over 64 bits")
                self.pos = pos
                return result
        raise self.fail("varint longer than 10 bytes")

    def key(self) -> tuple[int, int]:
        key = self.varint()
        return key >> 3, key & 7

    def length_delimited(self) -> bytes:
        length = self.varint()
        if length > len(self.data) - self.pos:
            raise self.fail(f"field of {length} bytes runs past the end")
        start = self.pos
        self.pos += length
        return self.data[start : self.pos]


def _decode_link(data: bytes, index: int) -> Link:
    reader = _Reader(data, f"dag-pb link {index}")
    cid = tsize = None
    last_field = 0
    while reader.more():
        field, wire = reader.key()
        if field <= last_field:
            raise reader.fail(f"field {field} repeated or out of order")
        last_field = field
        if field == 1 and wire == _BYTES:
            try:
                cid = CID.from_bytes(reader.length_delimited())
            except CIDError as exc:
                raise reader.fail(f"bad Hash: {exc}") from None
        elif field == 2 and wire == _BYTES:
            if reader.length_delimited():
                raise reader.fail("a file link must have an empty Name")
        elif field == 3 and wire == _VARINT:
            tsize = reader.varint()
        else:
            raise reader.fail(f"unexpected field {field} (wire type {wire})")
    if cid is None:
        raise reader.fail("missing Hash")
    if tsize is None:
        raise reader.fail("missing Tsize")
    return Link(cid, tsize)


def _decode_unixfs(data: bytes) -> tuple[int, bytes, int | None, list[int]]:
    reader = _Reader(data, "UnixFS Data")
    data_type = filesize = None
    payload = b""
    blocksizes: list[int] = []
    last_field = 0
    while reader.more():
        field, wire = reader.key()
        if field < last_field or (field == last_field and field != 4):
            raise reader.fail(f"field {field} repeated or out of order")
        last_field = field
        if field == 1 and wire == _VARINT:
            data_type = reader.varint()
            if data_type not in (UNIXFS_FILE, UNIXFS_RAW):
                name = _UNIXFS_TYPE_NAMES.get(data_type, f"unknown type {data_type}")
                raise reader.fail(f"UnixFS {name} is not a file (only File and Raw are accepted)")
        elif field == 2 and wire == _BYTES:
            payload = reader.length_delimited()
        elif field == 3 and wire == _VARINT:
            filesize = reader.varint()
        elif field == 4 and wire == _VARINT:
            blocksizes.append(reader.varint())
        elif field == 4 and wire == _BYTES:
            packed = _Reader(reader.length_delimited(), "UnixFS packed blocksizes")
            while packed.more():
                blocksizes.append(packed.varint())
        elif field == 7 and wire == _VARINT:  # mode: metadata we ignore
            reader.varint()
        elif field == 8 and wire == _BYTES:  # mtime: metadata we ignore
            reader.length_delimited()
        else:
            raise reader.fail(f"unexpected field {field} (wire type {wire})")
        if len(blocksizes) > MAX_NODE_LINKS:
            raise reader.fail(f"more than {MAX_NODE_LINKS} blocksizes")
    if data_type is None:
        raise reader.fail("missing Type")
    return data_type, payload, filesize, blocksizes


def decode_node(data: bytes) -> DagNode:
    """Strictly decode an untrusted dag-pb UnixFS file node; raise only CIDError."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CIDError(f"malformed dag-pb node: expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > MAX_BLOCK_SIZE:
        raise CIDError(f"malformed dag-pb node: {len(data)} bytes is over the {MAX_BLOCK_SIZE} byte limit")
    reader = _Reader(data, "dag-pb node")
    links: list[Link] = []
    unixfs = None
    while reader.more():
        field, wire = reader.key()
        if field == 2 and wire == _BYTES:
            if unixfs is not None:
                raise reader.fail("link after Data (Links must come first)")
            if len(links) == MAX_NODE_LINKS:
                raise reader.fail(f"more than {MAX_NODE_LINKS} links")
            links.append(_decode_link(reader.length_delimited(), len(links)))
        elif field == 1 and wire == _BYTES:
            if unixfs is not None:
                raise reader.fail("Data repeated")
            unixfs = reader.length_delimited()
        else:
            raise reader.fail(f"unexpected field {field} (wire type {wire})")
    if unixfs is None:
        raise reader.fail("no UnixFS Data")
    data_type, payload, filesize, blocksizes = _decode_unixfs(unixfs)
    if len(blocksizes) != len(links):
        raise CIDError(f"malformed dag-pb node: {len(links)} links but {len(blocksizes)} blocksizes")
    total = len(payload) + sum(blocksizes)
    if filesize is not None and filesize != total:
        raise CIDError(f"malformed dag-pb node: filesize {filesize} but Data and blocksizes add up to {total}")
    return DagNode(tuple(links), data_type, total, tuple(blocksizes), payload)


# ---------------------------------------------------------------------------------------------
# Verifying


def verify_block(cid: CID, data: bytes) -> None:
    """Raise CIDError naming ``cid`` unless ``data`` is a block of allowed size hashing to it."""
    if len(data) > MAX_BLOCK_SIZE:
        raise CIDError(f"block {cid}: {len(data)} bytes is over the {MAX_BLOCK_SIZE} byte limit")
    if hashlib.sha256(data).digest() != cid.digest:
        raise CIDError(f"block does not match its CID {cid}")


def _decode_verified(cid: CID, data: bytes) -> DagNode:
    try:
        return decode_node(data)
    except CIDError as exc:
        raise CIDError(f"block {cid}: {exc}") from None


def child_cids(cid: CID, data: bytes) -> list[CID]:
    """Hash-check a block against ``cid`` and return its links in file order ([] for raw leaves)."""
    verify_block(cid, data)
    if cid.codec == RAW:
        return []
    return [link.cid for link in _decode_verified(cid, data).links]


class StreamVerifier:
    """Checks the blocks of one file arriving in DFS pre-order, root first.

    ``expected()`` names the block that must come next; ``feed`` checks it and returns the file
    bytes it holds (b"" for inner nodes). A rejected block leaves the verifier unchanged, so the
    same CID can be asked for again from another peer.
    """

    def __init__(self, root: CID, *, max_file_size: int | None = None, exact_size: int | None = None) -> None:
        self.root = root
        self.max_file_size = max_file_size
        self.exact_size = exact_size
        self.file_size: int | None = None  # what the verified root states
        self.received = 0  # file bytes delivered so far
        # Stack of (cid, file bytes its parent says it holds or None for the root, depth); top last.
        self._pending: list[tuple[CID, int | None, int]] = [(root, None, 0)]

    @property
    def done(self) -> bool:
        return not self._pending

    def expected(self) -> CID | None:
        return self._pending[-1][0] if self._pending else None

    def remaining(self) -> list[CID]:
        """Roots of the subtrees still to come, next first (to resume elsewhere)."""
        return [cid for cid, _, _ in reversed(self._pending)]

    def parts(self) -> list[tuple[CID, int | None, int]]:
        """The subtrees still to come as (CID, file bytes its parent states, depth), next first: the
        pieces a fetch may take from different peers (``for_parts``)."""
        return list(reversed(self._pending))

    @classmethod
    def for_parts(cls, root: CID, parts: Sequence[tuple[CID, int | None, int]]) -> "StreamVerifier":
        """A verifier of some of the subtrees of file ``root`` (entries of ``parts()`` of a verifier past
        its root), in the order given: each block is checked as the whole file's verifier checks it, and
        ``file_size`` is what the parts' parents state they hold."""
        if any(depth == 0 or size is None for _, size, depth in parts):
            raise ValueError("for_parts takes subtrees below a verified root (parts() after the root)")
        verifier = cls(root)
        verifier._pending = list(reversed(parts))
        verifier.file_size = sum(size for _, size, _ in parts)  # type: ignore[misc]
        return verifier

    def feed(self, data: bytes) -> bytes:
        if not self._pending:
            raise CIDError(f"file {self.root} is complete; no more blocks expected")
        cid, claimed_size, depth = self._pending[-1]
        verify_block(cid, data)
        if cid.codec == RAW:
            payload, children, size = bytes(data), [], len(data)
        elif cid.codec == DAG_PB:
            node = _decode_verified(cid, data)
            payload, size = node.payload, node.filesize
            children = [(link.cid, bs, depth + 1) for link, bs in zip(node.links, node.blocksizes)]
        else:
            raise CIDError(f"block {cid}: codec 0x{cid.codec:x} is not a UnixFS file codec")
        if claimed_size is not None and size != claimed_size:
            raise CIDError(f"block {cid} holds {size} file bytes but its parent says {claimed_size}")
        if depth == 0:  # the root states the file's size: judged before any leaf is asked for
            if self.exact_size is not None and size != self.exact_size:
                raise FileSizeError(f"file {cid} is {size} bytes, not the {self.exact_size} it must be")
            if self.max_file_size is not None and size > self.max_file_size:
                raise FileSizeError(f"file {cid} is {size} bytes, over the limit of {self.max_file_size}")
            self.file_size = size
        if self.received + len(payload) > self.file_size:  # cannot happen if the sizes above hold; cheap
            raise CIDError(f"file {self.root}: more than the {self.file_size} bytes its root states")
        if children and depth + 1 > MAX_DEPTH:
            raise CIDError(f"block {cid}: DAG deeper than {MAX_DEPTH} levels")
        self._pending.pop()
        self._pending.extend(reversed(children))
        self.received += len(payload)
        return payload


def deal(parts: int, members: Sequence[str]) -> dict[str, list[int]]:
    """A swarm's parts (IPIP-0003 §4.2): of a root's ``parts`` subtrees (next first), member k of ``members``
    (the order all of them use) takes part j from the seed when j mod len(members) == k, and asks member k for
    those parts."""
    return {member: list(range(k, parts, len(members))) for k, member in enumerate(members)}


def iter_dfs(root: CID, get_block: Callable[[CID], bytes]) -> Iterator[tuple[CID, bytes]]:
    """Walk a stored file DAG in DFS pre-order, yielding each block after it has been verified."""
    verifier = StreamVerifier(root)
    while (cid := verifier.expected()) is not None:
        data = get_block(cid)
        verifier.feed(data)
        yield cid, data


def read_file(root: CID, get_block: Callable[[CID], bytes]) -> Iterator[bytes]:
    """The file's bytes in order, each piece from a verified block."""
    verifier = StreamVerifier(root)
    while (cid := verifier.expected()) is not None:
        payload = verifier.feed(get_block(cid))
        if payload:
            yield payload
