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
    "description": "Term rules for one job, replayed from Coordination(job_id) at term 0. 'view' re-elects over the live peers (a new winner starts term + 1); 'message' checks a coordinator message signed by 'signer' in 'term' (error: ignored, view unchanged; 'why' is not normative). The ranking of the five eligible peers for this job is given; the sixth peer is not eligible.",
    "job_id_hex": job.hex(),
    "ranking": list(R),
    "outsider": outsider,
    "steps": out,
}
Path("ipips/vectors/election-terms.json").write_text(json.dumps(terms, indent=1) + "\n")
