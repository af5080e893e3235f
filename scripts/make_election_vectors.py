"""Write ipips/vectors/election-*.json from fixed seeds; reviewed by hand."""
import hashlib, json, sys
from pathlib import Path
sys.path.insert(0, ".")
from protocol.identity import Identity, peer_id_bytes
from protocol.election import ELECTION_DOMAIN, election_score, rank_peers, Coordination
from protocol.errors import StateError

seeds = [bytes([i]) * 32 for i in range(1, 7)]
ids = [Identity(s) for s in seeds]
peers = [i.peer_id for i in ids]
jobs = [hashlib.sha256(b"infernet election vector job %d" % n).digest() for n in range(4)]

doc = {
    "description": "Rendezvous election. Peers are protocol.identity.Identity(seed) for the seeds below; score = sha256(domain || job_id || peer_id_bytes) as a big-endian integer; ranking = peers by score, highest first; the coordinator is the first live peer of the ranking. 'without_first' is the coordinator once the first-ranked peer is removed from the live set (the runner-up).",
    "domain_hex": ELECTION_DOMAIN.hex(),
    "peers": [{"seed_hex": s.hex(), "peer_id": i.peer_id, "peer_id_bytes_hex": peer_id_bytes(i.public_key).hex()} for s, i in zip(seeds, ids)],
    "jobs": [],
}
for job in jobs:
    ranking = rank_peers(job, peers)
    doc["jobs"].append({
        "job_id_hex": job.hex(),
        "scores_hex": {p: format(election_score(job, p), "064x") for p in peers},
        "ranking": list(ranking),
        "coordinator": ranking[0],
        "without_first": rank_peers(job, set(peers) - {ranking[0]})[0],
    })
Path("ipips/vectors/election-ranking.json").write_text(json.dumps(doc, indent=1) + "\n")

# Terms: one job, five eligible peers (the first five seeds) and an outsider (the sixth).
job = jobs[0]
five = peers[:5]
R = rank_peers(job, five)
outsider = peers[5]
everyone = list(five)
steps = [
    ("view", everyone, None, None),
    ("message", everyone, R[0], 1),
    ("message", everyone, R[1], 1),
    ("view", [p for p in five if p != R[0]], None, None),
    ("message", [p for p in five if p != R[0]], R[0], 1),
    ("view", [p for p in five if p != R[0]], None, None),
    ("message", [p for p in five if p != R[0]], R[1], 2),
    ("view", everyone, None, None),
    ("message", everyone, R[1], 2),
    ("message", everyone, R[2], 5),
    ("message", everyone, outsider, 6),
    ("message", everyone, R[2], 4),
    ("view", everyone, None, None),
    # rule 8: two peers claim one term; the first of the two by rank coordinates it (the view's term stays)
    ("view", [p for p in five if p != R[0]], None, None),
    ("message", [p for p in five if p != R[0]], R[0], 7),
    ("message", everyone, R[0], 7),
    ("message", everyone, R[1], 7),
    ("message", everyone, R[2], 7),
]
c = Coordination(job)
out = []
for kind, live, signer, term in steps:
    item = {"kind": kind, "live": sorted(live)}
    if kind == "message":
        item["signer"] = signer
        item["term"] = term
        try:
            c = c.check_message(signer, term, live)
        except StateError as exc:
            item["error"] = True
            item["why"] = str(exc)
    else:
        c = c.follow_view(live)
    item["expect_term"] = c.term
    item["expect_coordinator"] = c.coordinator
    out.append(item)
terms = {
    "description": "Term rules for one job, replayed from Coordination(job_id) at term 0. 'view' re-elects over the live peers (a new winner starts term + 1); 'message' checks a coordinator message (a lease, an aggregate or a heartbeat's term: one that may move the view) signed by 'signer' in 'term' (error: ignored, view unchanged; 'why' is not normative). A message in the view's own term from an eligible live peer that ranks before the view's coordinator makes it the term's coordinator (rule 8: two peers claimed one term). The ranking of the five eligible peers for this job is given; the sixth peer is not eligible.",
    "job_id_hex": job.hex(),
    "ranking": list(R),
    "outsider": outsider,
    "steps": out,
}
Path("ipips/vectors/election-terms.json").write_text(json.dumps(terms, indent=1) + "\n")

