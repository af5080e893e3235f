"""Following jobs: the jobs topic read, which announced jobs we follow, reading each one's topic, resuming
them after a restart, forgetting them once they ended.

Rules of this file:
- The jobs topic carries peers' heartbeats and capabilities (to the peer table, agent/peers.py; a peer
  new to us hears our capability at once), announcements (``follow_job``) and cancels (applied only
  when the job's submitter signed them).
- An announcement by its submitter is followed once (``follow_job``), within ``MAX_JOBS_FOLLOWED`` jobs in
  all and ``MAX_LIVE_JOBS_PER_SUBMITTER`` unended jobs per announcing peer (one identity cannot fill the
  room; IPIP-0004 §13). Our own jobs are held to the same limit when we announce them
  (agent/roles/submitter.py), so every follower can follow all of them. A job our store holds as ended is
  not followed again (an old announcement came back).
- Following a job: its row is stored first (a full disk: not followed, or our own announce fails), its
  mirror joins the book (agent/jobbook.py), its tasks get their nursery (agent/tasks.py ``own_job``), its
  topic is subscribed and read by a supervised reader that first catches up on the job's history from its
  submitter (a late joiner), or, for our own job resumed after a restart, from its live peers
  (agent/roles/sync.py); live messages wait in the subscription meanwhile. Each message then goes to the
  agent's ``receive`` (agent/node.py ``on_job_message``: the mirror, then the one commit).
- An ended job is forgotten ``Tasks.retention`` seconds after its tasks ended, or at once when a new job
  needs its room (the one that ended first goes first; never one whose tasks still run in their end
  grace: then the new job is refused): its mirror leaves the book, the roles drop what they kept for it
  (``on_forget``), its topic is left (``leaving`` until done: it is not followed again before) and its
  reader ends. The store keeps it.
- After a restart every unended job of our store is rebuilt from its stored envelopes (``resume_jobs``),
  with a fresh election view, and the roles take it up again (``on_resume``).
"""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import trio

from agent.jobbook import TERMINAL_STATES
from agent.store import StoreFullError
from agent.supervise import supervised
from protocol import messages as m
from protocol import state as st
from protocol.mirror import JobMirror

if TYPE_CHECKING:
    from agent.capability import Capabilities
    from agent.content.blockstore import BlockStore
    from agent.peers import PeerTable
    from agent.roles.sync import JobSync
    from agent.jobbook import JobBook
    from agent.net.stack import Network
    from agent.tasks import Tasks
    from agent.writer import StoreWriter
    from protocol.mirror import Outcome

log = logging.getLogger(__name__)

MAX_JOBS_FOLLOWED = 256  # jobs followed at once; an ended job makes room for a new one
# jobs not yet ended followed per announcing peer; we announce no more of our own (IPIP-0004 §13)
MAX_LIVE_JOBS_PER_SUBMITTER = st.MAX_LIVE_JOBS_PER_SUBMITTER

# a restarted agent's own decisions sent again (Following._send_decisions_again): at most this many, the newest,
# made at least RESEND_MARGIN s inside the envelope window, one per RESEND_GAP s, once a peer is on the job's
# topic (at most RESEND_WAIT s after the restart), of the term our mirror is in then
RESEND_MAX = 64
RESEND_MARGIN = 30.0
RESEND_GAP = 0.2
RESEND_WAIT = 30.0
RESEND_CATCH_UP = 10.0  # ... and at most this much longer for the submitter's history (its term)

Observer = Callable[..., None]  # the test harness's tap (agent/hooks.py), or None


