"""Catching up on a job: its signed history, fetched from the job's submitter (IPIP-0004 §11).

Gossip only carries what is sent while a peer listens. An agent that joins a running job, or comes
back after being down, asks the submitter for the job-topic envelopes it stored and replays them
through its mirror, oldest first, before (or while) live messages arrive.

Wire, one stream per request on ``/infernet/jobsync/1.0.0``:
    client → server: the 32-byte job ID, then a half-close.
    server → client: ``uvarint(len) + envelope`` for each stored job-topic envelope of the job, in
                     the order the server stored them (claims left out), then ``uvarint(0)``.
Limits: at most MAX_HISTORY envelopes and MAX_HISTORY_BYTES in all, each at most the envelope limit;
30 s for the whole exchange. A server that does not follow the job sends ``uvarint(0)`` at once.

What is served is what changed the server's mirror, in the order it applied (agent/node.py stores
nothing else), so replaying it rebuilds that mirror. A history over the limits sends the decisions
(leases, verdicts, aggregates), reports and releases first and fills what room is left with
checkpoint commitments, still in stored order: a checkpoint only extends a lease, so leaving some out
costs a lease extension, never a decision.

Trust: every envelope is checked again (signature, strict body, the job ID) regardless of its age;
nothing unsigned or foreign gets in. Coordinator decisions in the history are taken as the
submitter accepted them (the term of each is believed), as after a restart from our own store: a
lying submitter can only confuse mirrors of its own job.
"""

from __future__ import annotations

import logging
import random
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import trio

from agent.net.errors import NetError, PeerProtocolError
from agent.net.streams import FrameReader, frame, remote_peer, request_frames
from agent.store import StoreFullError, reopen
from protocol import messages as m
from protocol.mirror import JobMirror, Outcome
from protocol.resync import got_further, holds_decisions
from protocol.cid import varint_encode
from protocol.envelope import MAX_ENVELOPE_BYTES

if TYPE_CHECKING:
    from agent.peers import PeerTable
    from agent.store import Store
    from agent.tasks import Tasks
    from agent.writer import StoreWriter

log = logging.getLogger(__name__)

PROTOCOL = "/infernet/jobsync/1.0.0"
MAX_HISTORY = 50_000
MAX_HISTORY_BYTES = 64 << 20
TIMEOUT = 30.0
END = varint_encode(0)


# never served: a claim is a request to the coordinator, the announcement is on the jobs topic (a
# catch-up refuses both: serving them cost a warning on every resync of every peer)
NOT_HISTORY = frozenset({m.ShardClaim.TYPE, m.JobAnnouncement.TYPE})


def history_for(store: Any, job_id: bytes, max_count: int = MAX_HISTORY,
                max_bytes: int = MAX_HISTORY_BYTES) -> list[bytes]:
    """The job-topic envelopes we would send for ``job_id``, in stored order (claims are requests, not
    history); over the limits, everything but checkpoints first (see the module's docstring)."""
    history = [s for s in store.envelopes(job_id, stored_order=True) if s.type not in NOT_HISTORY]
    chosen: set[int] = set()
    count = total = 0
    for first in (True, False):
        for i, stored in enumerate(history):
            if (stored.type != "ckpt") != first or i in chosen:
                continue
            if count >= max_count or total + len(stored.data) > max_bytes:
                continue
            chosen.add(i)
            count += 1
            total += len(stored.data)
    return [stored.data for i, stored in enumerate(history) if i in chosen]


class SyncService:
    """Serves our stored history of any job (installed on every agent)."""

    def __init__(self, store: Callable[[], "Store"]) -> None:
        self.store = store  # the agent's store, once open
        self.served = 0

    def install(self, host: Any) -> None:
        host.set_handler(PROTOCOL, self.handle, timeout=TIMEOUT)

    async def handle(self, stream: Any) -> None:
        reader = FrameReader(stream, chunk=64)
        job_id = await reader.read_exactly(32, f"{PROTOCOL} job id")
        # reading and re-verifying up to MAX_HISTORY envelopes takes seconds: not on the event loop
        history = await trio.to_thread.run_sync(history_for, self.store(), job_id)
        for data in history:
            await stream.write(frame(data))
        await stream.write(END)
        self.served += 1
        log.debug("jobsync: sent the history of %s to %s", job_id.hex()[:8], remote_peer(stream))