# --- the submitter's side decides (IPIP-0006 §1.3 rule 5) -------------------------------------------
from protocol.election import hears_submitter

submitter, me = peers[0], peers[1]
cases = []
for name, heard, since, now, settled, who in [
    ("we are the submitter, hearing peers for 6 s: settled", {}, {submitter: 94.0}, 100.0, True, submitter),
    ("we are the submitter, hearing no peer (just restarted, or alone): may act", {}, {}, 100.0, False, submitter),
    ("we are the submitter, hearing no peer: no view change", {}, {}, 100.0, True, submitter),
    ("we are the submitter, hearing peers for 2 s: no view change yet", {}, {submitter: 98.0}, 100.0, True, submitter),
    ("we are the submitter, hearing peers for exactly 5 s: settled", {}, {submitter: 95.0}, 100.0, True, submitter),
    ("live: may act as coordinator", {submitter: 100.0}, {submitter: 98.0}, 100.5, False, me),
    ("back 2.5 s ago: no view change yet", {submitter: 100.0}, {submitter: 98.0}, 100.5, True, me),
    ("heard 5.5 s in a row: view may change", {submitter: 100.0}, {submitter: 95.0}, 100.5, True, me),
    ("heard exactly 5 s: settled", {submitter: 100.0}, {submitter: 95.5}, 100.5, True, me),
    ("5 beats missed: cut off", {submitter: 100.0}, {submitter: 90.0}, 105.0, False, me),
    ("never heard", {}, {}, 100.0, False, me),
]:
    cases.append({"name": name, "me": who, "last_heartbeat": heard, "live_since": since, "now": now,
                  "settled": settled,
                  "expect": hears_submitter(submitter, who, heard, since, now, settled=settled,
                                            heartbeat_seconds=1.0, missed_heartbeats=5)})
side = {
    "description": "IPIP-0006 §1.3 rule 5, with the agent's heartbeat_seconds 1.0 and missed_heartbeats 5: may 'me' act as coordinator of a job submitted by 'submitter' (settled false: the submitter is live, i.e. now - last_heartbeat < 5 s, or me is the submitter), or change its election view (settled true: also heard since live_since for at least 5 s; for the submitter itself, live_since[submitter] is since when it has heard other peers without a break, absent when it hears none: it may always act, and changes its view only once settled)?",
    "submitter": submitter, "heartbeat_seconds": 1.0, "missed_heartbeats": 5,
    "cases": cases,
}
Path("ipips/vectors/election-submitter.json").write_text(json.dumps(side, indent=1) + "\n")

# --- a coordinator never judges its own work (IPIP-0006 §1.3 rule 6) --------------------------------
from protocol.election import judge_of, may_judge

R = rank_peers(job, five)
judge_cases = []
for name, coordinator, worker, eligible in [
    ("another worker's report: the coordinator judges", R[0], R[2], five),
    ("the coordinator's own report: the next eligible peer by rank judges", R[0], R[0], five),
    ("the runner-up coordinates, its own report: the first-ranked (live) judges", R[1], R[1], five),
    ("the runner-up's own report, the first-ranked gone: the third judges", R[1], R[1], [p for p in five if p != R[0]]),
    ("the coordinator alone: nobody can judge its report", R[0], R[0], [R[0]]),
]:
    judge_cases.append({"name": name, "coordinator": coordinator, "worker": worker, "eligible": sorted(eligible),
                        "expect_judge": judge_of(job, coordinator, worker, eligible)})
