"""The job ledger's rules (ipips/0008-ledger.md): signed, hash-chained entries, one chain per author,
copies of the others' chains, and the export file that anyone can check without an agent.

Rules of this file:
- An entry is the canonical msgpack map ``{job_id, seq, prev, time, peer, kind, data, signer}``;
  ``hash = sha256(LEDGER_DOMAIN + entry)``, the signature is Ed25519 over the same bytes by ``signer``.
  ``LedgerEntry.decode`` reads untrusted bytes and raises nothing but ``LedgerError``.
- A job's ledger is a set of *chains*, one per author: every agent on the job appends only to its
  own chain, every entry of it signed by itself (IPIP-0008 §5). ``verify_chain`` checks one chain
  (seq from 0 without a gap, the job, prev links, one signer); the first bad entry names the error.
- Replication (IPIP-0008 §5): peers keep copies of each other's chains. ``compare_chain`` tells what a
  served copy says about the one we hold: more entries (we extend ours), the same, fewer entries
  served by the author itself (truncation), or a different entry at a seq both hold (a fork: two
  entries at one seq signed by the same key, proof that the author equivocated). ``compare_part`` does
  the same for a part of a chain against the hashes of the copy held: a client that names what it
  holds (``encode_held``) is sent each chain from ``serve_from`` on (IPIP-0008 §5.1), not all of it.
- The export file (IPIP-0008 §6) is JSON: the job's terms, each chain with its author's public key and
  its entries as hex; ``verify_export`` checks it whole and raises ``LedgerError`` whose text names
  the chain and entry index of the first problem.
- A *heads* entry (§6.1) is an author's signed statement of how much it held of every other chain
  (entries and head hash, up to each chain's last entry that is not itself a heads entry). An export
  in which a chain named by a heads entry is missing, shorter, or different at that head does not
  verify: a cut chain or a left-out participant is visible to anyone holding the file.

No I/O here: the agent's store (agent/store.py) keeps the chains, agent/ledger_sync.py moves them.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from protocol.codec import canonical_encode, decode_canonical
from protocol.errors import CodecError, KeyFileError, ProtocolError
from protocol.identity import Identity, peer_id_from_public_key, public_key_from_peer_id, verify_signature

LEDGER_DOMAIN = b"infernet/ledger/v1\x00"
ZERO_HASH = bytes(32)
MAX_ENTRY_BYTES = 64 * 1024
_ENTRY_FIELDS = ("job_id", "seq", "prev", "time", "peer", "kind", "data", "signer")

LEDGER_KINDS: dict[str, tuple[str, ...]] = {
    "announced": ("submitter", "model", "parameters", "shards", "price_per_hour", "budget"),
    "coordinator": ("term",),
    "lease": ("round", "shard", "attempt", "worker", "expires_at"),
    "checkpoint": ("round", "shard", "attempt", "step", "loss"),
    "report": ("round", "shard", "attempt", "worker", "adapter_cid", "duration", "samples", "hardware",
               "price_per_hour"),
    "verdict": ("round", "shard", "attempt", "worker", "accepted", "reason"),
    "aggregate": ("round", "adapter_cid", "method", "shards"),
    "done": (),
    "cancel": ("reason",),
    "failed": ("reason",),
    "bill": ("bill_sha256", "total", "workers"),  # the submitter's signed bill (agent/market.py)
    # what the author held of the other chains of the job: {peer ID: [entries, head hash hex]} (§6.1)
    "heads": ("chains",),
}
"""Each ledger kind and the keys its ``data`` map must hold (more keys are allowed)."""


class LedgerError(ProtocolError):
    """A ledger entry is invalid. ``seq`` is the first bad entry (None if the entry has no readable seq)."""

    def __init__(self, job_id: bytes, seq: Optional[int], problem: str) -> None:
        self.job_id = job_id
        self.seq = seq
        self.problem = problem
        job = f" of job {job_id.hex()[:16]}" if job_id else ""
        where = f"seq {seq}" if seq is not None else "entry"
        super().__init__(f"ledger{job}: {where}: {problem}")


@dataclass(frozen=True)
class LedgerEntry:
    """One signed ledger entry. ``encoded`` is the canonical map that is hashed and signed."""

    job_id: bytes
    seq: int
    prev: bytes
    time: float
    peer: str
    kind: str
    data: dict
    signer: bytes
    signature: bytes = field(repr=False)
    encoded: bytes = field(repr=False)
    hash: bytes = field(repr=False)

    @property
    def signer_peer_id(self) -> str:
        return peer_id_from_public_key(self.signer)

    @classmethod
    def create(cls, identity: Identity, job_id: bytes, seq: int, prev: bytes, time: float, peer: str,
               kind: str, data: dict) -> "LedgerEntry":
        """Build and sign a new entry; StoreError if a field is invalid."""
        wire = {"job_id": job_id, "seq": seq, "prev": prev, "time": float(time), "peer": peer,
                "kind": kind, "data": data, "signer": identity.public_key}
        problem = _entry_problem(wire)
        if problem is None:
            try:
                encoded = canonical_encode(wire)
            except CodecError as exc:
                problem = f"data cannot be encoded: {exc}"
        if problem is None and len(encoded) > MAX_ENTRY_BYTES:
            problem = f"entry is {len(encoded)} bytes > {MAX_ENTRY_BYTES}"
        if problem is not None:
            raise LedgerError(job_id, seq, f"{kind}: {problem}")
        signed = LEDGER_DOMAIN + encoded
        return cls(job_id, seq, prev, float(time), peer, kind, data, identity.public_key,
                   identity.sign(signed), encoded, hashlib.sha256(signed).digest())

    @classmethod
    def decode(cls, encoded: bytes, signature: bytes) -> "LedgerEntry":
        """Read untrusted entry bytes and their signature; LedgerError unless both are valid."""
        try:
            wire = decode_canonical(encoded, max_bytes=MAX_ENTRY_BYTES)
        except CodecError as exc:
            raise LedgerError(b"", None, f"not a canonical entry: {exc}") from None
        job_id = wire.get("job_id") if isinstance(wire, dict) else None
        job_id = job_id if isinstance(job_id, bytes) else b""
        seq = wire.get("seq") if isinstance(wire, dict) else None
        seq = seq if isinstance(seq, int) and not isinstance(seq, bool) else None
        problem = _entry_problem(wire)
        if problem is not None:
            raise LedgerError(job_id, seq, problem)
        signed = LEDGER_DOMAIN + encoded
        if not verify_signature(wire["signer"], signed, signature):
            raise LedgerError(job_id, seq, f"bad signature (signer {peer_id_from_public_key(wire['signer'])})")
        return cls(job_id, seq, wire["prev"], wire["time"], wire["peer"], wire["kind"], wire["data"],
                   wire["signer"], signature, bytes(encoded), hashlib.sha256(signed).digest())


def _entry_problem(wire: Any) -> Optional[str]:
    """What is wrong with an entry map's shape, or None."""
    if not isinstance(wire, dict):
        return "entry is not a map"
    missing = [k for k in _ENTRY_FIELDS if k not in wire]
    if missing:
        return f"missing field {missing[0]!r}"
    extra = sorted(set(wire) - set(_ENTRY_FIELDS))
    if extra:
        return f"unknown field {extra[0][:40]!r}"
    for name in ("job_id", "prev", "signer"):
        if not isinstance(wire[name], bytes) or len(wire[name]) != 32:
            return f"{name}: expected 32 bytes"
    seq, time = wire["seq"], wire["time"]
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        return "seq: expected a non-negative integer"
    if not isinstance(time, float) or not math.isfinite(time):
        return "time: expected a finite float"
    if not isinstance(wire["peer"], str):
        return "peer: expected a peer ID"
    try:
        public_key_from_peer_id(wire["peer"])
    except KeyFileError:
        return f"peer: not an Ed25519 peer ID: {wire['peer'][:60]!r}"
    kind, data = wire["kind"], wire["data"]
    if kind not in LEDGER_KINDS:
        return f"kind: expected one of {', '.join(LEDGER_KINDS)}, got {str(kind)[:40]!r}"
    if not isinstance(data, dict):
        return "data: expected a map"
    absent = [k for k in LEDGER_KINDS[kind] if k not in data]
    if absent:
        return f"data.{absent[0]}: missing (a {kind} entry records {', '.join(LEDGER_KINDS[kind])})"
    return None


