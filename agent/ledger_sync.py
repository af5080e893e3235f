"""The replicated ledger: every peer on a job keeps copies of the others' ledger chains (IPIP-0008 §5).

Each agent appends only to its own chain of a job (agent/store.py, signed by itself). So that the
record survives any single agent, and so that an agent that rewrites or cuts its own chain is
caught, every agent pulls the chains that the job's other participants hold, checks them, extends
its copies, and records every conflict it finds.

Wire, one stream per request on ``/infernet/ledger/1.0.0`` (apart from job sync, agent/roles/sync.py):
    client → server: the 32-byte job ID, then a half-close.
    server → client: ``uvarint(len) + canonical([entry, signature])`` for each entry of each chain of
                     the job it holds (its own and its copies), each chain in seq order, then
                     ``uvarint(0)``.
Limits: at most MAX_ENTRIES entries and MAX_BYTES bytes in all, each frame at most one entry
(64 KiB) plus its signature; TIMEOUT seconds for the whole exchange.

``/infernet/ledger/1.1.0`` (IPIP-0008 §5.1), what a client asks first: after the job ID one frame,
``uvarint(len) + canonical([[author, length, head hash], ...])``, the chains it holds; the server sends
each chain from protocol/ledger.serve_from (the entries the client lacks when its head is the server's
entry at that seq; its last entry when it holds fewer; else all of it). 1.0.0 sent every entry of every
chain at each sync, every 10 s, and the client checked each one and its own copy again: quadratic in a
job's length (8000 entries, 1.2-3 s of CPU per peer per sync). A peer that answers 1.1.0 with "na" (an
older agent) is asked over 1.0.0.

Trust: every entry is decoded and its signature checked (protocol/ledger.LedgerEntry.decode); the
entries of one signer must form a chain from seq 0, or a part of one from the seq its first entry
names, that continues the copy we hold (protocol/ledger.verify_chain from that seq, compare_part), else that
chain is refused and kept as an "invalid" conflict naming the server (its copy is bad). A verified chain is compared with our copy
(protocol/ledger.compare_part, against the stored hashes of ours): a longer one extends it; a different entry at a seq we hold is a
fork, proven by two entries the author signed; the author serving fewer entries than we hold of
its own chain is a truncation; a copy of *our own* chain longer than ours or different from it
means our store lost or changed entries. Conflicts are kept in the store, logged as warnings, and
shown by ``infernet job ledger``.

Only the chains of the job's participants (its submitter and whoever signed a stored message of
it) are kept, each at most MAX_COPY entries: a stranger cannot fill our disk with chains of its own.

Heads (IPIP-0008 §6.1): ``HEADS_AFTER`` seconds after a job ended, and before every export, an agent
appends a *heads* entry to its own chain: how many entries of every other chain it holds, and the
head's hash. ``ledger verify`` refuses an export that lacks or cuts a chain such an entry names.

When: ``sync_loop`` pulls, every ``INTERVAL`` seconds, for each job we follow that is running or ended
less than ``LINGER`` seconds ago, from each live participant (the submitter, the coordinator and
every peer that signed a message of the job).
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from agent.net.errors import NetError, PeerProtocolError, ProtocolNotSupported
from agent.net.streams import FrameReader, frame, remote_peer, request_frames
from agent.store import StoreFullError
from protocol.cid import varint_encode
from protocol.codec import canonical_encode, decode_canonical
from protocol.errors import CodecError, ProtocolError
from protocol.ledger import (
    MAX_ENTRY_BYTES, MAX_HELD, MAX_HELD_BYTES, ChainConflict, LedgerEntry, LedgerError, compare_part, decode_held,
    encode_held, serve_from, verify_chain,
)

log = logging.getLogger(__name__)

PROTOCOL = "/infernet/ledger/1.0.0"
PROTOCOL_FROM = "/infernet/ledger/1.1.0"  # the client names what it holds; the server sends what it lacks (§5.1)
MAX_ENTRIES = 20_000
MAX_BYTES = 32 << 20
MAX_FRAME = MAX_ENTRY_BYTES + 128
TIMEOUT = 20.0
INTERVAL = 10.0
LINGER = 120.0
HEADS_AFTER = 30.0  # seconds after a job ended (our mirror) before we sign what we hold of its chains
MAX_COPY = 200_000  # entries we keep of one author's chain of one job
END = varint_encode(0)


def frames_for(store: Any, job_id: bytes, held: dict[bytes, tuple[int, bytes]] | None = None) -> list[bytes]:
    """What we serve for ``job_id``: every entry of every chain we hold, as frames' payloads; to a client
    that named what it holds (``held``, /infernet/ledger/1.1.0), each chain from ``protocol.ledger.serve_from``."""
    out, total = [], 0
    starts = None if held is None else \
        {author: serve_from(store.chain_hashes(job_id, author, 0), held.get(author)) for author in store.chain_heads(job_id)}
    for rows in store.chain_rows(job_id, starts).values():
        for encoded, signature in rows:
            data = canonical_encode([encoded, signature])
            if len(out) >= MAX_ENTRIES or total + len(data) > MAX_BYTES:
                return out
            out.append(data)
            total += len(data)
    return out


class LedgerService:
    """Serves the chains we hold of any job (installed on every agent)."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.ended: dict[bytes, float] = {}  # followed jobs seen ended by ``sync_loop``: since when
        self.heads_written: set[bytes] = set()  # ended jobs whose heads entry ``sync_loop`` wrote

    def forget(self, job_id: bytes) -> None:
        """The agent stopped following the job (agent/node.py ``forget_job``)."""
        self.ended.pop(job_id, None)
        self.heads_written.discard(job_id)

    def install(self, host: Any) -> None:
        host.set_handler(PROTOCOL, self.handle, timeout=TIMEOUT)
        host.set_handler(PROTOCOL_FROM, self.handle_from, timeout=TIMEOUT)

    async def handle(self, stream: Any) -> None:
        reader = FrameReader(stream, chunk=64)
        job_id = await reader.read_exactly(32, f"{PROTOCOL} job id")
        await self._send(stream, job_id, None)

    async def handle_from(self, stream: Any) -> None:
        """/infernet/ledger/1.1.0: the job ID, then one frame naming the chains the client holds."""
        reader = FrameReader(stream, chunk=4096)
        job_id = await reader.read_exactly(32, f"{PROTOCOL_FROM} job id")
        body = await reader.read_frame(MAX_HELD_BYTES, f"{PROTOCOL_FROM} chains held")
        try:
            held = decode_held(body)
        except ProtocolError as exc:
            raise PeerProtocolError(f"{PROTOCOL_FROM} from {remote_peer(stream)}: {exc}") from None
        await self._send(stream, job_id, held)

    async def _send(self, stream: Any, job_id: bytes, held: dict[bytes, tuple[int, bytes]] | None) -> None:
        frames = frames_for(self.agent.store, job_id, held)
        for data in frames:
            await stream.write(frame(data))
        await stream.write(END)
        log.debug("ledger: sent %d entries of %s to %s", len(frames), job_id.hex()[:8], remote_peer(stream))


