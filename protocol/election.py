"""Coordinator election: rendezvous hashing of the job ID over the live eligible peers, with terms.

Everything that decides who coordinates a job lives here. This file does not know who runs it: a
peer feeds it its own view (which peers are live and eligible, what coordinator messages it saw)
and gets back who the coordinator is and in which term. Pure: no I/O, no clock (``now`` is passed
in), immutable values.

Rules of this file:

- Score. ``score(peer, job) = sha256(b"infernet/election/v1\\x00" + job_id + peer_id_bytes)`` read
  as a big-endian unsigned integer. ``job_id`` is the 32-byte job digest; ``peer_id_bytes`` is the
  binary peer ID (the identity multihash of the protobuf public key, 38 bytes for Ed25519; its
  base58btc text is the ``12D3KooW...`` string).
- Rank. Peers sorted by score, highest first (ties, which need a sha256 collision, go to the
  smaller peer ID bytes). The coordinator of a job is the first of the ranking among the *eligible
  live* peers: peers that advertised they can coordinate, minus those silent for
  ``MISSED_HEARTBEATS`` heartbeat intervals. Rendezvous hashing means that removing a peer moves only
  the jobs it coordinated (each to its runner-up), and adding one moves only the jobs it now wins.
- Terms. A peer's view of a job is (term, coordinator). Term 0 has no coordinator. Whenever the
  view's winner changes (the coordinator fell silent, a higher-ranked peer appeared), the term goes
  up by exactly 1. Every coordinator message (lease, verdict, aggregate) carries the term it was
  sent in, and is checked against the view:
    * term < view term: stale (an old or deposed coordinator), ignored;
    * term = view term: accepted only from the view's coordinator;
    * term > view term: the receiver's view is behind; it adopts (term, signer) if the signer is an
      eligible live peer in its view, else ignores the message. A coordinator that adopts a higher
      term held by another peer has been deposed and steps down.
  Terms therefore never decrease. Peers with the same live view compute the same coordinator;
  while views differ, terms may climb until they agree, which is safe because a stale term never
  passes.
- Eligibility. A peer is eligible for a job when its latest signed ``cap`` says ``can_coordinate``
  and the capability can replay the job's segments (protocol/fit.replay_refusals: it holds the base
  model by hash, and a CUDA GPU large enough when the job needs one): a coordinator that cannot
  verify a report must never be elected for that job (``eligible_for_job``).
- Judging. A coordinator never judges its own work. A report by the job's coordinator (it held
  a lease from the previous term when it took over) is judged by the *judge*: the first of the
  ranking over the eligible live peers without the coordinator (``judge_of``). Its verdict carries
  the coordinator's term and is accepted in that term from any eligible live peer other than the
  worker it judges (``may_judge``: views of who is live may briefly differ, and the state machine
  takes only the first verdict of an attempt); a verdict signed by the worker it judges never is.
  So a verdict never moves a view to a higher term (``check_message(adopt=False)``): its signer
  may be the judge, not the coordinator; it waits until a lease, an aggregate or the coordinator's
  heartbeat brings the view to its term. Replayed history (a restart, a resync) does adopt a verdict's
  higher term, provisionally, as its signer's; the two peers of that verdict settle it by deciding
  again in the term (``settle_replayed_term``).
- Earlier terms (rule 7). A view remembers who coordinated each term it held (``past``). A verdict
  of an earlier term ``t`` is not stale when it judges an attempt leased in term ``t`` or before
  and comes from the peer that coordinated ``t`` in this view (or judged that coordinator's own
  report), or, for a term this view skipped (it moved from below ``t`` to above it in one step,
  so it never learned ``t``'s coordinator), from an eligible live peer: ``may_apply_past_verdict``.
  It never moves the view; the state machine applies it only if that attempt is still the one
  waiting for a verdict (a later term's decision about the shard makes it stale there).
- A submitter catching up (rule 9). The history its view's coordinator serves may hold decisions of
  earlier terms by a coordinator that is gone (dead, so not live, so refused by the rules above): the
  submitter takes them as that coordinator vouches for them, whoever signed them and whatever its own
  view recorded for their term: ``may_apply_vouched_past``. Never moves the view.
- A coordinator that does not claim its term (rule 10). A live peer that coordinates a job says so in
  every heartbeat (its terms). A view whose coordinator is eligible and live but has not claimed the
  view's term (or a later one) for ``UNCLAIMED_FACTOR`` x ``MISSED_HEARTBEATS`` heartbeat intervals since
  the view named it deposes it: the next term goes to the first by rank of the other eligible live peers
  (``depose_unclaimed``). Two views can otherwise name each other's peer and wait for good: a soak saw a
  coordinator whose rebuild from the submitter's older history took it back to term 1 (naming a live
  peer), while everyone else had followed it into term 3; both peers were live, neither acted, and the
  job stood in round 2 until its deadline.
- One coordinator, two numbers (rule 11). Term numbers are each view's own count of view changes, so two
  views can name the same live coordinator under different numbers: one counted the death of a coordinator
  the other never elected. A coordinator message of a term below the view's is not stale when its signer is
  the view's own coordinator and that term is the one it claims in its latest heartbeat (heard within the silence
  window; protocol/mirror.py keeps the claims): it is that
  coordinator's current tenure, counted lower there (``check_message``'s ``claimed``; ``may_judge`` likewise
  for its judge). It never moves the view. For rule 10 such a claim counts: the coordinator acts. Without
  it, the view refused every decision of its own coordinator, deposed it by rule 10, and the two mirrors
  then differed on the leases of that term (the scenario successor-same-term: 30 s of one lease lost).
- Errors. A malformed job ID or peer ID, a stale or conflicting term: ``StateError``, nothing else.

The document is ``ipips/0006-election-aggregation.md``; ``ipips/vectors/election-*.json`` are
checked by the tests.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from protocol.errors import KeyFileError, StateError
from protocol.identity import peer_id_bytes, public_key_from_peer_id

ELECTION_DOMAIN = b"infernet/election/v1\x00"
JOB_ID_LEN = 32
HEARTBEAT_SECONDS = 10.0
"""How often a live peer gossips a Heartbeat."""
MISSED_HEARTBEATS = 3
"""A peer silent for this many heartbeat intervals is no longer live."""
SILENCE_SECONDS = MISSED_HEARTBEATS * HEARTBEAT_SECONDS
"""The protocol's silence window; rule 11 counts a coordinator's heartbeat claim of a term this long."""
UNCLAIMED_FACTOR = 8
"""Rule 10: a live coordinator that has not claimed its term for this many silence windows (heartbeat
intervals x MISSED_HEARTBEATS) is deposed: long enough for a just-elected peer to form its own view and catch up
(the agent's: 40 s at its 5 s silence, covering a job's grace, the first view's wait for capabilities and a 30 s
catch-up; it was 3, 15 s, and a term-1 coordinator still catching up under load was deposed while it was about
to act: two coordinators, leases refused on one side, round 1 of coordinator-crash-aggregate 60 s longer)."""
PAST_TERMS_KEPT = 64
"""Earlier terms a view remembers the coordinator of (rule 7); verdicts of older ones are refused."""


def _peer_id_binary(peer_id: str) -> bytes:
    """The binary peer ID behind a ``12D3KooW...`` string."""
    if not isinstance(peer_id, str):
        raise StateError(f"peer ID must be a string, got {type(peer_id).__name__}")
    return _decode_peer_id(peer_id)


@functools.lru_cache(maxsize=4096)  # a ranking decodes every peer once per job
def _decode_peer_id(peer_id: str) -> bytes:
    try:
        return peer_id_bytes(public_key_from_peer_id(peer_id))
    except KeyFileError as exc:
        raise StateError(f"election: {exc}") from None


def _check_job_id(job_id: bytes) -> None:
    if not isinstance(job_id, bytes) or len(job_id) != JOB_ID_LEN:
        raise StateError(f"job ID must be {JOB_ID_LEN} bytes, got {job_id!r:.80}")


def election_score(job_id: bytes, peer_id: str) -> int:
    """The peer's rendezvous score for the job: sha256 of domain, job ID and binary peer ID."""
    _check_job_id(job_id)
    digest = hashlib.sha256(ELECTION_DOMAIN + job_id + _peer_id_binary(peer_id)).digest()
    return int.from_bytes(digest, "big")