# -- chains ------------------------------------------------------------------------------------------

def verify_chain(entries: list[LedgerEntry], job_id: bytes, author: Optional[bytes] = None, start: int = 0) -> int:
    """Check one chain of a job (IPIP-0008 §3, §5): entry ``i`` has seq ``i``, names the job, links to
    the hash of entry ``i - 1`` and, when ``author`` is given, is signed by it. Signatures and shapes
    were checked by ``LedgerEntry.decode``. Returns the count; LedgerError at the first bad entry.
    ``start``: the entries are a part of the chain from that seq (what a 1.1.0 server sends, §5.1); the
    first one's link to the entry before is then the caller's to check, against the copy it holds."""
    prev: Optional[bytes] = ZERO_HASH if start == 0 else None
    for index, entry in enumerate(entries, start):
        if entry.seq != index:
            raise LedgerError(job_id, index, f"missing (the next entry is seq {entry.seq})")
        if entry.job_id != job_id:
            raise LedgerError(job_id, index, f"entry names job {entry.job_id.hex()[:16]}")
        if author is not None and entry.signer != author:
            raise LedgerError(job_id, index, f"signed by {entry.signer_peer_id}, not by the chain's author "
                                             f"{peer_id_from_public_key(author)}")
        if prev is not None and entry.prev != prev:
            raise LedgerError(job_id, index, "broken chain: prev is not the hash of the entry before")
        prev = entry.hash
    return len(entries)


