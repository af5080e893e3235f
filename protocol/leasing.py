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
"""

from __future__ import annotations

from collections.abc import Iterable

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