async def fetch_chains(host: Any, peer: str, job_id: bytes, timeout: float = TIMEOUT,
                       held: dict[bytes, tuple[int, bytes]] | None = None) -> list[tuple[bytes, bytes]]:
    """The (entry, signature) pairs ``peer`` holds for ``job_id``, unverified: with ``held`` (what we hold:
    author -> (length, head hash)), only what we lack of each chain (/infernet/ledger/1.1.0, IPIP-0008 §5.1),
    else, or from a peer that only speaks 1.0.0, every entry. NetError or PeerProtocolError naming the peer
    on failure; TooSlowError after ``timeout``."""
    frames = None
    if held is not None:
        request = job_id + frame(encode_held(dict(sorted(held.items())[:MAX_HELD])))
        try:
            frames = await request_frames(host, peer, PROTOCOL_FROM, request, max_frame=MAX_FRAME,
                                          max_frames=MAX_ENTRIES, max_bytes=MAX_BYTES, what="entry", timeout=timeout)
        except ProtocolNotSupported:
            frames = None  # an older agent: every entry, as it serves them
    if frames is None:
        frames = await request_frames(host, peer, PROTOCOL, job_id, max_frame=MAX_FRAME, max_frames=MAX_ENTRIES,
                                      max_bytes=MAX_BYTES, what="entry", timeout=timeout)
    out: list[tuple[bytes, bytes]] = []
    for data in frames:
        try:
            pair = decode_canonical(data, max_bytes=MAX_FRAME)
        except CodecError as exc:
            raise PeerProtocolError(f"{PROTOCOL}: {peer} sent a bad frame: {exc}") from None
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, bytes) for x in pair)):
            raise PeerProtocolError(f"{PROTOCOL}: {peer} sent a frame that is not [entry, signature]")
        out.append((pair[0], pair[1]))
    return out