@dataclass(frozen=True)
class ChainConflict:
    """What a copy of ``author``'s chain served by ``server`` shows against the one we hold.

    ``kind`` is "fork" (a different entry at ``seq``, both signed by the author: ``held`` and ``served``
    are that proof), "truncated" (the author itself served ``served_length`` < ``held_length`` entries)
    or "invalid" (the served copy does not verify from ``seq``: the server's copy is bad, ``problem``)."""

    kind: str
    author: bytes
    server: str
    seq: int
    held_length: int
    served_length: int
    held: Optional[LedgerEntry] = field(default=None, repr=False)
    served: Optional[LedgerEntry] = field(default=None, repr=False)
    problem: str = ""  # "invalid": why the served copy was refused

    def describe(self) -> str:
        who = peer_id_from_public_key(self.author) if any(self.author) else "an unknown author"
        if self.kind == "invalid":
            return f"invalid copy: {self.server} served {who}'s chain with a bad entry at seq {self.seq}: {self.problem}"
        if self.kind == "fork":
            return (f"fork: {who} signed two different entries at seq {self.seq} "
                    f"(held {self.held.hash.hex()[:16]}, served by {self.server} {self.served.hash.hex()[:16]})")
        return (f"truncated: {who} served its own chain with {self.served_length} entries; "
                f"we hold {self.held_length} (seq {self.seq} onwards dropped)")


def compare_chain(held: list[LedgerEntry], served: list[LedgerEntry], author: bytes,
                  server: str) -> tuple[Optional[ChainConflict], list[LedgerEntry]]:
    """Compare a verified copy of ``author``'s chain that ``server`` sent with the copy we hold.

    Returns (conflict or None, the served entries past our last one, to append). A fork wins over
    anything else; a shorter copy is a truncation only when the author itself served it (anyone
    else may simply hold less). Both lists must have passed ``verify_chain`` for the same author."""
    return compare_part([e.hash for e in held], served, author, server, lambda seq: held[seq])