accept_cases = []
view2 = Coordination(job, 2, R[1])
for name, signer, worker, term, eligible in [
    ("the judge's verdict on the coordinator's report, its term", R[0], R[1], 2, five),
    ("any other eligible peer's verdict on it is accepted too", R[2], R[1], 2, five),
    ("the coordinator's verdict on its own report: never", R[1], R[1], 2, five),
    ("an ineligible signer", outsider, R[1], 2, five),
    ("a stale term", R[0], R[1], 1, five),
    ("a verdict on another worker's report follows the term rules, not this one", R[0], R[3], 2, five),
]:
    accept_cases.append({"name": name, "signer": signer, "worker": worker, "term": term, "eligible": sorted(eligible),
                         "expect": may_judge(view2, signer, worker, term, eligible)})
ahead = []
view1 = Coordination(job, 1, R[0])
for name, kind, signer, term in [
    ("a verdict in a term ahead of the view is held: its signer may be the judge", "verdict", R[1], 2),
    ("a lease in a term ahead of the view moves it (its signer coordinates that term)", "lease", R[1], 2),
    ("an aggregate likewise", "aggregate", R[2], 3),
]:
    item = {"name": name, "kind": kind, "signer": signer, "term": term}
    try:
        after = view1.check_message(signer, term, five, adopt=kind != "verdict")
        item.update(error=False, expect_term=after.term, expect_coordinator=after.coordinator)
    except StateError:
        item.update(error=True, expect_term=view1.term, expect_coordinator=view1.coordinator)
    ahead.append(item)
from protocol.election import settle_replayed_term

replayed = []
for name, first, judged, signer, worker in [
    ("the verdict's signer leases: it coordinates the term", R[1], R[0], R[1], None),
    ("the verdict's signer judges another worker: it coordinates the term", R[1], R[0], R[1], R[3]),
    ("the verdict's signer judges the same worker again: nothing settled", R[1], R[0], R[1], R[0]),
    ("the judged worker aggregates: it coordinates, the verdict was its judge's", R[1], R[0], R[0], None),
    ("the judged worker judges a third worker: it coordinates", R[1], R[0], R[0], R[2]),
    ("each judged the other: the first-ranked coordinates (the judged worker here)", R[1], R[0], R[0], R[1]),
    ("each judged the other: the first-ranked coordinates (the verdict's signer here)", R[0], R[1], R[1], R[0]),
    ("a third peer's decision settles nothing", R[1], R[0], R[2], None),
]:
    replayed.append({"name": name, "first": first, "judged": judged, "signer": signer, "worker": worker,
                     "expect": settle_replayed_term(job, first, judged, signer, worker)})
judge = {
    "description": "IPIP-0006 §1.3 rule 6 for the job of election-terms.json (same peers, ranking and outsider): 'judges' gives who judges a worker's report (judge_of: the coordinator, unless the report is its own; then the first of the ranking over the eligible live peers without it, null if none); 'accepts' gives whether a verdict on a worker's report signed by 'signer' in 'term' is accepted by a peer whose view is (term 2, ranking[1]) under this rule (may_judge); a verdict signed by the worker it judges is never applied; 'ahead' gives, from the view 'ahead_view' (term 1, ranking[0]), what a coordinator message of 'kind' in a higher term does: a verdict never moves the view (error: true, it is held), a lease or aggregate does (check_message with adopt false for verdicts).",
    "job_id_hex": job.hex(), "ranking": list(R), "outsider": outsider,
    "view": {"term": view2.term, "coordinator": view2.coordinator},
    "judges": judge_cases, "accepts": accept_cases,
    "ahead_view": {"term": view1.term, "coordinator": view1.coordinator},
    "ahead": ahead,
    "replayed_description": "A replayed history adopts a verdict's higher term with its signer as coordinator, provisionally: the verdict was 'first''s on 'judged''s report. 'replayed' gives who coordinates that term once 'signer' decides in it (worker: the worker of its verdict, null for a lease or aggregate); expect null: not settled (settle_replayed_term).",
    "replayed": replayed,
}
Path("ipips/vectors/election-judge.json").write_text(json.dumps(judge, indent=1) + "\n")


# --- eligibility for a job reads the capability (IPIP-0006 §1.2, protocol/fit.replay_refusals) --------
from dataclasses import replace as _replace

from protocol import messages as m
from protocol.election import eligible_for_job
from protocol.fit import replay_refusals
from scripts.make_envelope_vectors import sample_capability, sample_terms