def rank_peers(job_id: bytes, peers: Iterable[str]) -> tuple[str, ...]:
    """The peers in election order for the job: highest score first, each peer once."""
    _check_job_id(job_id)
    unique = set(peers)
    return tuple(sorted(unique, key=lambda p: (-election_score(job_id, p), _peer_id_binary(p))))


def elect(job_id: bytes, live: Iterable[str]) -> str | None:
    """The coordinator among the eligible live peers, or None when there is none."""
    ranking = rank_peers(job_id, live)
    return ranking[0] if ranking else None


def eligible_for_job(live: Iterable[str], capabilities: Mapping[str, object], terms: object) -> frozenset[str]:
    """The live peers that may coordinate the job: their capability (``protocol.messages.Capability``,
    None when not heard yet) says ``can_coordinate`` and can replay the job (protocol/fit.py)."""
    from protocol.fit import replay_refusals

    out = set()
    for peer in live:
        cap = capabilities.get(peer)
        if cap is not None and cap.can_coordinate and not replay_refusals(cap, terms):
            out.add(peer)
    return frozenset(out)


def live_peers(
    last_heartbeat: Mapping[str, float],
    now: float,
    heartbeat_seconds: float = HEARTBEAT_SECONDS,
    missed_heartbeats: int = MISSED_HEARTBEATS,
) -> frozenset[str]:
    """Peers heard from within the last ``missed_heartbeats`` heartbeat intervals."""
    silence = missed_heartbeats * heartbeat_seconds
    return frozenset(peer for peer, seen in last_heartbeat.items() if now - seen < silence)


