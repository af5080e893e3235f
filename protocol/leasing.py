"""Who may be leased a shard, read off the job's signed history alone (IPIP-0004 §5.1, rule 0).

Rules of this file:
- Pure: the job's verdicts (signed messages every follower of the job holds, of every term) and its
  shards' states (the state machine, driven by those messages) in, a refusal or None out. No memory
  of what this peer decided: a successor coordinator, its view rebuilt from the same history,
  refuses exactly what its predecessor refused (IPIP-0004: "every input is read off signed messages
  every follower of the job holds"). Before this rule lived here, the ban on a rejected worker was a
  set in the coordinator's memory, filled only by its own verdicts, and a successor leased a shard to
  a worker its predecessor had rejected (issue 23).
- The history rules, in order, each with its own reason:
  1. to the coordinator itself only when another peer judges its report (``judge``: protocol/election
     ``judge_of`` over the job's eligible peers names one): a coordinator never judges its own work,
     but with a judge it trains like any worker (issue 24: one machine of W no longer idles);
  2. never to a worker a verdict of this job rejected, in any round or term (a rejection is always the
     worker's fault, IPIP-0005 §8: our own failures give no verdict);
  3. never a second live lease of the job to one worker (a shard it reported and that awaits its
     verdict does not count: it trains the next one meanwhile).
- The claimant's capability (protocol/fit.py) and the market (protocol/market.py) are checked after.
- ``silent_holders``: whose lease the coordinator ends because it no longer hears the holder (IPIP-0004 §5.3).
  Read off what the coordinator hears (heartbeats: no signed history says a peer is silent), so it is
  the coordinator's decision, signed (``revoke``), applied by every mirror like a lease.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from protocol.messages import Verdict
from protocol.state import ShardPhase, ShardState


def history_refusal(worker: str, coordinator: str | None, verdicts: Iterable[Verdict],
                    shards: Iterable[ShardState], judge: str | None = None) -> str | None:
    """Why the job's history forbids a lease to ``worker`` (None: it does not). ``shards``: the current
    round's shard states; ``judge``: who would judge the coordinator's own report (judge_of), if anyone."""
    if worker == coordinator and (judge is None or judge == coordinator):
        return "a coordinator leases to itself only when another peer judges its report (there is none)"
    for v in verdicts:
        if v.worker == worker and not v.accepted:
            return (f"its work in this job was rejected (round {v.round}, shard {v.shard}, attempt {v.attempt}, "
                    f"term {v.term}): {v.reason[:200]}")
    for shard in shards:
        if shard.worker == worker and shard.phase is ShardPhase.LEASED:
            return f"it holds a live lease of this job (shard {shard.index})"
    return None


def silent_seconds(setting: float, silence: float) -> float:
    """The silence after which a coordinator revokes a holder's lease (IPIP-0004 §5.3): its ``setting``
    (the agent's ``silent_holder_seconds``; 0: never), at least twice the heartbeat ``silence`` after which a
    peer is not live (a coordinator is itself replaced after one)."""
    return max(setting, 2 * silence) if setting > 0 else 0.0


def silent_holders(shards: Iterable[ShardState], coordinator: str, heard: Mapping[str, float], now: float,
                   lease_seconds: float, silent_seconds: float, silence: float,
                   hearing_since: float | None) -> list[tuple[int, float]]:
    """The LEASED shards whose lease the coordinator ends now (IPIP-0004 §5.3), as (shard, seconds silent).

    ``heard``: when we last heard each peer's heartbeat; ``silence``: the heartbeat silence after which a peer
    is not live (heartbeat_seconds x missed_heartbeats); ``hearing_since``: since when we have heard other peers
    without a break (None: we hear nobody). A holder is silent when neither its heartbeat nor its job's
    last sign of life (the lease, or its last checkpoint: ``expires_at - lease_seconds``) came in the last
    ``silent_seconds``. Revoked only while we have heard peers for ``silent_seconds`` and another peer is live
    to us now: a coordinator that restarted, was cut off or whose own loop stalled hears nobody, and ends no
    lease. Never our own lease (``coordinator``), and nothing when ``silent_seconds`` is 0 (off)."""
    if silent_seconds <= 0 or hearing_since is None or now - hearing_since < silent_seconds:
        return []
    out: list[tuple[int, float]] = []
    for shard in shards:
        if shard.phase is not ShardPhase.LEASED or shard.worker is None or shard.worker == coordinator:
            continue
        if not any(now - t < silence for peer, t in heard.items() if peer not in (shard.worker, coordinator)):
            continue  # we hear nobody else either: the silence may be ours
        last = heard.get(shard.worker, -math.inf)
        if shard.expires_at is not None:
            last = max(last, shard.expires_at - lease_seconds)
        if now - last >= silent_seconds:
            out.append((shard.index, now - last if math.isfinite(last) else silent_seconds))
    return out