class Following:
    """The jobs we follow, as a service: ``book`` holds their mirrors, ``tasks`` their tasks, ``writer``
    their rows; the roles hear of a job followed, resumed or forgotten through three callbacks."""

    def __init__(self, peer_id: str, clock: Callable[[], float], counters: Any, book: "JobBook", tasks: "Tasks",
                 writer: "StoreWriter", net: Callable[[], "Network"], blocks: Callable[[], "BlockStore"], *,
                 trains: bool, receive: Callable[[JobMirror, Any], Awaitable[None]],
                 settled: Callable[[JobMirror], None],
                 sync: "JobSync",
                 on_follow: Callable[[JobMirror], None], on_resume: Callable[[JobMirror], None],
                 on_forget: Callable[[bytes], None], peers: "PeerTable", capabilities: "Capabilities",
                 commit: Callable[[JobMirror, "Outcome"], Awaitable[bool]], observer: Observer | None = None) -> None:
        self.peer_id, self.clock, self.counters = peer_id, clock, counters
        self.book, self.tasks, self.writer, self.net, self.blocks = book, tasks, writer, net, blocks
        self.trains = trains  # do we train (a followed job's row says "worker"), or only observe
        self.receive, self.settled = receive, settled  # a job topic's message; a mirror caught up on history
        self.sync = sync  # a job's history: from its submitter, or for our own job from live peers
        self.on_follow, self.on_resume, self.on_forget = on_follow, on_resume, on_forget
        self.observer = observer
        self.peers, self.capabilities, self.commit = peers, capabilities, commit  # the jobs topic's other readers

    async def read_jobs_topic(self, subscription: Any) -> None:
        """The jobs topic: peers' heartbeats and capabilities (the peer table; a heartbeat's coordinating terms
        may let what our mirrors held apply), job announcements (followed), cancels by a job's submitter."""
        async for received in subscription:
            msg, signer, now = received.message, received.signer, self.clock()
            if self.observer is not None:
                self.observer("recv", received)
            if isinstance(msg, m.Heartbeat):
                arrived = self.peers.heard(signer, msg, now)
                if arrived and signer != self.peer_id and self.capabilities.tell_arrival(now):
                    self.tasks.one_shot("capability", self.capabilities.tell_arrived)
                self.tasks.notify()  # wait_until: someone may wait for a peer to be heard
                for entry in msg.coordinating:
                    view = self.book.jobs.get(entry.job_id)
                    if view is not None and signer != self.peer_id:  # (what was held for its term may apply)
                        await self.commit(view, view.observe_term(signer, entry.term, now,
                                                                  self.peers.eligible_coordinators(view.terms)))
            elif isinstance(msg, m.Capability):
                self.peers.told(signer, msg, now)
                self.tasks.notify()
            elif isinstance(msg, m.JobAnnouncement):
                await self.follow_job(msg.terms, signer, received.envelope.to_bytes())
            elif isinstance(msg, m.JobCancel):
                view = self.book.jobs.get(msg.job_id)
                if view is not None and signer == view.terms.submitter:
                    await self.commit(view, view.cancel(msg.reason, now))

    async def resume_jobs(self) -> None:
        """Rebuild the mirror of every unfinished job in our store, as if its messages arrived again.

        A restarted agent carries on where it was: the stored envelopes of each job's topic are
        replayed in stored order (``JobMirror.replay``: our own decisions as when we made them), with
        each envelope's own timestamp as the clock. The election view starts over with a fresh grace
        period, so we do not crown ourselves before the peers' heartbeats
        arrive; lease expiry and take-over then follow from the ticks as for any job.
        """
        for record in self.writer.store.jobs():
            if record.state in TERMINAL_STATES:
                continue
            view = self.book.rebuild(record)
            view.catching_up = record.terms.submitter != self.peer_id  # until the submitter's history is in
            self.book.add(view)
            await self.tasks.nursery.start(self.tasks.own_job, record.job_id)
            log.info("job %s: resumed from the store: %s, round %d, term %d", record.job_id.hex()[:8],
                     view.state.phase.value, view.state.round, view.coordination.term)
            if view.state.phase.value != record.state:  # queued: a full disk makes us refuse work, not stop
                self.writer.write_soon(self.writer.store.update_job, record.job_id, self.clock(),
                                       state=view.state.phase.value, round=view.state.round)
            subscription = await self.net().gossip.subscribe(m.job_topic(record.job_id))
            self.tasks.nursery.start_soon(partial(self.read_job_topic, view, subscription, True, resumed=True))  # supervised
            self.on_resume(view)
            self.tasks.one_shot(f"job {view.job_id.hex()[:8]}: provide again", self._provide_again, view)
            self.tasks.one_shot(f"job {view.job_id.hex()[:8]}: decisions again", self._send_decisions_again, view)

    async def _provide_again(self, view: JobMirror) -> None:
        """After a restart our address changed: provide again the job's aggregates and adapters we hold."""
        from protocol.cid import parse_cid

        cids = [a.adapter_cid for a in view.aggregates.values()]
        cids += [report.adapter_cid for report, _ in view.reports.values()]
        for text in cids:
            cid = parse_cid(text)
            if self.blocks().has(cid):
                with trio.move_on_after(30):
                    await self.net().discovery.provide(cid)

    async def _send_decisions_again(self, view: JobMirror) -> None:
        """After a restart: our own stored decisions still inside the envelope window (IPIP-0001 §4), sent again.
        A decision is stored before it is published (agent/evidence.py), so one made just before a crash may
        never have gone out: our rebuilt mirror holds a lease nobody else heard, its holder never trains it,
        and the others hold every later attempt of that shard (tests/roles/test_resume.py). A peer that heard it
        drops the copy (`replayed`, which blames nobody); one that did not applies it."""
        from protocol.envelope import MAX_AGE_S
        from protocol.errors import CodecError
        from protocol.mirror import DECISIONS

        now = self.clock()  # (read once: what we decide from now on goes out as it is made)
        ours = [s for s in self.writer.store.envelopes(view.job_id, stored_order=True)
                if s.signer == self.peer_id and isinstance(s.message, DECISIONS)
                and now - s.timestamp_ms / 1000 < MAX_AGE_S - RESEND_MARGIN]
        if not ours:  # (a worker's: it decides nothing)
            return
        gossip = self.net().gossip
        topic = m.job_topic(view.job_id)
        if not await self.tasks.wait_until(lambda: bool(gossip.mesh_peers(topic)), RESEND_WAIT):
            log.info("job %s: no peer on its topic %.0f s after the restart; our decisions are not sent again",
                     view.job_id.hex()[:8], RESEND_WAIT)
            return
        # only those of the term our mirror is in once it caught up on the submitter's history (bounded: a submitter
        # that is down does not stop them): the decisions of a term we were deposed from would only be held
        await self.tasks.wait_until(lambda: not view.catching_up, RESEND_CATCH_UP)
        term = view.coordination.term
        again = [s for s in ours if s.message.term == term][-RESEND_MAX:]  # (past the window meanwhile: CodecError)
        sent = 0
        for stored in again:
            try:
                await gossip.publish_sealed(stored.message, stored.data)
                sent += 1
            except CodecError:
                continue  # past the window meanwhile
            await trio.sleep(RESEND_GAP)  # peers cut a sender's bursts (the gossip rate limit)
        log.info("job %s: sent our %d decisions of the last %.0f s again after the restart", view.job_id.hex()[:8],
                 sent, MAX_AGE_S - RESEND_MARGIN)

    def unended_jobs(self, submitter: str) -> list[bytes]:
        """The followed jobs of ``submitter`` not ended (MAX_LIVE_JOBS_PER_SUBMITTER)."""
        return self.book.unended(submitter)

    async def follow_job(self, terms: m.JobTerms, signer: str, envelope: bytes | None = None) -> JobMirror | None:
        """Start following a job we saw announced (once); subscribe to its topic."""
        job_id = terms.job_id()
        if job_id in self.book.jobs:
            return self.book.jobs[job_id]
        if signer != terms.submitter:
            log.warning("job %s announced by %s, not its submitter; ignored", job_id.hex()[:8], signer[-8:])
            return None
        if job_id in self.book.leaving:  # forgotten a moment ago: its topic is still being left (forget_job)
            if signer != self.peer_id:  # the jobs topic's reader waits for nobody: its next announcement will do
                log.debug("job %s: its topic is still being left; not followed again yet", job_id.hex()[:8])
                return None
            await self.tasks.wait_until(lambda: job_id not in self.book.leaving, 15)  # leave() gives up after 10 s
            if job_id in self.book.jobs:
                return self.book.jobs[job_id]
        if signer != self.peer_id and self.writer.store.pending():
            await self.writer.flush()  # _room_to_follow reads the job's row: that of a job just forgotten is queued
            if job_id in self.book.jobs:
                return self.book.jobs[job_id]
        if signer != self.peer_id and not self.room_to_follow(job_id, signer):
            return None
        now = self.clock()
        role = "submitter" if signer == self.peer_id else ("worker" if self.trains else "observer")
        if not self.writer.stored(self.writer.store.add_job, terms, role, now):
            if signer == self.peer_id:
                raise StoreFullError(self.writer.store_full or "the store cannot be written")
            return None  # we cannot keep its evidence: we do not follow it (refused, logged)
        if envelope is not None:
            self.writer.stored(self.writer.store.record, envelope, now)
        view = JobMirror(terms, now, self.peer_id)
        view.catching_up = signer != self.peer_id  # until the submitter's history is in (_read_job_topic)
        self.book.add(view)
        await self.tasks.nursery.start(self.tasks.own_job, job_id)
        subscription = await self.net().gossip.subscribe(m.job_topic(job_id))
        # the job may have a history we missed (we joined late, or were down): ask its submitter
        self.tasks.nursery.start_soon(self.read_job_topic, view, subscription, True)  # its reading loop is supervised
        self.on_follow(view)
        return view

    def room_to_follow(self, job_id: bytes, signer: str) -> bool:
        """May we follow a job ``signer`` (not us) announced? Not if our store holds it as ended (we
        forgot it: an old announcement came again), nor past ``MAX_LIVE_JOBS_PER_SUBMITTER`` unended
        jobs of that signer, nor past ``MAX_JOBS_FOLLOWED`` unended jobs; an ended job, the one that
        ended first, is forgotten to make room, never one whose tasks still run (its end grace)."""
        record = self.writer.store.job(job_id)
        if record is not None and record.state in TERMINAL_STATES:
            return False
        live = [v for v in self.book.jobs.values() if not v.state.terminal]
        if len(self.book.unended(signer)) >= MAX_LIVE_JOBS_PER_SUBMITTER:
            self.counters["jobs_not_followed"] += 1
            log.debug("job %s: %s already has %d jobs we follow; not followed", job_id.hex()[:8], signer[-8:],
                      MAX_LIVE_JOBS_PER_SUBMITTER)
            return False
        if len(self.book.jobs) < MAX_JOBS_FOLLOWED:
            return True
        if len(live) >= MAX_JOBS_FOLLOWED:
            self.counters["jobs_not_followed"] += 1
            log.debug("job %s: we follow %d jobs already; not followed", job_id.hex()[:8], len(live))
            return False
        # an ended job whose tasks still run (its end grace: the decision that ended it being published)
        # is never forgotten: without any other, the new job is refused as when all are live
        ended = [j for j, v in self.book.jobs.items() if v.state.terminal and j not in self.tasks.job_tasks]
        if not ended:
            self.counters["jobs_not_followed"] += 1
            log.debug("job %s: we follow %d jobs already, none ended long enough to forget; not followed",
                      job_id.hex()[:8], len(self.book.jobs))
            return False
        now = self.clock()
        self.forget_job(min(ended, key=lambda j: self.tasks.ended_at.get(j, now)))
        return True

    def forget_job(self, job_id: bytes) -> None:
        """Stop following a job that ended: its mirror leaves ``jobs`` (it counts no more toward
        MAX_JOBS_FOLLOWED), its tasks are cancelled, its topic is left (in the background, within 10 s)
        and its reader ends. The store keeps the job and its evidence."""
        view = self.book.jobs.get(job_id)
        if view is None or not view.state.terminal:
            return
        del self.book.jobs[job_id]
        self.writer.forget(job_id)
        self.tasks.drop(job_id)
        self.on_forget(job_id)
        log.info("job %s: ended (%s); no longer followed", job_id.hex()[:8], view.state.phase.value)
        self.book.leaving.add(job_id)  # not followed again until its topic is left (a new subscription would be closed)

        async def leave() -> None:
            try:
                with trio.move_on_after(10):
                    await self.net().gossip.unsubscribe(m.job_topic(job_id))
            finally:
                self.book.leaving.discard(job_id)
                self.tasks.notify()

        self.tasks.nursery.start_soon(leave)
        self.tasks.notify()

    async def read_job_topic(self, view: JobMirror, subscription: Any, catch_up_first: bool = False, *,
                              resumed: bool = False) -> None:
        """Apply the job topic's messages to our mirror; first, if asked, catch up on the job's history
        from its submitter, or, if we are the submitter and ``resumed`` it after a restart, from its
        live peers (live messages wait in the subscription meanwhile; agent/roles/sync.py)."""
        synced: set[bytes] = set()
        try:
            if catch_up_first and view.terms.submitter != self.peer_id:  # (catching_up set when followed)
                synced = await self.sync.catch_up(view)
            elif catch_up_first and resumed:
                synced = await self.sync.submitter_catch_up(view)
        except StoreFullError as exc:
            self.writer.refuse_work(exc)
        except Exception as exc:  # noqa: BLE001 - a failed catch-up is logged; live messages still apply
            self.counters["task_failures"] += 1
            log.error("job %s: catching up failed (%s: %s)", view.job_id.hex()[:8], type(exc).__name__, exc,
                      exc_info=exc)
        finally:
            view.catching_up = False
        if synced:
            self.settled(view)
        await supervised(f"job {view.job_id.hex()[:8]} topic reader", self._apply_job_topic, view, subscription,
                         synced, counters=self.counters)

    async def _apply_job_topic(self, view: JobMirror, subscription: Any, synced: set[bytes]) -> None:
        async for received in subscription:
            if self.observer is not None:
                self.observer("recv", received)
            if self.book.jobs.get(view.job_id) is not view:
                break  # the job was forgotten (forget_job): what is still buffered is not applied
            if received.envelope.message_id in synced:
                continue  # already applied from the history
            await self.receive(view, received)