def hears_submitter(
    submitter: str,
    me: str,
    last_heartbeat: Mapping[str, float],
    live_since: Mapping[str, float],
    now: float,
    *,
    settled: bool,
    heartbeat_seconds: float = HEARTBEAT_SECONDS,
    missed_heartbeats: int = MISSED_HEARTBEATS,
) -> bool:
    """The submitter's side decides (IPIP-0006 §1.3 rule 5): may a peer act as a job's coordinator
    (``settled=False``: the submitter is live to it, or it is the submitter), or change its election
    view of the job (``settled=True``: it has also heard the submitter for ``missed_heartbeats``
    intervals since it was last silent, so the other peers' heartbeats have had time to come back)?

    The submitter always may act, but changes its view only once it has heard other peers for
    ``missed_heartbeats`` intervals without a break (``live_since[me]``: since when; absent: it hears
    nobody): a restarted (or isolated) submitter first hears its peers and learns the job's state
    from them, so it never deposes a live coordinator it has not heard yet."""
    window = missed_heartbeats * heartbeat_seconds
    if submitter == me:
        since = live_since.get(me)
        return not settled or (since is not None and now - since >= window)
    seen = last_heartbeat.get(submitter)
    if seen is None or now - seen >= window:
        return False
    return not settled or now - live_since.get(submitter, now) >= window