def served_chains(pairs: list[tuple[bytes, bytes]], job_id: bytes,
                  server: str) -> tuple[dict[bytes, list[LedgerEntry]], list[ChainConflict]]:
    """The served entries grouped into verified chains by author, each whole from seq 0 or a part of it from
    the seq its first entry names (what a 1.1.0 server sends; ``absorb`` links it to our copy); and an
    "invalid" conflict for each chain refused (an entry that does not verify, a gap, a broken link: the
    server's copy is bad)."""
    by_author: dict[bytes, list[LedgerEntry]] = {}
    bad: dict[bytes, ChainConflict] = {}
    for encoded, signature in pairs:
        try:
            entry = LedgerEntry.decode(encoded, signature)
        except LedgerError as exc:
            author = _claimed_signer(encoded)
            if author not in bad:
                bad[author] = ChainConflict("invalid", author, server, exc.seq if exc.seq is not None else -1, 0, 0,
                                            problem=exc.problem)
            continue
        if entry.job_id == job_id:
            by_author.setdefault(entry.signer, []).append(entry)
    chains = {}
    for author, entries in by_author.items():
        if author in bad:
            continue
        try:
            verify_chain(entries, job_id, author, start=entries[0].seq)
        except LedgerError as exc:
            bad[author] = ChainConflict("invalid", author, server, exc.seq if exc.seq is not None else -1, 0,
                                        len(entries), problem=exc.problem)
            continue
        chains[author] = entries
    return chains, list(bad.values())


def _claimed_signer(encoded: bytes) -> bytes:
    """The signer an undecodable entry claims (for naming whose chain a bad copy is), else 32 zero bytes."""
    try:
        wire = decode_canonical(encoded, max_bytes=MAX_ENTRY_BYTES)
    except CodecError:
        return bytes(32)
    signer = wire.get("signer") if isinstance(wire, dict) else None
    return signer if isinstance(signer, bytes) and len(signer) == 32 else bytes(32)


def absorb(store: Any, job_id: bytes, chains: dict[bytes, list[LedgerEntry]], server: str,
           now: float, authors: set[bytes] | None = None) -> tuple[int, list[ChainConflict]]:
    """Compare each served chain with our copy: extend ours, record conflicts. Only chains of
    ``authors`` (when given: the job's participants) are kept, at most MAX_COPY entries each, so no
    peer can fill our disk with chains of keys that never took part. Returns (entries added, new conflicts)."""
    me = store.identity.public_key
    added, found = 0, []
    for author, served in chains.items():
        if authors is not None and author not in authors and author != me:
            continue
        conflict, new = compare_part(store.chain_hashes(job_id, author, 0), served, author, server,
                                     lambda seq, a=author: store.ledger_copy_entry(job_id, a, seq),
                                     ours=author == me, max_copy=MAX_COPY)
        if conflict is not None:
            if store.record_conflict(job_id, conflict, now):
                found.append(conflict)
            continue
        added += store.extend_copy(job_id, author, new)
    return added, found


def readable_chains(store: Any, job_id: bytes) -> tuple[dict[bytes, list[LedgerEntry]], dict[bytes, str]]:
    """The chains we hold that verify (protocol/ledger.verify_chain), and for each other one why not:
    what ``job ledger`` lists and exports (agent/jobdata.py) and a bill is checked against (agent/market.py)."""
    good, bad = {}, {}
    for author, rows in store.chain_rows(job_id).items():
        try:
            entries = [LedgerEntry.decode(e, sig) for e, sig in rows]
            verify_chain(entries, job_id, author)
        except LedgerError as exc:
            bad[author] = str(exc)
            continue
        good[author] = entries
    return good, bad


def job_authors(store: Any, view: Any) -> set[bytes]:
    """Public keys whose chains of the job we keep: its submitter and whoever signed a stored message of it."""
    from protocol.identity import public_key_from_peer_id

    return {public_key_from_peer_id(p) for p in {view.terms.submitter, *store.job_signers(view.job_id)}}


