"""Issue 14 items 4, 6, 7 on real agents: a job on a dataset already in IPFS (named by CID), private
(its final aggregate sealed to the submitter), whose ledger every peer replicates; a peer that
truncates or forks its own chain is caught by the others."""

from __future__ import annotations

import json

import pytest

from agent import control, jobdata
from agent.ledger_sync import sync_job
from agent.sealing import SEALED_AGGREGATE_FILES
from protocol import state as st
from protocol.identity import peer_id_from_public_key
from protocol.ledger import LedgerEntry
from protocol.sealed import SealError
from tests.roles.conftest import MODEL_NAME, network, write_dataset

pytestmark = pytest.mark.network

SPEC = """
name: records-test
description: |
  a private job on a dataset named by CID
base_model: {model}
seed: 3
input: {{dataset: "ipfs://{cid}", validation_split: 0.1}}
training: {{batch_size: 8, learning_rate: 0.01, max_steps: 8, max_seq_len: 96}}
lora: {{rank: 4, alpha: 8, target_modules: [q_proj, v_proj]}}
shards: 2
rounds: 1
proof: {{checkpoint_every: 4, verify_segments: 1, tolerance: 0.0001}}
lease_seconds: 60
budget: {{price_per_hour: 2.5, total: 10}}
private: true
"""