@dataclass(frozen=True)
class Coordination:
    """One peer's view of who coordinates a job, and in which term."""

    job_id: bytes
    term: int = 0
    coordinator: str | None = None
    past: tuple[tuple[int, str | None], ...] = ()  # (term, coordinator) of every earlier term this view held

    def __post_init__(self) -> None:
        _check_job_id(self.job_id)

    def _moved(self, term: int, coordinator: str | None) -> Coordination:
        past = self.past + ((self.term, self.coordinator),) if self.term >= 1 else self.past
        return replace(self, term=term, coordinator=coordinator, past=past[-PAST_TERMS_KEPT:])

    def coordinator_of(self, term: int) -> tuple[bool, str | None]:
        """(known, coordinator) of ``term`` in this view: known is False for a term it never held."""
        if term == self.term:
            return True, self.coordinator
        for held, coordinator in self.past:
            if held == term:
                return True, coordinator
        return False, None

    def follow_view(self, live: Iterable[str]) -> Coordination:
        """Re-elect over the eligible live peers; a new winner starts the next term."""
        winner = elect(self.job_id, live)
        if winner == self.coordinator:
            return self
        return self._moved(self.term + 1, winner)

    def check_message(self, signer: str, term: int, live: Iterable[str], *, adopt: bool = True,
                      claimed: int | None = None) -> Coordination:
        """The view after a coordinator message signed by ``signer`` in ``term``; StateError if it is
        stale or not from the term's coordinator (the message must then be ignored). In the view's own
        term, an eligible live signer that ranks before the view's coordinator becomes it (rule 8: two
        peers claimed one term; not for ``adopt=False``). ``adopt=False``
        (verdicts: a judge signs them too, rule 6) never moves the view to a higher term: StateError,
        and the message waits until the view reaches its term. ``claimed``: the term ``signer`` claims in
        its latest heartbeat (None: none heard); a lower term than the view's, from the view's own
        coordinator, passes when it is that one (rule 11: the coordinator counts its tenure lower)."""
        if isinstance(term, bool) or not isinstance(term, int) or term < 1:
            raise StateError(f"coordinator term must be an integer >= 1, got {term!r}")
        _peer_id_binary(signer)
        if term < self.term:
            if signer == self.coordinator and claimed == term:
                return self  # our coordinator's current tenure, which its own view numbers lower (rule 11)
            raise StateError(f"stale term {term}: the job is in term {self.term} (coordinator {self.coordinator})")
        if term == self.term:
            if signer == self.coordinator:
                return self
            if adopt and self.coordinator is not None and signer in set(live) and \
                    rank_peers(self.job_id, (signer, self.coordinator))[0] == signer:
                # two peers claim one term (each elected itself while it lacked the other's capability):
                # the first of the two by rank coordinates it, in every view (IPIP-0006 §1.3 rule 8)
                return replace(self, coordinator=signer)
            raise StateError(f"term {term} belongs to {self.coordinator}, not {signer}")
        if not adopt:
            raise StateError(f"term {term} is ahead of our view (term {self.term}); a verdict does not move "
                             "the view (its signer may be the term's judge, not its coordinator)")
        if signer not in set(live):
            raise StateError(f"term {term} claimed by {signer}, which is not an eligible live peer")
        return self._moved(term, signer)

    def is_coordinator(self, peer_id: str) -> bool:
        return self.coordinator is not None and self.coordinator == peer_id


def judge_of(job_id: bytes, coordinator: str | None, worker: str, eligible: Iterable[str]) -> str | None:
    """Who judges ``worker``'s report: the coordinator, unless it is the worker; then the first of the
    ranking over the eligible live peers without the worker (None when there is no other)."""
    if coordinator is not None and coordinator != worker:
        return coordinator
    ranking = rank_peers(job_id, set(eligible) - {worker})
    return ranking[0] if ranking else None


def may_judge(view: Coordination, signer: str, worker: str, term: int, eligible: Iterable[str],
              claimed: int | None = None) -> bool:
    """May a verdict on ``worker``'s report, signed by ``signer`` in ``term``, be applied? Only for a
    report by the view's coordinator (other verdicts follow ``check_message``): in the view's term (or the
    term the coordinator ``claimed`` in its latest heartbeat, which its view may number lower: rule 11),
    from an eligible live peer that is not the worker. Never one signed by the worker it judges."""
    return (signer != worker and view.coordinator is not None and worker == view.coordinator
            and (term == view.term or (claimed is not None and term == claimed <= view.term))
            and signer in set(eligible))


def settle_replayed_term(job_id: bytes, first: str, judged: str, signer: str, worker: str | None) -> str | None:
    """Who coordinates a term that a replayed history opened with a verdict of ``first`` on ``judged``'s
    report (replay believes a verdict's higher term, but its signer may be the term's judge), once
    ``signer`` decides in that term (``worker``: the worker its decision is a verdict on, None for a
    lease or an aggregate)? None while the decision tells nothing (``first`` judging ``judged`` again,
    or a third peer, whose decision the term rules then refuse).
    - ``first`` decides what a judge does not (a lease, an aggregate, a verdict on another worker):
      ``first`` coordinates the term;
    - ``judged`` decides in the term: ``judged`` coordinates it (a judge judges only the coordinator's
      own report), unless its decision is a verdict on ``first``'s report -- either could have signed
      both verdicts: then the one that ranks first for the job does, as the judge is the first of the
      ranking *after* the coordinator (``judge_of``)."""
    if signer == first:
        return None if worker == judged else first
    if signer != judged:
        return None
    return rank_peers(job_id, {first, judged})[0] if worker == first else judged