async def fetch_history(host: Any, peer: str, job_id: bytes, timeout: float = TIMEOUT) -> list[bytes]:
    """The envelopes ``peer`` holds for ``job_id`` (unverified: the caller checks each one).
    NetError or PeerProtocolError naming the peer on any failure; TooSlowError after ``timeout``."""
    # the stream may take the whole timeout to open: a history is asked for when a peer comes back, when every
    # peer is busy with it (a soak on 2 cores saw a restarted submitter's 8 requests all answered 8-9 s
    # late by peers that were training, and at 10 s all 8 failed, for a minute)
    return await request_frames(host, peer, PROTOCOL, job_id, max_frame=MAX_ENVELOPE_BYTES, max_frames=MAX_HISTORY,
                                max_bytes=MAX_HISTORY_BYTES, what="envelope", timeout=timeout, open_timeout=timeout)


def _verified(history: list[bytes], job_id: bytes) -> tuple[list[Any], int]:
    """The history's envelopes that verify (whatever their age) and belong to the job; and how many did not."""
    from protocol.errors import CodecError

    out, refused = [], 0
    for data in history:
        try:
            opened = reopen(data)
        except CodecError:
            refused += 1
            continue
        msg = opened.message
        if getattr(msg, "job_id", None) != job_id or isinstance(msg, (m.ShardClaim, m.JobAnnouncement)):
            refused += 1
            continue
        out.append((data, opened))
    return out, refused


PEERS_ASKED = 8  # a restarted (or stalled) submitter asks at most this many live peers for what it missed


