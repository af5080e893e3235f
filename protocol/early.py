"""Early start (IPIP-0006 §2.9): who is announced which shard of the next round, when a worker takes an
announcement, and where an early start stands.

Rules of this file:
- Pure: the job's state (protocol/state.py), the coordination and the messages in, a decision out. No clock:
  the one timer (a round begun without the announced lease, ``EARLY_LEASE_WAIT``) is the caller's, told by
  the standing ``OPEN``.
- The coordinator announces round r + 1 only when every shard of round r is REPORTED or ACCEPTED and r is
  not the job's last (``ready``); each of round r's workers is announced the first shard it trained in round
  r, one each, never the coordinator itself and never a worker the job's history refuses (``assignment``).
- A named worker that trained more than one shard of round r trains the others after its announced one, from
  the same start, in index order, unless a shard is announced to another worker (``queued``); it claims each once
  the one before it is reported (it holds one lease of a job at a time). Every worker claims the shards that
  round r's other announced workers trained only when no other shard is open (``reserved``).
- A worker takes an announcement only from the job's coordinator in its current term, for the round after
  its mirror's, while that round is VERIFYING or AGGREGATING (``refusal``).
- The announced workers and the job's submitter fetch the announced start together, in the order ``swarm``
  gives (IPIP-0003 §4.2): each takes its share of it from the coordinator and the rest from the others.
- An early start is OURS once round r + 1 holds its lease (its attempt, to us) and round r's published
  aggregate is the start it trained from; it WAITS while round r is still verified or aggregated; OPEN when
  round r + 1 began and its shard is not leased yet; any other state voids it (``standing``).
- A worker whose early start stands OPEN claims its shard again, once per coordination term, while it holds no
  live lease of the job (``reclaim``): at once when the job's
  coordination term is no longer the `early` message's (a coordinator elected since then ignored the claim, which
  was for the round after its mirror's), else after ``EARLY_RECLAIM_AFTER`` seconds OPEN (a claim lost). Once per
  term, not once: a claim sent to a coordinator that dies next is lost with it, and its successor never hears one.
The vectors are ``ipips/vectors/early-start.json`` (scripts/make_early_vectors.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from protocol.leasing import history_refusal
from protocol.messages import EarlyStart, Verdict
from protocol.state import JobPhase, JobState, ShardPhase

EARLY_LEASE_WAIT = 20.0
"""Seconds an early start waits, after its round began, for the lease announced to it (then it is dropped)."""

EARLY_RECLAIM_AFTER = 2.0
"""Seconds an early start stands OPEN, under the coordinator that announced it, before its worker claims again."""

OURS, WAIT, OPEN = "ours", "wait", "open"
_WAITING_PHASES = (JobPhase.VERIFYING, JobPhase.AGGREGATING)


def ready(state: JobState, rounds: int) -> bool:
    """May the coordinator announce round ``state.round + 1`` now (its aggregate-to-be's inputs all in)?"""
    return not state.terminal and state.round < rounds and \
        all(s.phase in (ShardPhase.REPORTED, ShardPhase.ACCEPTED) for s in state.shards)


def assignment(trained: Sequence[tuple[int, str | None]], coordinator: str,
               verdicts: Iterable[Verdict]) -> tuple[tuple[int, str], ...]:
    """The next round's (shard, worker) pairs to announce, from round r's (shard, worker) pairs: each worker its
    first shard, once; not the coordinator; not a worker the job's history refuses (protocol/leasing.py)."""
    verdicts = tuple(verdicts)
    out, named = [], set()
    for index, worker in sorted(trained):
        if worker and worker != coordinator and worker not in named and \
                history_refusal(worker, coordinator, verdicts, ()) is None:
            out.append((index, worker))
            named.add(worker)
    return tuple(out)


def queued(trained: Sequence[tuple[int, str | None]], early: EarlyStart, worker: str) -> tuple[int, ...]:
    """The shards of round ``early.round`` that ``worker`` trains early after its announced one, in this order, from
    the same start: the other shards it trained in round r (``trained``: round r's (shard, worker) pairs), none
    announced to another worker. Empty for a worker the message does not name."""
    if worker not in early.workers:
        return ()
    return tuple(sorted(index for index, who in trained if who == worker and index not in early.shards))


def reserved(trained: Sequence[tuple[int, str | None]], early: EarlyStart, worker: str) -> frozenset[int]:
    """The shards of round ``early.round`` that ``worker`` claims only when no other shard is open: each one announced
    to another worker, or queued by one (``queued``: round r's shards of another worker the message names)."""
    others = {who for who in early.workers if who != worker}
    return frozenset({index for index, who in zip(early.shards, early.workers) if who != worker} |
                     {index for index, who in trained if who in others})


def claimable(open_shards: Sequence[int], reserved_shards: frozenset[int]) -> list[int]:
    """The open shards a worker picks its claim from: those not reserved for another worker, else all of them."""
    free = [index for index in open_shards if index not in reserved_shards]
    return free or list(open_shards)


def refusal(early: EarlyStart, signer: str, coordinator: str | None, term: int, state: JobState,
            rounds: int) -> str | None:
    """Why a worker does not take this announcement (None: it may)."""
    if signer != coordinator or early.term != term:
        return "not from the job's coordinator in its current term"
    if early.round != state.round + 1 or early.round > rounds:
        return f"for round {early.round}, not the round after {state.round}"
    if state.phase not in _WAITING_PHASES:
        return f"the job is {state.phase.value}, not verifying or aggregating"
    if any(index >= len(state.shards) for index in early.shards):
        return "it names a shard the job does not have"
    return None


def swarm(early: EarlyStart, submitter: str) -> tuple[str, ...]:
    """The peers that fetch an announced start together (IPIP-0003 §4.2), in the order all of them use: the
    announced workers, then the job's submitter, which copies every aggregate (IPIP-0006 §2.6.1)."""
    return tuple(dict.fromkeys((*early.workers, submitter)))


def standing(state: JobState, published_cid: str | None, rnd: int, shard: int, attempt: int, worker: str,
             start_cid: str | None) -> str:
    """Where an early start of (``rnd``, ``shard``, ``attempt``) by ``worker`` from ``start_cid`` stands: OURS,
    WAIT, OPEN, or the reason it is void. ``published_cid``: round ``rnd - 1``'s published aggregate, if any."""
    if state.terminal:
        return f"the job ended {state.phase.value}"
    if state.round < rnd:
        if state.phase in _WAITING_PHASES:
            return WAIT
        # a report of the round before was rejected and its shard reopened: its aggregate will not be the one
        # announced, and that shard needs a worker now
        return f"round {state.round} is training again ({state.phase.value})"
    if state.round > rnd:
        return f"the job is in round {state.round}"
    if published_cid is None or published_cid != start_cid:
        return f"round {rnd - 1}'s aggregate is not the one announced"
    current = state.shards[shard]
    if current.phase is ShardPhase.LEASED and (current.attempt, current.worker) == (attempt, worker):
        return OURS
    if current.phase is ShardPhase.OPEN and current.attempt == 0:
        return OPEN
    return f"shard {shard} went to another lease (attempt {current.attempt})"


def reclaim(open_for: float, early_term: int, term: int, holding: bool = False) -> bool:
    """Does a worker whose early start has stood OPEN for ``open_for`` seconds claim its shard again now (once per
    coordination term: the worker keeps which terms it claimed in)?
    ``early_term``: the term of the `early` message it took; ``term``: the job's coordination term now. A claim
    sent with an early start is for the round after the coordinator's, and a peer that is not the coordinator
    yet keeps no such claim (it is no lease request): a coordinator elected since then never heard one.
    ``holding``: the worker holds a live lease of the job, which makes a coordinator refuse its claim: not now (a
    queued start's claim follows the report of the lease it holds)."""
    return not holding and (term != early_term or open_for >= EARLY_RECLAIM_AFTER)