def may_apply_past_verdict(view: Coordination, signer: str, worker: str, term: int, lease_term: int | None,
                           eligible: Iterable[str], claimed: int | None = None) -> bool:
    """May a verdict of an earlier term than the view's be applied (rule 7)? It judges ``worker``'s
    attempt, leased in ``lease_term`` (None: the lease is not known here). Only when the verdict's
    term is not older than that lease, it is not signed by the worker it judges, and its signer
    coordinated that term in this view, or judged the report of that term's coordinator, or the view
    skipped that term (never held it) and the signer is an eligible live peer; or the signer is the view's
    coordinator and ``term`` the one it ``claimed`` in its latest heartbeat (rule 11: its current tenure, numbered
    lower in its own view). It never moves the view; the state machine still refuses it unless that attempt is the
    one waiting for a verdict."""
    if isinstance(term, bool) or not isinstance(term, int) or not 1 <= term < view.term or signer == worker:
        return False
    if lease_term is not None and term < lease_term:
        return False  # a coordinator of an earlier term never saw this attempt's lease
    if signer == view.coordinator and claimed == term:
        return True  # rule 11
    known, coordinator = view.coordinator_of(term)
    if known:
        return signer == coordinator or (coordinator is not None and worker == coordinator and signer in set(eligible))
    if len(view.past) >= PAST_TERMS_KEPT and term < view.past[0][0]:
        return False  # older than what the view remembers: forgotten, not skipped
    return signer in set(eligible)  # a term the view skipped: nobody told it who held it


def may_apply_vouched_past(view: Coordination, signer: str, term: int, worker: str | None = None,
                           lease_term: int | None = None) -> bool:
    """May a decision of an earlier term than the view's (a lease, an aggregate; a verdict on ``worker``'s
    attempt, leased in ``lease_term``) be applied from the history of the view's own coordinator, as a
    submitter catching up receives it (rule 9)? Yes, whoever signed it, live or gone, and whoever this
    view recorded for that term: the coordinator vouching for it decides the job's current term anyway,
    and a restarted submitter's record of an earlier term may be a view of its own (it elected a term-1
    coordinator over the peers it heard, while the others' term 1 was a peer that had died). A verdict
    keeps rule 7's checks (not signed by its worker, not of a term before its attempt's lease), and the
    coordinator never vouches for a verdict on its own work. It never moves the view."""
    if isinstance(term, bool) or not isinstance(term, int) or not 1 <= term < view.term:
        return False
    if worker is not None and (signer == worker or worker == view.coordinator or
                               (lease_term is not None and term < lease_term)):
        return False  # (nor does the coordinator vouch for a verdict on its own work)
    return True


def stepped_down(before: Coordination, after: Coordination, me: str) -> bool:
    """True when ``me`` coordinated in ``before`` and no longer does in ``after``."""
    return before.is_coordinator(me) and not after.is_coordinator(me)


def depose_unclaimed(view: Coordination, eligible: Iterable[str], me: str, named_at: float,
                     claimed_at: float | None, now: float,
                     window: float = UNCLAIMED_FACTOR * SILENCE_SECONDS) -> Coordination:
    """Rule 10: the view after its coordinator failed to claim the view's term for ``window`` seconds.
    ``named_at``: when this view named it (in this term); ``claimed_at``: when it last claimed this term or a
    later one (its heartbeats), None if never. A coordinator that is us, or not eligible and live (that is
    ``keep_or_elect``'s), or the only eligible live peer, stays; else the first by rank of the others takes the
    next term."""
    eligible = frozenset(eligible)
    coordinator = view.coordinator
    if coordinator is None or coordinator == me or coordinator not in eligible:
        return view
    if now - max(named_at, claimed_at if claimed_at is not None else named_at) < window:
        return view
    others = eligible - {coordinator}
    if not others:
        return view
    return view._moved(view.term + 1, elect(view.job_id, others))


def keep_or_elect(view: Coordination, eligible: Iterable[str]) -> Coordination:
    """The view after a liveness update: the coordinator stays while it is eligible and live;
    only when it is not does the next peer by rank take over (term + 1).

    Agents use this rather than ``follow_view`` once a job has a coordinator, so that a peer
    joining (or a view that briefly differs) never moves a running job: terms change only when a
    coordinator falls silent. A job's first view is formed ``grace`` seconds after the job is first
    seen (ipips/0006 §1.3), so peers whose views converged agree on term 1.
    """
    eligible = frozenset(eligible)
    if view.coordinator is not None and view.coordinator in eligible:
        return view
    return view.follow_view(eligible)