class JobSync:
    """Catching up on jobs, rebuilding and repairing their mirrors (the module docstring), for one agent:
    the peers we hear (who is live, who may coordinate), the agent's tasks (waits with a deadline), its
    store writer (what we hold, job rows, a full disk), its network (fetched once it runs) and its one
    ``commit``."""

    def __init__(self, peer_id: str, clock: Callable[[], float], peers: "PeerTable", tasks: "Tasks",
                 writer: "StoreWriter", net: Callable[[], Any],
                 commit: Callable[..., Awaitable[bool]], reach: Callable[[str], Awaitable[None]]) -> None:
        self.peer_id, self.clock = peer_id, clock
        self.peers, self.tasks, self.writer, self.net, self.commit = peers, tasks, writer, net, commit
        self.reach = reach  # connect to a peer, its address found in the DHT (ContentService.reach)

    async def _fetch_verified(self, view: Any, timeout: float, what: str, peer: str | None = None) -> list[Any] | None:
        """The history of the job held by ``peer`` (by default its submitter), each envelope verified;
        None (logged) if that is us or it could not be had."""
        peer = peer or view.terms.submitter
        if peer == self.peer_id:
            return None
        try:
            # a restarted submitter hears its peers' gossip through one of them, and holds no address of the
            # others: the scenario submitter-coordinator-down saw its first catch-up fail for the coordinator
            # ("no known addresses"), and the next come 12 s later
            with trio.move_on_after(min(10.0, timeout / 2)):
                try:
                    await self.reach(peer)  # (at once when connected)
                except NetError:
                    pass  # (the fetch says why)
            history = await fetch_history(self.net().host, peer, view.job_id, timeout)
        except (NetError, PeerProtocolError, trio.TooSlowError) as exc:
            log.info("job %s: could not %s from %s: %s", view.job_id.hex()[:8], what, peer[-8:], exc)
            return None
        verified, refused = await trio.to_thread.run_sync(_verified, history, view.job_id)  # signatures: off the loop
        if refused:
            log.warning("job %s: %d envelopes from %s's history refused", view.job_id.hex()[:8], refused, peer[-8:])
        return verified

    async def submitter_catch_up(self, view: Any, timeout: float = TIMEOUT) -> set[bytes]:
        """We are the job's submitter, back after being down (or our mirror holds decisions it cannot
        apply): the job went on without us. Once we hear peers, ask up to PEERS_ASKED live ones that follow
        the job, its coordinator first, for the envelopes we did not store, and apply them as live
        messages with their own timestamps: coordinator decisions pass our election view like live
        ones (nobody's stored junk can move our term), the rest is applied as anyone's. Returns the
        message IDs applied (the live reader skips them). IPIP-0004 §11, IPIP-0006 §1.3 rule 5."""
        window = self.peers.silence  # heartbeat_seconds x missed_heartbeats: how long we listen first
        # until we hear someone (our view waits as long: election.py)
        await self.tasks.wait_until(lambda: bool(self.peers.live_peers()), 2 * timeout)
        # a moment for the others' heartbeats and capabilities
        await self.tasks.wait_until(lambda: len(self.peers.live_peers()) >= 2, min(window, 2.0))
        live = sorted(self.peers.live_peers())
        coordinator = view.coordination.coordinator
        # the coordinator first, the others in a new order each time: the soak saw a stalled submitter ask the
        # same three peers (sorted by ID) every minute while none of them held the release that had ended the
        # job on the others. They are asked at once (a dead one costs its timeout once, not in turn).
        random.shuffle(live)
        peers = sorted(live, key=lambda p: p != coordinator)[:PEERS_ASKED]
        applied, answered, histories = await self._receive_histories(view, peers, timeout, vouch=True)
        if coordinator is not None and histories.get(coordinator) and \
                holds_decisions(view, self.peers.eligible_coordinators(view.terms)):
            await self._rebuild_from(view, coordinator, histories[coordinator])
        if applied:
            log.info("job %s: caught up on %d messages from %d peers after a restart (%d held): %s, round %d, "
                     "term %d", view.job_id.hex()[:8], len(applied), len(peers), len(view.pending),
                     view.state.phase.value, view.state.round, view.coordination.term)
            self.writer.save_job_row(view)
        else:  # said, so that a submitter that stays behind shows why (a soak's stuck submitter logged nothing)
            log.info("job %s: caught up on nothing from %d peers after a restart (%d of them answered; %d held): "
                     "%s, round %d, term %d", view.job_id.hex()[:8], len(peers), answered, len(view.pending),
                     view.state.phase.value, view.state.round, view.coordination.term)
        return applied

    async def repair(self, view: Any, peers: tuple[str, ...], timeout: float = TIMEOUT) -> set[bytes]:
        """Our mirror holds worker messages it cannot apply (protocol/resync.repair_sources): ask their signers,
        not the submitter, for their history of the job, and receive what we lack as any peer's messages
        (IPIP-0004 §11.1). Returns the message IDs applied."""
        applied, _, _ = await self._receive_histories(view, list(peers), timeout, act=True)
        if applied:
            log.info("job %s: repaired %d messages from %s: %s, round %d", view.job_id.hex()[:8], len(applied),
                     ", ".join(p[-8:] for p in peers), view.state.phase.value, view.state.round)
            self.writer.save_job_row(view)
        return applied

    async def _receive_histories(self, view: Any, peers: list[str], timeout: float, *, act: bool = False,
                                 vouch: bool = False) -> tuple[set[bytes], int, dict[str, list[Any] | None]]:
        """Fetch ``peers``' histories of the job at once, then receive, peer by peer, the envelopes our store lacks
        as live messages with their own timestamps (``history=True``): coordinator decisions pass our election
        view like live ones (nobody's stored junk can move our term), the rest is applied as anyone's; then
        the live messages held meanwhile are tried once at the real now. What applied is committed with its
        reactions; the state machine's actions of the past are nobody's to carry out. Returns (the message
        IDs applied, how many of ``peers`` answered, each peer's verified history or None).

        ``vouch`` (the submitter catching up): the history of our view's coordinator vouches for the
        decisions of earlier terms in it (IPIP-0006 §1.3 rule 9): a coordinator that is gone signed them,
        and our view may have moved past their term before they arrived (a later term's live lease). So
        that history is received again, once the others moved our view, for what did not apply the
        first time. (Found by a soak, reproduced by killing the submitter 2 s after it announced and the
        term-1 coordinator once it had leased: the restarted submitter refused the dead coordinator's
        term-1 leases, as stale or as not live, then every report, verdict and aggregate after them, and
        stayed in round 1 while the others finished.)"""
        histories: dict[str, list[Any] | None] = {}

        async def fetch(peer: str) -> None:
            histories[peer] = await self._fetch_verified(view, timeout, "catch up", peer)

        async with trio.open_nursery() as nursery:
            for peer in peers:
                nursery.start_soon(fetch, peer)
        applied: set[bytes] = set()
        ids = {data: opened.envelope.message_id for history in histories.values() for data, opened in history or ()}

        async def receive(peer: str) -> None:
            outcomes = []
            for data, opened in histories.get(peer) or ():
                if self.writer.store.has_envelope(opened.envelope.message_id):
                    continue  # (what applied in an earlier pass is stored: committed below)
                outcomes.append(_as_live(view, opened, data, self.peers.eligible_coordinators(view.terms),
                                         vouched=vouch and peer == view.coordination.coordinator))
            if outcomes:  # the live messages held meanwhile, tried once at the real now (not at a stored time)
                outcomes.append(view.retry(self.clock(), self.peers.eligible_coordinators(view.terms)))
            outcome = Outcome.join(outcomes)
            applied.update(ids[data] for data in outcome.evidence if data in ids)
            # what applied, in the order it did; then our copies of the accepted work and aggregates we missed
            await self._commit(view, outcome if act else replace(outcome, actions=() if outcome.changed else None))

        for peer in peers:
            await receive(peer)
        if vouch and view.coordination.coordinator in histories:
            await receive(view.coordination.coordinator)  # what its history held from before our view reached its term
        return applied, sum(1 for history in histories.values() if history is not None), histories

    async def _rebuild_from(self, view: JobMirror, coordinator: str, history: list[Any]) -> bool:
        """We are the job's submitter and our mirror still holds decisions of the job's coordinators after we
        caught up (protocol/resync.holds_decisions): it diverged on something we stored, not on something we
        missed, so no message we lack can mend it. The case met (scenario submitter-coordinator-down under load,
        agent processes): a lease's clock ran out in our mirror a tenth of a second before the holder's first
        checkpoint reached us, while the other mirrors, which had heard the lease a little later, took the
        checkpoint; our mirror reopened the shard, held the holder's report, the verdict and every aggregate
        after it, and the job stayed TRAINING for us while the others ended it DONE. So the mirror is rebuilt
        from our view's coordinator's history, each message received as a live one at its signed time (every
        signature and election rule checked, IPIP-0006 §1.3 rule 9 for its past terms: not a replay, which
        would believe any signer at its term), and adopted only if it got further than ours
        (protocol/resync.got_further). IPIP-0004 §11. True if adopted."""
        eligible = self.peers.eligible_coordinators(view.terms)
        fresh = JobMirror(view.terms, view.first_seen, view.me)
        # twice: again for what applies once the first pass moved the view (as _receive_histories does)
        outcomes = [_as_live(fresh, opened, data, eligible, vouched=True) for _ in range(2) for data, opened in history]
        if not got_further(fresh, view):
            log.info("job %s: our mirror holds %d messages; rebuilt from %s's history it gets no further "
                     "(%s round %d), kept", view.job_id.hex()[:8], len(view.pending), coordinator[-8:],
                     fresh.state.phase.value, fresh.state.round)
            return False
        await self._adopt(view, fresh, Outcome.join(outcomes), f"the coordinator {coordinator[-8:]}'s", len(history))
        return True

    async def _adopt(self, view: JobMirror, fresh: JobMirror, history: Outcome, whose: str, messages: int) -> None:
        """Swap in ``fresh``, our mirror rebuilt from ``whose`` history (``JobMirror.adopt``: the held live messages
        tried on it), then commit the history and what they did on it, reactions included."""
        before = (view.state.phase.value, view.state.round, len(view.pending))
        # nothing may run on the old mirror between the rebuild and the swap: no await until adopt
        outcome = view.adopt(fresh, history, self.clock(), self.peers.eligible_coordinators(view.terms))
        await self._commit(view, outcome)
        log.warning("job %s: mirror rebuilt from %s history (%d messages): was %s round %d with %d held, "
                    "now %s round %d, term %d", view.job_id.hex()[:8], whose, messages, *before,
                    view.state.phase.value, view.state.round, view.coordination.term)
        self.writer.save_job_row(view)

    async def _commit(self, view: JobMirror, outcome: Outcome, *, act: bool = True) -> None:
        """The agent's ``commit``; a full disk raises StoreFullError to the caller, as a direct store write would."""
        if not await self.commit(view, outcome, act=act):
            raise StoreFullError(self.writer.store_full or "the store cannot be written")

    async def catch_up(self, view: Any, timeout: float = TIMEOUT) -> set[bytes]:
        """Replay into ``view`` the job's history held by its submitter that is not in our store yet.
        Returns the message IDs applied (the live reader skips them); failures are logged, not raised."""
        verified = await self._fetch_verified(view, timeout, "catch up")
        applied: set[bytes] = set()
        outcomes = []
        for data, opened in verified or ():
            if self.writer.store.has_envelope(opened.envelope.message_id):
                continue
            outcomes.append(_replay(view, opened, data))
            applied.add(opened.envelope.message_id)
        outcome = Outcome.join(outcomes)
        await self._commit(view, outcome, act=False)  # history: stored, nothing to carry out
        if applied:
            log.info("job %s: caught up on %d messages from the submitter: %s, round %d, term %d",
                     view.job_id.hex()[:8], len(applied), view.state.phase.value, view.state.round,
                     view.coordination.term)
            self.writer.save_job_row(view)
        return applied

    async def resync(self, view: JobMirror, timeout: float = TIMEOUT) -> bool:
        """Our mirror has diverged (it holds messages it cannot apply: we missed some, or we were cut off
        and decided things the rest never saw): rebuild it from the submitter's whole history, in place
        (``JobMirror.adopt``: the submitter's record wins, its coordinator term included), then commit the
        history and what held live messages did on it (e.g. a held verdict that completes the round:
        Aggregate), reactions included. False if the mirror was kept."""
        verified = await self._fetch_verified(view, timeout, "resync")
        if not verified:
            return False
        fresh = JobMirror(view.terms, view.first_seen, view.me)
        history = Outcome.join([_replay(fresh, opened, data) for data, opened in verified])
        await self._adopt(view, fresh, history, "the submitter's", len(verified))
        return True


def _as_live(view: JobMirror, opened: Any, data: bytes, eligible: frozenset[str], *, vouched: bool) -> Outcome:
    """A stored envelope of a peer's history received as a live message at its signed time (``history=True``)."""
    return view.receive(opened.message, opened.envelope.signer, opened.envelope.timestamp_ms / 1000.0, eligible, data,
                        history=True, vouched=vouched)


def _replay(view: JobMirror, opened: Any, data: bytes | None = None) -> Outcome:
    return view.replay(opened.message, opened.envelope.signer, opened.envelope.timestamp_ms / 1000.0, data)
