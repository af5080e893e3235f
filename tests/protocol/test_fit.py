"""protocol/fit.py: a declared capability against a job's terms; each unmet requirement its own reason."""

from dataclasses import replace

import pytest

from protocol import messages as m
from protocol.fit import replay_refusals, training_refusals
from protocol.identity import Identity
from scripts.make_envelope_vectors import sample_capability, sample_terms

TERMS = sample_terms(Identity(bytes([1]) * 32))
MODEL = m.ModelHeld("tiny-qwen2", TERMS.base_model_sha256)
CPU = replace(sample_capability(), hardware=m.Hardware("cpu", "x86", 0.0, 8.0, 2), backends=("peft",),
              devices=(), models=(MODEL,))


def gpu(free: float, total: float = 80.0, *, backends=("peft", "unsloth")) -> m.Capability:
    device = m.Device("cuda", 0, "NVIDIA H100", total, free, "9.0", True)
    return replace(CPU, devices=(device,), backends=backends)


def test_a_cpu_peer_fits_a_cpu_peft_job():
    assert training_refusals(CPU, TERMS) == []
    assert replay_refusals(CPU, TERMS) == []


def test_vram_is_refused_on_a_cpu_only_peer_with_its_own_reason():
    reasons = training_refusals(CPU, replace(TERMS, min_vram_gb=16.0))
    assert reasons == ["job needs 16 GB of VRAM; this agent has no GPU"]


def test_free_vram_below_the_minimum_on_every_device_is_refused():
    job = replace(TERMS, min_vram_gb=40.0)
    assert training_refusals(gpu(free=60.0), job) == []
    [reason] = training_refusals(gpu(free=30.0), job)
    assert "40 GB of free VRAM on one GPU; the most free here is 30.0 GB (cuda:0 NVIDIA H100)" in reason
    # two devices of 30 GB free do not add up to 40: training runs on one device
    two = replace(gpu(free=30.0), devices=gpu(free=30.0).devices + (replace(gpu(30.0).devices[0], index=1),))
    assert len(training_refusals(two, job)) == 1


def test_unsloth_without_cuda_is_one_clear_reason():
    assert training_refusals(CPU, replace(TERMS, runtime="unsloth")) == [
        "runtime unsloth needs a CUDA GPU; this agent has none"]


def test_unsloth_on_a_gpu_without_unsloth_installed():
    [reason] = training_refusals(gpu(free=60.0, backends=("peft",)), replace(TERMS, runtime="unsloth"))
    assert reason == "runtime unsloth is not offered here (offers: peft)"
    assert training_refusals(gpu(free=60.0), replace(TERMS, runtime="unsloth")) == []


def test_a_model_not_held_by_hash_is_refused_even_under_the_same_name():
    other = replace(CPU, models=(m.ModelHeld("tiny-qwen2", bytes(32)),))
    [reason] = training_refusals(other, TERMS)
    assert reason.startswith("base model 'tiny-qwen2' (sha256 000102030405") and "not among the models" in reason


def test_every_unmet_requirement_is_listed():
    job = replace(TERMS, runtime="unsloth", min_vram_gb=8.0)
    reasons = training_refusals(replace(CPU, models=()), job)
    assert len(reasons) == 3 and "unsloth" in reasons[0] and "base model" in reasons[1] and "8 GB" in reasons[2]


@pytest.mark.parametrize("job, peer, ok", [
    (replace(TERMS, min_vram_gb=40.0), gpu(free=1.0, total=80.0), True),  # total, not free: a busy GPU still verifies
    (replace(TERMS, min_vram_gb=40.0), gpu(free=20.0, total=24.0), False),
    (replace(TERMS, min_vram_gb=40.0), CPU, False),
    (replace(TERMS, runtime="unsloth"), CPU, False),
    (replace(TERMS, runtime="unsloth"), gpu(free=10.0, backends=("peft",)), False),  # peft drifts past tolerance
    (replace(TERMS, runtime="unsloth"), gpu(free=10.0), True),
    (TERMS, replace(CPU, models=()), False),
])
def test_replay_needs_the_model_and_for_gpu_jobs_a_large_enough_gpu(job, peer, ok):
    assert (replay_refusals(peer, job) == []) is ok


def test_an_unsloth_job_s_verifier_must_offer_unsloth():
    [reason] = replay_refusals(gpu(free=10.0, backends=("peft",)), replace(TERMS, runtime="unsloth"))
    assert reason == ("replaying this job needs runtime unsloth (peft's kernels drift from it past the tolerance); "
                      "this agent offers peft")


