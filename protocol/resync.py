"""When a follower's mirror of a job asks for history, and from whom (IPIP-0004 §11.1).

A mirror (protocol/mirror.py) holds a message it cannot apply yet: gossip reorders, or we missed what
it builds on. Held briefly, it is reordering; held long, we missed something, and the history that
fills the gap is asked for. Three rules, each a pure function of the mirror and the time, the same
for the agent (agent/jobclock.py) and the simulator (agent/harness/sim.py):

- ``needs_resync``: a held *decision* (lease, verdict, aggregate) of an eligible coordinator: the
  mirror is rebuilt from the submitter's whole history (the submitter's record wins).
- ``stalled``: our own job, with nothing applied for a long while: the submitter asks live peers.
- ``holds_decisions`` and ``got_further``: the submitter itself has no submitter to rebuild from. When its
  mirror still holds a decision of an eligible coordinator after it caught up on what it lacked, it diverged
  on what it stored (a lease's clock ran out in its mirror alone): it rebuilds from its view's coordinator's
  history, received as live messages, and keeps the rebuilt mirror only if it ``got_further`` (IPIP-0004 §11).
- ``repair_sources``: a held *worker message* (checkpoint, report, release): its signer holds a lease
  our mirror lacks, so the signer is asked for its history of the job, and what its history holds
  is received as any peer's messages (``JobMirror.receive(history=True)``: every signature and
  every election rule checked as for a live message). Before this rule a worker's mirror that missed
  another worker's lease kept claiming that shard until a decision it could not apply arrived,
  about a shard's training time later (IPIP-0009). The signer, not the submitter, is asked: anyone
  can publish a worker message that names no real lease, and asking the submitter for every such
  message would let one identity make every follower of a job fetch the job's history from its
  submitter at once; asked of the signer, junk costs the sender what it makes us fetch, one peer
  and one fetch per ``RESYNC_INTERVAL`` and job.

Only messages held since the last rebuild or repair (``view.resynced_at``) count: what the history
did not make apply would not apply after another fetch either (it waits out the mirror's
``PENDING_SECONDS``). Nothing counts once the job ended: its outcome is signed.
"""

from __future__ import annotations

from typing import Any

from protocol import messages as m
from protocol.mirror import DECISIONS
from protocol.state import ShardPhase

RESYNC_HELD_SECONDS = 5.0  # a message held this long means our mirror missed something (not reordering)
RESYNC_INTERVAL = 15.0  # at most one rebuild or repair of a job's mirror this often
STALL_SECONDS = 60.0  # a submitter's unended job with no message applied this long (nor 2 leases' time) asks peers
REPAIR_PEERS = 2  # the signers of held worker messages asked at one repair, the longest held first

WORKER_MESSAGES = (m.CheckpointCommit, m.ShardReport, m.ShardRelease)


def _held(view: Any, kinds: tuple[type, ...], now: float, held_seconds: float, *,
          whenever: bool = False) -> list[tuple[float, Any, str]]:
    """(since, message, signer) of what the mirror holds of ``kinds``, by others, over ``held_seconds``, since
    the last rebuild or repair (``whenever``: all of it); nothing once the job ended."""
    if view.state.terminal:
        return []
    since = None if whenever else view.resynced_at
    return [(seen, msg, signer) for seen, msg, signer, _ in view.pending
            if isinstance(msg, kinds) and signer != view.me and (whenever or now - seen > held_seconds)
            and (since is None or seen > since)]


def needs_resync(view: Any, eligible: frozenset[str], now: float,
                 held_seconds: float = RESYNC_HELD_SECONDS) -> bool:
    """Does the mirror hold a decision of an eligible coordinator that it could not apply for a while?
    Its term does not matter: our view of the term may be the wrong one (we changed it while the
    others did not). Decisions of anyone else, an attacker's included, never trigger a rebuild."""
    return any(signer in eligible for _, _, signer in _held(view, DECISIONS, now, held_seconds))


def holds_decisions(view: Any, eligible: frozenset[str]) -> bool:
    """Does the mirror hold a decision of an eligible coordinator, however briefly and whenever since (the
    submitter, once it caught up: what it still holds then no message it lacks will apply)? Nobody else's
    decisions count, our own never, nothing once the job ended."""
    return any(signer in eligible for _, _, signer in _held(view, DECISIONS, 0.0, 0.0, whenever=True))


def got_further(rebuilt: Any, view: Any) -> bool:
    """Did the mirror rebuilt from another history get further than ours: the job ended, a later round, or more
    of the round's shards accepted?"""
    def progress(v: Any) -> tuple[bool, int, int]:
        return (v.state.terminal, v.state.round, sum(1 for s in v.state.shards if s.phase is ShardPhase.ACCEPTED))
    return progress(rebuilt) > progress(view)


def repair_sources(view: Any, now: float, held_seconds: float = RESYNC_HELD_SECONDS,
                   limit: int = REPAIR_PEERS) -> tuple[str, ...]:
    """The signers of the worker messages the mirror held over ``held_seconds`` (since the last rebuild or
    repair), the longest held first, at most ``limit``: the peers to ask for their history of the job."""
    out: list[str] = []
    for _, _, signer in sorted(_held(view, WORKER_MESSAGES, now, held_seconds), key=lambda h: h[0]):
        if signer not in out:
            out.append(signer)
    return tuple(out[:limit])


def stall_after(terms: Any, stall_seconds: float = STALL_SECONDS) -> float:
    """Seconds with nothing applied after which our own job counts as stalled: ``stall_seconds``, and
    at least two lease times."""
    return max(stall_seconds, 2.0 * float(terms.lease_seconds))


def stalled(view: Any, me: str, now: float, stall_seconds: float = STALL_SECONDS) -> bool:
    """Is this our own job, not ended, with nothing applied for ``stall_seconds`` (and two lease times)? The
    soak found a submitter, killed and restarted twice while coordinators failed over, whose mirror
    lacked the leases that spent a shard's attempts: its peers had ended the job FAILED, nobody acted
    for it any more, and the submitter's mirror said TRAINING forever. A stalled submitter catches up
    from its live peers, as after a restart."""
    return view.terms.submitter == me and not view.state.terminal and \
        now - view.last_applied > stall_after(view.terms, stall_seconds)