def compare_part(held: list[bytes], served: list[LedgerEntry], author: bytes, server: str,
                 held_entry: Callable[[int], Optional[LedgerEntry]], *, ours: bool = False,
                 max_copy: Optional[int] = None) -> tuple[Optional[ChainConflict], list[LedgerEntry]]:
    """``compare_chain`` for a served chain or a part of one that begins at seq ``served[0].seq`` (what a
    1.1.0 server sends, §5.1; ``verify_chain`` from that seq checked it), against the *hashes* of the copy we hold
    (``held``; ``held_entry(seq)`` reads one entry of it, for a fork's proof). Beyond ``compare_chain``:
    a part that does not continue our copy is "invalid"; with ``ours`` (the chain is our own), a copy
    longer than ours is a truncation of our own store; at most ``max_copy`` entries are kept."""
    start = served[0].seq if served else len(held)
    end = start + len(served) if max_copy is None else min(start + len(served), max_copy)
    for seq in range(start, min(len(held), end)):  # a different entry at a seq both hold: a fork
        if held[seq] != served[seq - start].hash:
            return ChainConflict("fork", author, server, seq, len(held), end, held_entry(seq), served[seq - start]), []
    if start > len(held) or (0 < start == len(held) and served and served[0].prev != held[start - 1]):
        return ChainConflict("invalid", author, server, start, len(held), end,
                             problem=f"entries from seq {start} do not continue the {len(held)} we hold"), []
    if end < len(held):
        if server == peer_id_from_public_key(author):  # the author serves less than it signed: truncation
            return ChainConflict("truncated", author, server, end, len(held), end), []
        return None, []
    if ours and end > len(held):  # a peer holds more of our own chain than we do: our store lost entries
        return ChainConflict("truncated", author, server, len(held), len(held), end), []
    return None, served[len(held) - start:end - start]


# -- incremental sync (IPIP-0008 §5.1) ---------------------------------------------------------------

MAX_HELD = 4096  # chains one sync request may name
MAX_HELD_BYTES = MAX_HELD * 80 + 16  # its body's bound: MAX_HELD chains of [author, length, head]


def encode_held(held: dict[bytes, tuple[int, bytes]]) -> bytes:
    """A sync request's body: for each chain the client holds, ``[author, length, head hash]``, by author."""
    if len(held) > MAX_HELD:
        raise ValueError(f"a sync request names at most {MAX_HELD} chains, not {len(held)}")
    return canonical_encode([[author, length, head] for author, (length, head) in sorted(held.items())])


def decode_held(data: bytes) -> dict[bytes, tuple[int, bytes]]:
    """Read an untrusted sync request body; ProtocolError naming the first problem."""
    try:
        items = decode_canonical(data, max_bytes=MAX_HELD_BYTES)
    except CodecError as exc:
        raise ProtocolError(f"ledger sync request: not canonical: {exc}") from None
    if not isinstance(items, list) or len(items) > MAX_HELD:
        raise ProtocolError(f"ledger sync request: expected a list of at most {MAX_HELD} chains")
    held: dict[bytes, tuple[int, bytes]] = {}
    for index, item in enumerate(items):
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], bytes) and len(item[0]) == 32
                and isinstance(item[1], int) and not isinstance(item[1], bool) and item[1] >= 0
                and isinstance(item[2], bytes) and len(item[2]) == 32):
            raise ProtocolError(f"ledger sync request: chain {index}: expected [author (32 bytes), length, head (32 bytes)]")
        if item[0] in held:
            raise ProtocolError(f"ledger sync request: chain {index}: author named twice")
        held[item[0]] = (item[1], item[2])
    return held


def serve_from(hashes: list[bytes], held: Optional[tuple[int, bytes]]) -> int:
    """The seq from which a server sends its copy of a chain (``hashes``: its entries' hashes in seq order)
    to a client that holds ``held`` = (length, head hash) of it (IPIP-0008 §5.1):

    - the client holds none of it (or names none): 0, the whole chain;
    - the server's entry ``length - 1`` has the client's head hash: ``length``, the entries the client lacks
      (none when both hold as much); a hash covers every entry before it, so both hold the same prefix;
    - the server holds fewer (``length`` > its count): its last entry, for the client to compare with its own
      at that seq (equal: nothing new; different: a fork, both entries signed by the author);
    - otherwise (a different entry at ``length - 1``: a fork somewhere): 0, the whole chain, for the client
      to find it."""
    if held is None or held[0] == 0 or not hashes:
        return 0
    length, head = held
    if length > len(hashes):
        return len(hashes) - 1
    return length if hashes[length - 1] == head else 0