def test_lease_vectors():
    """ipips/vectors/fit-lease.json (IPIP-0004 §5.1): whether a coordinator may lease to a claimant."""
    import json
    from pathlib import Path

    from protocol.fit import lease_refusals
    from scripts.make_fit_vectors import capability, terms

    doc = json.loads((Path(__file__).resolve().parents[2] / "ipips/vectors/fit-lease.json").read_text())
    assert len(doc["cases"]) >= 10 and {c["grant"] for c in doc["cases"]} == {True, False}
    for case in doc["cases"]:
        reasons = lease_refusals(capability(case["peer"]) if case["peer"] is not None else None, terms(case["job"]))
        assert (not reasons, len(reasons)) == (case["grant"], case["refusals"]), case["name"]


def test_a_lease_reads_total_vram_where_the_worker_itself_reads_free():
    from protocol.fit import lease_refusals

    job = replace(TERMS, min_vram_gb=40.0)
    busy = gpu(free=10.0, total=80.0)  # its capability was signed while it still trained its last shard
    assert lease_refusals(busy, job) == [] and len(training_refusals(busy, job)) == 1
    assert lease_refusals(gpu(free=24.0, total=24.0), job) == [
        "job needs 40 GB of VRAM on one GPU; the largest here has 24.0 GB (cuda:0 NVIDIA H100)"]
    assert lease_refusals(replace(CPU, accepts_training=False), TERMS) == ["its capability says it does not accept training"]
    assert lease_refusals(None, TERMS) == ["no signed capability has been heard from this peer"]


def test_lease_history_vectors():
    """ipips/vectors/lease-history.json (IPIP-0004 §5.1 rule 0): who the job's signed history forbids a lease
    to, whichever peer coordinates (issue 23: a successor leased to a worker rejected in the term before)."""
    import json
    from pathlib import Path

    from protocol.leasing import history_refusal
    from protocol.messages import Verdict
    from protocol.state import ShardPhase, ShardState

    doc = json.loads((Path(__file__).resolve().parents[2] / "ipips/vectors/lease-history.json").read_text())
    assert len(doc["cases"]) >= 11
    assert any(c["worker"] == c["coordinator"] and c["lease"] for c in doc["cases"])  # judged: it may train
    for case in doc["cases"]:
        verdicts = [Verdict(bytes(32), v["round"], v["shard"], v["attempt"], v["worker"], v["term"], v["accepted"],
                            v["reason"], ()) for v in case["verdicts"]]
        shards = [ShardState(s["index"], ShardPhase(s["phase"]), 1, s["worker"]) for s in case["shards"]]
        refusal = history_refusal(case["worker"], case["coordinator"], verdicts, shards, case.get("judge"))
        assert (refusal is None) == case["lease"], case["name"]


def test_lease_silent_vectors():
    """ipips/vectors/lease-silent.json (IPIP-0004 §5.3): whose lease a coordinator ends because it no longer hears
    the holder; never while it hears nobody else, has heard peers only briefly, or for its own lease."""
    import json
    from pathlib import Path

    from protocol.leasing import silent_holders
    from protocol.state import ShardPhase, ShardState

    doc = json.loads((Path(__file__).resolve().parents[2] / "ipips/vectors/lease-silent.json").read_text())
    assert len(doc["cases"]) >= 10 and any(c["revoke"] for c in doc["cases"])
    for case in doc["cases"]:
        shards = [ShardState(s["index"], ShardPhase(s["phase"]), 1, s["worker"], s["expires_at"]) for s in case["shards"]]
        got = silent_holders(shards, case["coordinator"], case["heard"], case["now"], case["lease_seconds"],
                             case["silent_seconds"], case["silence"], case["hearing_since"])
        assert [[i, round(seconds, 3)] for i, seconds in got] == case["revoke"], case["name"]


def test_the_size_rule_of_full_fine_tuning():
    from protocol.fit import full_size_refusal
    from protocol.messages import FULL_MAX_PARAMETERS

    assert full_size_refusal(FULL_MAX_PARAMETERS) is None
    refusal = full_size_refusal(FULL_MAX_PARAMETERS + 1)
    assert refusal is not None and "more than the 80M full fine-tuning allows" in refusal and "\n" not in refusal


def test_the_revoke_silence_is_at_least_twice_the_heartbeat_silence():
    from protocol.leasing import silent_seconds

    assert silent_seconds(15.0, 5.0) == 15.0
    assert silent_seconds(4.0, 5.0) == 10.0  # a holder gets at least twice the grace a coordinator gets
    assert silent_seconds(0.0, 5.0) == 0.0  # off