async def test_a_private_job_on_a_cid_dataset_completes_sealed_and_its_ledger_is_replicated(tmp_path, tiny_model_dir):
    priced = {i: {"price_per_hour": 2.0} for i in range(3)}  # each worker's own rate (the job offers 2.5)
    async with network(tmp_path, tiny_model_dir, workers=3, overrides=priced) as net:
        submitter, workers = net.submitter, net.workers
        # the data is already in IPFS: another peer holds it; the submitter has never seen it
        source = write_dataset(tmp_path / "elsewhere.jsonl")
        cid = str(await workers[2].content.add_file(source))
        spec = tmp_path / "spec" / "infernet.train.yml"
        spec.parent.mkdir()
        spec.write_text(SPEC.format(model=MODEL_NAME, cid=cid))
        announced = await control._job_announce(submitter, str(spec))
        job_id = bytes.fromhex(announced["id"])
        view = submitter.jobs[job_id]
        assert view.terms.dataset_cid == cid and view.terms.private
        assert view.terms.description.startswith("a private job")
        await submitter.wait_for(lambda: view.state.terminal, timeout=120)
        assert view.state.phase is st.JobPhase.DONE, view.state.reason
        for w in workers:
            await w.wait_for(lambda w=w: job_id in w.jobs and w.jobs[job_id].state.terminal, timeout=20)

        # job show: created, model hash, shard CIDs, parameters, price and cost so far
        detail = control.job_detail(submitter, view)
        assert detail["created"] == view.terms.created and detail["dataset_cid"] == cid
        assert detail["model_sha256"] == view.terms.base_model_sha256.hex()
        assert [s["cid"] for s in detail["shard_cids"]] == [s.cid for s in view.terms.shards]
        assert detail["parameters"]["lora"]["rank"] == 4 and detail["price_per_hour"] == 2.5
        text = "\n".join(jobdata.facts_text(detail))
        assert cid in text and "cost so far" in text and "private" in text

        # sealed: the CID names sealed bytes; the submitter opens them, a worker cannot
        final = view.aggregates[1]
        assert final.final
        out = tmp_path / "result"
        fetched = await control._job_fetch(submitter, announced["id"], str(out))
        assert fetched["sealed"] and (out / "adapter_model.safetensors").stat().st_size > 0
        from safetensors.torch import load_file

        assert load_file(str(out / "adapter_model.safetensors"))
        raw = workers[0].work_dir / "final.tar"
        await workers[0].content.fetch(final.adapter_cid, raw, timeout=30)
        import tarfile

        with tarfile.open(raw) as tar:
            assert set(tar.getnames()) <= SEALED_AGGREGATE_FILES
        with pytest.raises(SealError, match="cannot be opened with the key of"):
            await control._job_fetch(workers[0], announced["id"], str(tmp_path / "w0-result"))
        assert not (tmp_path / "w0-result").exists()

        # data get: any CID through an agent's content service, checked
        got = await jobdata._data_get(workers[1], f"ipfs://{cid}", str(tmp_path / "got.jsonl"))
        assert (tmp_path / "got.jsonl").read_bytes() == source.read_bytes() and got["size"] == source.stat().st_size

        # the ledger: every peer holds every other peer's chain after a sync
        agents = [submitter, *workers]
        for a in agents:
            await a.flush_writes()  # each agent's own chain whole in its store (loop reads may lag the queue)
        for a in agents:
            await sync_job(a, a.jobs[job_id], [b.peer_id for b in agents if b is not a])
        # every participant's chain (a peer whose message applied to the job; an idle follower's lone
        # "done" entry is nobody's business) is held by every other agent
        took_part = {submitter.peer_id, *submitter.store.job_signers(job_id)}
        authors = {a.identity.public_key: [e.hash for e in a.store.ledger(job_id)] for a in agents
                   if a.peer_id in took_part}
        assert len([h for h in authors.values() if h]) >= 3  # submitter, coordinator, trainers
        for a in agents:
            for key, hashes in authors.items():
                assert [e.hash for e in a.store.ledger_copy(job_id, key)] == hashes
        kinds = {e.kind for a in agents for e in a.store.ledger(job_id)}
        assert {"announced", "lease", "checkpoint", "report", "verdict", "aggregate", "done"} <= kinds
        sealed = [e for a in agents for e in a.store.ledger(job_id) if e.kind == "aggregate"]
        assert sealed and all(e.data["sealed_to"] == submitter.peer_id for e in sealed)
        # cost so far: the accepted reports' training time at the job's price, as the bill charges it
        accepted = [view.reports[key][0].metrics["train_seconds"] for key, v in view.verdicts.items() if v.accepted]
        assert accepted and jobdata.job_facts(submitter, view)["cost_so_far"] == pytest.approx(
            sum(accepted) / 3600 * view.terms.price_per_hour, abs=1e-9)  # job facts round to 9 places
        held = submitter.store.chain_rows(job_id)  # (`job show` counts them from the chains' heads)
        assert jobdata.job_facts(submitter, view)["ledger"] == {
            "chains": len(held), "entries": sum(len(rows) for rows in held.values()), "conflicts": 0}

        # the export file checks without an agent
        export = tmp_path / "ledger.json"
        ledger = await jobdata._job_ledger(submitter, announced["id"], export=str(export))
        assert ledger["verified"] and not ledger["conflicts"]
        checked = jobdata.verify_export_file(export)
        # the exporter signed what it held of every other chain (IPIP-0008 §6.1): one heads entry more
        assert checked.entries == sum(len(h) for h in authors.values()) + 1 and checked.job_name == "records-test"
        heads = checked.chains[submitter.peer_id][-1]
        assert heads.kind == "heads" and heads.data["chains"] == {
            peer_id_from_public_key(key): [len(h), h[-1].hex()] for key, h in authors.items()
            if h and key != submitter.identity.public_key}
        # so a copy of the file with a trainer's last entry cut, or a chain left out, no longer verifies
        document = json.loads(export.read_text())
        index = next(i for i, c in enumerate(document["chains"]) if c["author"] != submitter.peer_id)
        cut = json.loads(json.dumps(document))
        cut["chains"][index]["entries"].pop()
        (tmp_path / "cut.json").write_text(json.dumps(cut))
        with pytest.raises(Exception, match=f"chains\\[{index}\\]: .*the chain was cut short"):
            jobdata.verify_export_file(tmp_path / "cut.json")
        author = document["chains"][index]["author"]
        del document["chains"][index], document["keys"][author]
        (tmp_path / "left-out.json").write_text(json.dumps(document))
        with pytest.raises(Exception, match="a chain was left out"):
            jobdata.verify_export_file(tmp_path / "left-out.json")
        # a second export with nothing new held adds no heads entry
        before = len(submitter.store.ledger(job_id))
        await jobdata._job_ledger(submitter, announced["id"], export=str(tmp_path / "again.json"))
        assert len(submitter.store.ledger(job_id)) == before

        # one trainer truncates its own chain, another rewrites (forks) its last entry: the others see it
        trainers = [w for w in workers if any(e.kind == "report" for e in w.store.ledger(job_id))]
        cutter, forker = trainers[0], (trainers[1] if len(trainers) > 1 else
                                       next(w for w in workers if w is not trainers[0] and w.peer_id in took_part))
        held = cutter.store.ledger(job_id)
        cutter.store._db.execute("DELETE FROM ledger WHERE job_id = ? AND seq = ?", (job_id, held[-1].seq))
        last = forker.store.ledger(job_id)[-1]
        forged = LedgerEntry.create(forker.identity, job_id, last.seq, last.prev, last.time + 1, last.peer, last.kind,
                                    {**last.data, "rewritten": True})
        forker.store._db.execute("UPDATE ledger SET entry = ?, signature = ?, hash = ? WHERE job_id = ? AND seq = ?",
                                 (forged.encoded, forged.signature, forged.hash, job_id, last.seq))
        await sync_job(submitter, view, [cutter.peer_id, forker.peer_id])  # (or the background sync did already)
        found = {(c["kind"], c["author"]) for c in submitter.store.conflicts(job_id)}
        assert found == {("truncated", cutter.peer_id), ("fork", forker.peer_id)}
        ledger = await jobdata._job_ledger(submitter, announced["id"])
        assert len(ledger["conflicts"]) == 2
        # the record survives: the submitter's copy still holds the entries the cutter dropped
        assert [e.hash for e in submitter.store.ledger_copy(job_id, cutter.identity.public_key)] == \
            authors[cutter.identity.public_key]
        # and the cutter learns from a peer's copy that its own store lost entries: from the submitter's here,
        # unless its background ledger sync (every 10 s) pulled another holder's copy of its chain first
        await sync_job(cutter, cutter.jobs[job_id], [submitter.peer_id])
        # (the cutter may also find the forker's rewritten entry, if it held the original: a fork)
        own = [(c["kind"], c["author"], c["server"]) for c in cutter.store.conflicts(job_id)
               if c["author"] == cutter.peer_id]
        holders = {submitter.peer_id} | {w.peer_id for w in workers if w is not cutter}
        assert [(kind, author) for kind, author, _ in own] == [("truncated", cutter.peer_id)] and own[0][2] in holders
        # a peer whose copy of someone else's chain was changed serves it: the receiver names the bad copy
        victim = next(w for w in workers if w is not cutter and w.peer_id in took_part)  # a chain the submitter keeps
        changed = submitter.store._db.execute("UPDATE ledger_copies SET signature = ? WHERE job_id = ? AND author = ? AND seq = 0",
                                    (bytes(64), job_id, victim.identity.public_key)).rowcount
        assert changed == 1
        other = next(w for w in workers if w is not victim)
        # (a peer holding the chain already is sent only what it lacks, IPIP-0008 §5.1: one that holds none of it
        # is sent it whole, the bad entry with it)
        other.store._db.execute("DELETE FROM ledger_copies WHERE job_id = ? AND author = ?",
                                (job_id, victim.identity.public_key))
        await sync_job(other, other.jobs[job_id], [submitter.peer_id])
        invalid = [c for c in other.store.conflicts(job_id) if c["kind"] == "invalid"]
        assert [(c["author"], c["server"]) for c in invalid] == [(victim.peer_id, submitter.peer_id)], invalid
        assert "bad signature" in invalid[0]["detail"]
        shown = await jobdata._job_ledger(submitter, announced["id"])  # our own bad copy is reported, not raised
        assert any(c["problem"] and "bad signature" in c["problem"] for c in shown["chains"])
        json.loads(export.read_text())  # the export written before the tampering is unchanged JSON