# -- the export file ---------------------------------------------------------------------------------

EXPORT_FORMAT = "infernet-ledger-export/1"
MAX_EXPORT_CHAINS = 4096
MAX_EXPORT_ENTRIES = 1_000_000


MAX_HEADS = 256  # chains one heads entry names (its 64 KiB bound holds about 400)


def attested_length(entries: list[LedgerEntry]) -> int:
    """How many entries of a chain a heads entry vouches for: up to its last entry that is not itself a
    heads entry (IPIP-0008 §6.1; so one agent's heads entry never makes another write one)."""
    n = len(entries)
    while n and entries[n - 1].kind == "heads":
        n -= 1
    return n


def heads_data(chains: dict[bytes, list[LedgerEntry]], author: bytes) -> dict:
    """The ``data`` of a heads entry by ``author``: every other chain held, by its attested length."""
    held = {}
    for key in sorted(chains):
        n = attested_length(chains[key])
        if key != author and n:
            held[peer_id_from_public_key(key)] = [n, chains[key][n - 1].hash.hex()]
        if len(held) == MAX_HEADS:
            break
    return {"chains": held}


def _check_heads(chains: dict[str, list[LedgerEntry]], order: dict[str, int], bad: Any) -> None:
    """Every heads entry's statement holds in the export: no chain it names is missing, shorter, or
    different at the head it names (§6.1: truncation and a removed chain become visible)."""
    for author, entries in chains.items():
        for j, entry in enumerate(entries):
            if entry.kind != "heads":
                continue
            where = f"chains[{order[author]}].entries[{j}]"
            held = entry.data.get("chains")
            if not isinstance(held, dict) or len(held) > MAX_HEADS:
                raise bad(f"{where}.data.chains", f"expected a map of at most {MAX_HEADS} peer IDs to [entries, head]")
            for peer, value in held.items():
                if not (isinstance(peer, str) and isinstance(value, list) and len(value) == 2
                        and isinstance(value[0], int) and not isinstance(value[0], bool) and value[0] >= 1
                        and isinstance(value[1], str) and len(value[1]) == 64):
                    raise bad(f"{where}.data.chains", f"{str(peer)[:60]!r}: expected [entries >= 1, head hash hex]")
                if peer == author:
                    continue
                n, head = value
                have = chains.get(peer)
                if have is None:
                    raise bad(where, f"{author} signed that it held {n} entries of the chain of {peer}, "
                                     "and the export has no chain of it: a chain was left out")
                if len(have) < n:
                    raise bad(f"chains[{order[peer]}]", f"{len(have)} entries, but {author} signed at {where} that it "
                                                        f"held {n} (head {head[:16]}…): the chain was cut short")
                if have[n - 1].hash.hex() != head:
                    raise bad(f"chains[{order[peer]}].entries[{n - 1}]",
                              f"is not the head {head[:16]}… that {author} signed at {where}")


def export_document(job_id: bytes, terms_wire: Optional[bytes], chains: dict[bytes, list[LedgerEntry]],
                    conflicts: list[dict] | tuple = ()) -> dict:
    """The export file's JSON object (IPIP-0008 §6): self-contained, checked by ``verify_export``."""
    return {
        "format": EXPORT_FORMAT,
        "job_id": job_id.hex(),
        "terms": terms_wire.hex() if terms_wire is not None else None,
        "keys": {peer_id_from_public_key(a): a.hex() for a in sorted(chains)},
        "chains": [{"author": peer_id_from_public_key(a),
                    "entries": [{"entry": e.encoded.hex(), "signature": e.signature.hex()} for e in chains[a]]}
                   for a in sorted(chains)],
        "conflicts": list(conflicts),
    }


@dataclass(frozen=True)
class VerifiedExport:
    job_id: bytes
    chains: dict[str, list[LedgerEntry]]  # author peer ID -> its entries
    job_name: Optional[str]

    @property
    def entries(self) -> int:
        return sum(len(c) for c in self.chains.values())