MODEL_A, MODEL_B = hashlib.sha256(b"model a").digest(), hashlib.sha256(b"model b").digest()
base_cap = sample_capability()


def cap_for(can_coordinate, gpus, models, backends):
    devices = tuple(m.Device("cuda", i, "GPU", float(gb), float(gb), "8.0", True) for i, gb in enumerate(gpus))
    return _replace(base_cap, can_coordinate=can_coordinate, devices=devices,
                    models=tuple(m.ModelHeld(f"model-{d.hex()[:4]}", d) for d in models), backends=tuple(backends))


declared = {  # peer -> (can_coordinate, GPUs' total GB, models held, runtimes offered)
    peers[0]: (True, [], [MODEL_A], ["peft"]),
    peers[1]: (True, [24.0], [MODEL_A], ["peft"]),
    peers[2]: (True, [80.0, 80.0], [MODEL_A, MODEL_B], ["peft", "unsloth"]),
    peers[3]: (False, [80.0], [MODEL_A], ["peft", "unsloth"]),
    peers[4]: (True, [16.0], [MODEL_B], ["peft", "unsloth"]),
    peers[5]: (True, [], [], ["peft"]),
}
caps = {p: cap_for(*v) for p, v in declared.items()}
terms0 = sample_terms(Identity(bytes([1]) * 32))
jobs_e = [
    ("cpu job on model a", MODEL_A, "peft", 0.0),
    ("cpu job on model b", MODEL_B, "peft", 0.0),
    ("20 GB job on model a", MODEL_A, "peft", 20.0),
    ("40 GB job on model a", MODEL_A, "peft", 40.0),
    ("unsloth job on model a", MODEL_A, "unsloth", 0.0),
    ("job on a model nobody holds", hashlib.sha256(b"model c").digest(), "peft", 0.0),
]
cases = []
for name, model, runtime, vram in jobs_e:
    terms = _replace(terms0, base_model_sha256=model, runtime=runtime, min_vram_gb=vram)
    eligible = eligible_for_job(peers, caps, terms)
    ranking = rank_peers(terms.job_id(), eligible)
    cases.append({"name": name, "base_model_sha256": model.hex(), "runtime": runtime, "min_vram_gb": vram,
                  "job_id_hex": terms.job_id().hex(), "eligible": sorted(eligible),
                  "coordinator": ranking[0] if ranking else None,
                  "why_not": {p: replay_refusals(caps[p], terms) for p in peers
                              if p not in eligible and caps[p].can_coordinate}})
eligibility = {
    "description": "IPIP-0006 §1.2 eligibility: a live peer may coordinate a job when its capability says can_coordinate and it can replay the job (protocol/fit.replay_refusals): it holds the base model by sha256, and when min_vram_gb > 0 or runtime is unsloth it has a CUDA device whose total VRAM is >= min_vram_gb; for runtime unsloth it also offers unsloth in its backends. Each peer's capability is scripts/make_envelope_vectors.sample_capability() with can_coordinate, devices (cuda, total = free = the GB listed), models (by sha256) and backends replaced; each job is sample_terms(Identity(0x01 * 32)) with base_model_sha256, runtime and min_vram_gb replaced (its job_id given). All six peers are live. 'why_not' is not normative.",
    "peers": {p: {"can_coordinate": v[0], "cuda_total_gb": v[1], "models": [d.hex() for d in v[2]], "backends": v[3]}
              for p, v in declared.items()},
    "jobs": cases,
}
Path("ipips/vectors/election-eligibility.json").write_text(json.dumps(eligibility, indent=1) + "\n")

# --- rule 11: one coordinator, two numbers (IPIP-0006 §1.3) ------------------------------------------
from protocol.election import may_apply_past_verdict, may_judge

