"""Writes ipips/vectors/dpo-loss.json and ipips/vectors/preference-records.json (IPIP-0005 §6.2, IPIP-0007
input.format: preference); review the output by eye before committing."""
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.train.preference import PreferenceRecord, check_preference  # noqa: E402

USER = {"role": "user", "content": "What is 2 plus 2?"}
SYSTEM = {"role": "system", "content": "Answer briefly."}
GOOD = {"role": "assistant", "content": "4"}
BAD = {"role": "assistant", "content": "5"}


def loss_cases():
    # (name, policy chosen, policy rejected, reference chosen, reference rejected, beta): summed log-probabilities
    yield "the policy is its reference: log 2", -10.0, -12.0, -10.0, -12.0, 0.1
    yield "chosen raised by 2 nats, beta 0.1", -8.0, -12.0, -10.0, -12.0, 0.1
    yield "rejected raised: a negative margin", -10.0, -9.0, -10.0, -12.0, 0.1
    yield "a large margin, beta 0.5", -5.0, -40.0, -10.0, -12.0, 0.5
    yield "a large negative margin stays finite", -40.0, -5.0, -10.0, -12.0, 1.0


def loss_of(pc, pr, rc, rr, beta):
    margin = beta * ((pc - rc) - (pr - rr))
    loss = math.log1p(math.exp(-margin)) if margin > -30 else -margin + math.log1p(math.exp(margin))
    return loss, margin


def record_cases():
    canonical = {"prompt": [USER], "chosen": [GOOD], "rejected": [BAD], "meta": {}}
    yield "standard: text prompt and completions", {"prompt": USER["content"], "chosen": "4", "rejected": "5"}, canonical
    yield "conversational, explicit prompt", {"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]}, canonical
    yield "implicit prompt: the turns both conversations open with", {"chosen": [USER, GOOD], "rejected": [USER, BAD]}, canonical
    yield "a system turn and meta kept, other keys ignored", {"prompt": [SYSTEM, USER], "chosen": [GOOD], "rejected": [BAD],
                                                             "meta": {"id": 7}, "score_chosen": 9.0}, \
        {"prompt": [SYSTEM, USER], "chosen": [GOOD], "rejected": [BAD], "meta": {"id": 7}}
    yield "implicit prompt where both answers are alike: the prompt stops before the assistant turn", \
        {"chosen": [USER, GOOD], "rejected": [USER, GOOD]}, {"prompt": [USER], "chosen": [GOOD], "rejected": [GOOD], "meta": {}}
    yield "no rejected", {"prompt": "q", "chosen": "a"}, None
    yield "no prompt and text completions", {"chosen": "a", "rejected": "b"}, None
    yield "no shared prompt turn", {"chosen": [GOOD], "rejected": [BAD]}, None
    yield "a prompt ending with an assistant turn", {"prompt": [USER, GOOD], "chosen": [GOOD], "rejected": [BAD]}, None
    yield "a completion starting with a user turn", {"prompt": "q", "chosen": [USER], "rejected": "b"}, None
    yield "a completion without assistant text", {"prompt": "q", "chosen": " ", "rejected": "b"}, None
    yield "an unknown role", {"prompt": "q", "chosen": "a", "rejected": [{"role": "bot", "content": "b"}]}, None


def main() -> None:
    losses = []
    for name, pc, pr, rc, rr, beta in loss_cases():
        loss, margin = loss_of(pc, pr, rc, rr, beta)
        losses.append({"name": name, "policy_chosen": pc, "policy_rejected": pr, "reference_chosen": rc,
                       "reference_rejected": rr, "beta": beta, "loss": loss, "margin": margin})
    Path("ipips/vectors/dpo-loss.json").write_text(json.dumps({
        "description": "IPIP-0005 §6.2: a DPO pair's loss -log sigmoid(m) and reward margin m = beta x ((policy_chosen - "
                       "reference_chosen) - (policy_rejected - reference_rejected)), from summed log-probabilities; "
                       "within 1e-6 relative.", "cases": losses}, indent=1) + "\n")
    records = []
    for name, line, canonical in record_cases():
        if canonical is not None:
            assert PreferenceRecord(1, *check_preference(line)).to_json() == canonical, name
        else:
            try:
                check_preference(line)
            except ValueError:
                pass
            else:
                raise AssertionError(name)
        records.append({"name": name, "line": line, "canonical": canonical})
    Path("ipips/vectors/preference-records.json").write_text(json.dumps({
        "description": "IPIP-0007 input.format preference: a JSON line in a layout TRL reads, and the canonical record "
                       "a shard holds ({prompt, chosen, rejected, meta}, each side a list of messages), or null where "
                       "the line is refused.", "cases": records}, indent=1) + "\n")


if __name__ == "__main__":
    main()