def verify_export(document: Any) -> VerifiedExport:
    """Check an export file's object whole; LedgerError whose text names the first problem's place
    (``chains[I].entries[J]``), never anything else."""
    def bad(where: str, problem: str) -> LedgerError:
        error = LedgerError(b"", None, problem)
        error.args = (f"{where}: {problem}",)
        return error

    if not isinstance(document, dict):
        raise bad("file", "expected a JSON object")
    if document.get("format") != EXPORT_FORMAT:
        raise bad("format", f"expected {EXPORT_FORMAT!r}, got {str(document.get('format'))[:60]!r}")
    job_id = _hex(document.get("job_id"), 32, "job_id", bad)
    name = None
    if document.get("terms") is not None:
        from protocol.messages import JOB_ID_DOMAIN, JobTerms

        terms_wire = _hex(document["terms"], None, "terms", bad, max_bytes=1 << 20)
        if hashlib.sha256(JOB_ID_DOMAIN + terms_wire).digest() != job_id:
            raise bad("terms", "do not hash to job_id")
        try:
            name = JobTerms.from_wire(decode_canonical(terms_wire, max_bytes=1 << 20), "terms").name
        except CodecError as exc:
            raise bad("terms", f"not valid job terms: {exc}") from None
    keys = document.get("keys")
    if not isinstance(keys, dict):
        raise bad("keys", "expected a map of peer ID to public key")
    for peer, key in keys.items():
        if not isinstance(peer, str) or peer_id_from_public_key(_hex(key, 32, f"keys[{str(peer)[:60]!r}]", bad)) != peer:
            raise bad(f"keys[{str(peer)[:60]!r}]", "the public key does not give this peer ID")
    chains = document.get("chains")
    if not isinstance(chains, list) or len(chains) > MAX_EXPORT_CHAINS:
        raise bad("chains", f"expected a list of at most {MAX_EXPORT_CHAINS} chains")
    out: dict[str, list[LedgerEntry]] = {}
    total = 0
    for i, chain in enumerate(chains):
        where = f"chains[{i}]"
        if not isinstance(chain, dict) or not isinstance(chain.get("author"), str) or \
                not isinstance(chain.get("entries"), list):
            raise bad(where, "expected {author, entries}")
        author_id = chain["author"]
        if author_id not in keys:
            raise bad(f"{where}.author", f"{author_id[:60]!r} has no public key in keys")
        if author_id in out:
            raise bad(f"{where}.author", f"{author_id} has two chains")
        author = bytes.fromhex(keys[author_id])
        entries = []
        total += len(chain["entries"])
        if total > MAX_EXPORT_ENTRIES:
            raise bad(where, f"more than {MAX_EXPORT_ENTRIES} entries in all")
        for j, item in enumerate(chain["entries"]):
            at = f"{where}.entries[{j}]"
            if not isinstance(item, dict):
                raise bad(at, "expected {entry, signature}")
            encoded = _hex(item.get("entry"), None, f"{at}.entry", bad)
            signature = _hex(item.get("signature"), 64, f"{at}.signature", bad)
            try:
                entries.append(LedgerEntry.decode(encoded, signature))
            except LedgerError as exc:
                raise bad(at, exc.problem) from None
        try:
            verify_chain(entries, job_id, author)
        except LedgerError as exc:
            raise bad(f"{where}.entries[{exc.seq}]", f"{exc.problem} (author {author_id})") from None
        out[author_id] = entries
    _check_heads(out, {author: i for i, author in enumerate(out)}, bad)
    return VerifiedExport(job_id, out, name)


def _hex(value: Any, length: Optional[int], where: str, bad: Any, max_bytes: int = MAX_ENTRY_BYTES) -> bytes:
    if not isinstance(value, str) or len(value) > 2 * max_bytes:
        raise bad(where, "expected a hex string")
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raise bad(where, "expected a hex string") from None
    if length is not None and len(raw) != length:
        raise bad(where, f"expected {length} bytes, got {len(raw)}")
    return raw