past_doc = json.loads(Path("ipips/vectors/election-past.json").read_text())
rjob, rank = bytes.fromhex(past_doc["job_id_hex"]), past_doc["ranking"]
# the view counted term 2 for ranking[0]'s death and named ranking[1]; ranking[1] never elected ranking[0],
# so its own view numbers its tenure 1
rview = Coordination(rjob, 1, rank[0])._moved(2, rank[1])
renumbered = []
for name, kind, signer, term, claimed in [
    ("our coordinator, in the term it claims (lower than ours): applies", "lease", rank[1], 1, 1),
    ("our coordinator's verdict, in the term it claims: applies", "verdict", rank[1], 1, 1),
    ("our coordinator in our own term: applies (rule 2)", "lease", rank[1], 2, 1),
    ("our coordinator, in a lower term than it claims (an earlier tenure): stale", "lease", rank[1], 1, 2),
    ("our coordinator, no claim heard yet: stale (held; tried again when its claim comes)", "lease", rank[1], 1, None),
    ("another peer, in the term it claims: stale", "lease", rank[2], 1, 1),
    ("term 1's coordinator in this view, in term 1: stale", "aggregate", rank[0], 1, 1),
]:
    item = {"name": name, "kind": kind, "signer": signer, "term": term, "claimed": claimed}
    try:
        after = rview.check_message(signer, term, rank, adopt=kind != "verdict", claimed=claimed)
        item["applies"] = True
        item["expect_view"] = {"term": after.term, "coordinator": after.coordinator}
    except StateError:
        item["applies"] = False
    renumbered.append(item)
judged = []
for name, signer, term, claimed in [
    ("the judge, in the term the coordinator claims: applies", rank[2], 1, 1),
    ("the judge, in our term: applies", rank[2], 2, 1),
    ("the judge, in a term the coordinator does not claim: refused", rank[2], 1, None),
    ("the coordinator judging itself: refused", rank[1], 1, 1),
]:
    judged.append({"name": name, "signer": signer, "worker": rank[1], "term": term, "claimed": claimed,
                   "applies": may_judge(rview, signer, rank[1], term, rank, claimed)})
past_verdicts = []
for name, signer, worker, term, lease_term, claimed in [
    ("our coordinator's verdict in the term it claims, on an attempt it leased then: applies", rank[1], rank[3], 1, 1, 1),
    ("the same, the lease not known here: applies", rank[1], rank[3], 1, None, 1),
    ("the same, no claim heard: refused (term 1 is ranking[0]'s in this view)", rank[1], rank[3], 1, 1, None),
    ("on an attempt leased in a later term: refused", rank[1], rank[3], 1, 2, 1),
    ("our coordinator judging its own attempt: refused", rank[1], rank[1], 1, 1, 1),
]:
    past_verdicts.append({"name": name, "signer": signer, "worker": worker, "term": term, "lease_term": lease_term,
                          "claimed": claimed,
                          "applies": may_apply_past_verdict(rview, signer, worker, term, lease_term, rank, claimed)})
renumbered_doc = {
    "description": "IPIP-0006 §1.3 rule 11 on the job and peers of election-past.json ('ranking' is their order by rank): a view that held term 1 (ranking[0]) and moved to term 2 naming ranking[1], whose own view numbers its tenure 1. 'messages': a coordinator message of 'kind' signed by 'signer' in 'term', 'claimed' being the term that signer claims in its latest heartbeat (null: none heard), checked with every ranked peer eligible and live (check_message, adopt false for a verdict): 'applies', and the view after it ('expect_view'; a lower term never moves it). 'judged': a verdict on the report of the view's coordinator ('worker') signed by 'signer' in 'term', with 'claimed' the coordinator's claim (may_judge). 'past_verdicts': a verdict of a term below the view's, signed by 'signer' on 'worker''s attempt leased in 'lease_term' (null: not known here), 'claimed' the signer's claimed term (may_apply_past_verdict, rule 7 with rule 11).",
    "job_id_hex": rjob.hex(),
    "ranking": rank,
    "view": {"term": rview.term, "coordinator": rview.coordinator, "past": [list(p) for p in rview.past]},
    "messages": renumbered,
    "judged": judged,
    "past_verdicts": past_verdicts,
}
Path("ipips/vectors/election-renumbered.json").write_text(json.dumps(renumbered_doc, indent=1) + "\n")
