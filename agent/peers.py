"""PeerTable: the peers an agent hears, and who among them is live, may coordinate a job, or is its submitter.

Rules of this file:
- One service with one job (issue 23: the agent as a few services): it holds each peer's latest
  heartbeat and signed capability (``PeerInfo``), fed by the agent's jobs-topic reader
  (``heard``/``told``), and answers the liveness questions the election asks, with the protocol's own
  rules (protocol/election.py: ``live_peers``, ``eligible_for_job``, ``hears_submitter``). No I/O.
- Liveness is read off heartbeats alone: a peer is live while its last heartbeat is less than
  ``heartbeat_seconds`` x ``missed_heartbeats`` old; one back after such a silence (it restarted, or a
  partition healed) is live again from its next heartbeat, ``live_since`` then.
- We are eligible to coordinate only while ``ours()`` gives our capability (the agent gives None when
  it may not coordinate: its config says so, or its disk is full); we act as a job's coordinator only
  while ``is_coordinator`` says so (our mirror's election names us, and the rest of its conditions).
- ``reputations()``: each worker's record across the jobs in our store (agent/market.Reputations, set by
  the agent; none before), read by the coordinator to order the claims it grants.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from protocol import messages as m
from protocol.election import eligible_for_job, hears_submitter, live_peers


@dataclass
class PeerInfo:
    last_heartbeat: float
    capability: m.Capability | None = None
    live_since: float = 0.0  # when its heartbeats started arriving again after a silence
    active_shards: int = 0  # from its latest heartbeat: busy (> 0) or idle
    heartbeats: int = 0  # heard from it (its capability may come first: a starting agent publishes that first)
    seq: int = 0  # its latest heartbeat's count (each start of an agent counts from 1)


class PeerTable:
    def __init__(self, me: str, clock: Callable[[], float], heartbeat_seconds: float, missed_heartbeats: int,
                 ours: Callable[[], m.Capability | None], grace_seconds: float = 0.0) -> None:
        self.me = me
        self.grace_seconds = grace_seconds  # how long a job is followed before we may act as its coordinator
        self.clock = clock
        self.heartbeat_seconds = heartbeat_seconds
        self.missed_heartbeats = missed_heartbeats
        self.ours = ours
        self.peers: dict[str, PeerInfo] = {}
        self.hearing_peers_since: float | None = None  # other peers' heartbeats arrive without a break since
        self.beating_since: float | None = None  # ... counted by heartbeats alone (a capability is no heartbeat)
        self._last_beat = float("-inf")  # when another peer's heartbeat last arrived
        self.reputations: Callable[[], dict[str, Any]] = dict  # worker -> protocol/market.Reputation

    @property
    def silence(self) -> float:
        """Seconds without a heartbeat after which a peer is no longer live."""
        return self.heartbeat_seconds * self.missed_heartbeats

    def heard(self, signer: str, heartbeat: m.Heartbeat, now: float) -> bool:
        """A heartbeat of ``signer`` arrived; True if the peer is new to us or back after a silence."""
        if signer != self.me and not self.live_peers():
            self.hearing_peers_since = now  # the first peer heard since we (re)started or were alone
        if signer != self.me and now - self._last_beat >= self.silence:
            # the same, by heartbeats alone: a capability that came first makes its peer look live above, so an
            # agent that heard a capability before any heartbeat never set hearing_peers_since (a coordinator then
            # revoked no silent holder's lease, IPIP-0004 §5.3). The submitter's election (IPIP-0006 §1.3 rule 5)
            # still reads hearing_peers_since: set by heartbeats, the submitter of the coordinator-crash-aggregate
            # scenario moved its own view before it heard the coordinator's heartbeats, and leasing stalled
            self.beating_since = now
        if signer != self.me:
            self._last_beat = now
        info = self.peers.setdefault(signer, PeerInfo(now, live_since=now))
        # new to us: its first heartbeat, whether or not its capability came first (an agent publishes its
        # capability before its first heartbeat, so "not in the table" was never true of a new agent, and
        # nobody told it theirs: the late-joiner scenario's newcomer lacked the coordinator's, took it for
        # ineligible, elected itself in term 2 and refused the job's final aggregate)
        arrived = info.heartbeats == 0
        info.heartbeats += 1
        if now - info.last_heartbeat > self.silence:
            info.live_since = now  # back after a silence (it restarted, or a partition healed)
            arrived = True
        elif heartbeat.seq < info.seq:
            # it restarted quicker than we miss a peer: its count starts over, and it lost what it had heard of us
            # (a restarted coordinator heard no capability for 15 s and refused every claim meanwhile)
            arrived = True
        info.seq = heartbeat.seq
        info.last_heartbeat = now
        info.active_shards = heartbeat.active_shards
        return arrived

    def told(self, signer: str, capability: m.Capability, now: float) -> None:
        """A peer's signed capability arrived."""
        self.peers.setdefault(signer, PeerInfo(now, live_since=now)).capability = capability

    def capability_of(self, peer: str) -> m.Capability | None:
        info = self.peers.get(peer)
        return None if info is None else info.capability

    def live_peers(self) -> frozenset[str]:
        """Other peers whose heartbeats still arrive."""
        return live_peers({p: i.last_heartbeat for p, i in self.peers.items() if p != self.me}, self.clock(),
                          self.heartbeat_seconds, self.missed_heartbeats)

    def eligible_coordinators(self, terms: m.JobTerms | None = None) -> frozenset[str]:
        """Live peers that said they can coordinate (ourselves included if we can); for a job
        (``terms``), only those whose capability can replay it (protocol/election.eligible_for_job)."""
        live = live_peers({p: i.last_heartbeat for p, i in self.peers.items()}, self.clock(),
                          self.heartbeat_seconds, self.missed_heartbeats)
        caps: dict[str, Any] = {p: self.peers[p].capability for p in live}
        ours = self.ours()
        if ours is not None:
            live = live | {self.me}
            caps[self.me] = ours
        if terms is not None:
            return eligible_for_job(live, caps, terms)
        return frozenset(p for p in live if caps.get(p) is not None and caps[p].can_coordinate)

    def hears_submitter(self, view: Any, *, settled: bool = False) -> bool:
        """Is the job's submitter live to us (or are we it)? Only then may we act as coordinator, and
        only once we have heard it for ``missed_heartbeats`` heartbeats (``settled``) does our election
        view change: in a partition the submitter's side decides (IPIP-0006 §1.3), and right after a
        heal the others' heartbeats need that long to tell who is really gone."""
        submitter = view.terms.submitter
        info = self.peers.get(submitter)
        heard = {} if info is None else {submitter: info.last_heartbeat}
        since = {} if info is None else {submitter: info.live_since}
        if submitter == self.me:  # since when we have heard others (none yet: never)
            since = {} if self.hearing_peers_since is None else {self.me: self.hearing_peers_since}
        return hears_submitter(submitter, self.me, heard, since, self.clock(), settled=settled,
                               heartbeat_seconds=self.heartbeat_seconds, missed_heartbeats=self.missed_heartbeats)

    def is_coordinator(self, view: Any) -> bool:
        """Do we act as the job's coordinator now? Our view names us, its grace period is over, we hear
        the submitter, and our mirror is not catching up on history: a coordinator restarted from its
        store believed itself term 1's coordinator again while the others had moved to term 2, and the
        two granted conflicting leases until the job ran out of attempts (the soak, issue 21)."""
        return view.coordination.is_coordinator(self.me) and not view.catching_up and \
            self.clock() - view.first_seen >= self.grace_seconds and self.hears_submitter(view)
