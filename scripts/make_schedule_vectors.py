"""Write ipips/vectors/round-schedule.json (IPIP-0006 §2.5, protocol/schedule.py): every round's inner learning rate,
the factor on it at each step of a round, each round's steps and where each round's step 0 is in a shard's sample
stream. A worker and its verifiers must compute the same values, or replays fail. Reviewed by hand; run from the
repository root."""
import json
import sys

sys.path.insert(0, ".")
from protocol import schedule  # noqa: E402

rates = [
    {"base": 0.01, "rounds": 6, "schedule": s, "warmup_rounds": w,
     "rates": [schedule.round_learning_rate(0.01, r, 6, schedule=s, warmup_rounds=w) for r in range(1, 7)]}
    for s, w in (("constant", 0), ("cosine", 0), ("cosine", 2))
]
factors = [
    {"inner_schedule": rule, "steps": steps, "factors": [schedule.inner_rate_factor(rule, s, steps) for s in range(steps)]}
    for rule, steps in (("constant", 4), ("triangle", 1), ("triangle", 12), ("triangle", 25))
]
lengths = [
    {"max_steps": max_steps, "first_round_steps": list(first), "rounds": rounds,
     "round_steps": [schedule.round_steps(max_steps, first, r) for r in range(1, rounds + 1)],
     "stream_offset": [schedule.stream_offset(max_steps, first, r) for r in range(1, rounds + 1)]}
    for max_steps, first, rounds in ((12, (), 4), (100, (25, 25, 50), 6), (10, (4, 6), 4), (8, (1,), 3))
]
doc = {"description": "IPIP-0006 §2.5 (protocol/schedule.py). 'rates': round_learning_rate for rounds 1..rounds. "
                      "'factors': inner_rate_factor at steps 0..steps-1 of a round. 'lengths': for rounds 1..rounds, "
                      "the steps a shard trains (round_steps) and the sample-stream position of the round's step 0 "
                      "(stream_offset; training.first_round_steps, then max_steps a round).",
       "rates": rates, "factors": factors, "lengths": lengths}
with open("ipips/vectors/round-schedule.json", "w") as f:
    json.dump(doc, f, indent=1)
    f.write("\n")
print(json.dumps(lengths))