def participants(agent: Any, view: Any) -> list[str]:
    """Live peers that take part in the job: its submitter, coordinator, and whoever signed one of its messages."""
    peers = {view.terms.submitter, view.coordination.coordinator} | set(agent.store.job_signers(view.job_id))
    live = agent.live_peers()
    return sorted(p for p in peers if p and p != agent.peer_id and p in live)


async def sync_job(agent: Any, view: Any, peers: list[str] | None = None, timeout: float = TIMEOUT) -> dict:
    """Pull the job's chains from ``peers`` (default: its live participants) once.
    Returns {"peers": asked, "added": entries, "conflicts": [one line each, new ones]}."""
    peers = participants(agent, view) if peers is None else peers
    added, conflicts = 0, []
    fetched: dict[str, Any] = {}

    held = agent.store.chain_heads(view.job_id)  # (asked before any answer extends our copies)

    async def fetch(peer: str) -> None:
        try:
            fetched[peer] = await fetch_chains(agent.net.host, peer, view.job_id, timeout, held)
        except (NetError, PeerProtocolError, trio.TooSlowError) as exc:
            log.info("job %s: ledger sync with %s failed: %s", view.job_id.hex()[:8], peer[-8:], exc)

    # all peers at once, each within ``timeout``: one frozen or cut-off peer used to hold up the rest, and
    # `job ledger --sync` waited timeout x (silent peers) (the soak: a control request past 60 s)
    async with trio.open_nursery() as nursery:
        for peer in peers:
            nursery.start_soon(fetch, peer)
    for peer in peers:
        if peer not in fetched:
            continue
        pairs = fetched[peer]
        chains, invalid = served_chains(pairs, view.job_id, peer)
        n, found = absorb(agent.store, view.job_id, chains, peer, agent.clock(), job_authors(agent.store, view))
        found += [c for c in invalid if agent.store.record_conflict(view.job_id, c, agent.clock())]
        added += n
        for conflict in found:
            log.warning("job %s: ledger conflict: %s", view.job_id.hex()[:8], conflict.describe())
            conflicts.append(conflict.describe())
    return {"peers": peers, "added": added, "conflicts": conflicts}


async def write_heads(agent: Any, view: Any) -> bool:
    """Append a heads entry (IPIP-0008 §6.1) to our chain of the job: how much we hold of every other
    chain. Only when it says something our last one did not (a chain's attested length grew), so heads
    entries never answer each other. True when one was queued (``agent.flush_writes`` makes it)."""
    from protocol.ledger import heads_data

    await agent.flush_writes()
    chains = await trio.to_thread.run_sync(agent.store.chains, view.job_id, limiter=agent.store_limiter)
    me = agent.identity.public_key
    data = heads_data(chains, me)
    if not data["chains"]:
        return False
    last = next((e for e in reversed(chains.get(me, [])) if e.kind == "heads"), None)
    if last is not None and {k: list(v) for k, v in last.data.get("chains", {}).items()} == data["chains"]:
        return False
    agent.ledger(view.job_id, "heads", data)
    return True


async def sync_loop(agent: Any, interval: float = INTERVAL) -> None:
    """Keep our copies of every followed job's chains up to date (owned by the agent's nursery)."""
    ended = agent.ledger_service.ended  # emptied of a job when the agent forgets it
    while True:
        await trio.sleep(interval)
        now = agent.clock()
        for view in list(agent.jobs.values()):
            if view.state.terminal:
                ended.setdefault(view.job_id, now)
                if now - ended[view.job_id] > LINGER:
                    continue
            try:
                await sync_job(agent, view)
                if view.state.terminal and now - ended.get(view.job_id, now) >= HEADS_AFTER and \
                        view.job_id not in agent.ledger_service.heads_written:
                    # once the job's last entries had time to reach us: what we hold, signed (§6.1)
                    agent.ledger_service.heads_written.add(view.job_id)
                    await write_heads(agent, view)
            except StoreFullError as exc:  # no room for the copies: refuse new work, as for any write
                agent.refuse_work(exc)
            except Exception as exc:  # noqa: BLE001 - the copies are best effort; the agent runs on
                log.info("job %s: ledger sync: %s: %s", view.job_id.hex()[:8], type(exc).__name__, exc)
