"""The market on real agents: providers and models from signed capabilities, a measured speed and the
estimate built on it, a budget that runs out mid-round, named providers, and a bill equal to the ledger."""

from __future__ import annotations

from dataclasses import replace

import copy
import math

import pytest
import trio

from agent import control, market
from agent.control import job_detail
from agent.ledger_sync import sync_job
from protocol import market as mk
from protocol import state as st
from tests.roles.conftest import fast_spec, network, write_dataset

pytestmark = pytest.mark.network

PRICE = 3600.0  # one unit per second trained: the first accepted shard spends the budget


async def test_budget_runs_out_mid_round_and_the_bill_equals_the_ledger(tmp_path, tiny_model_dir):
    dataset = write_dataset(tmp_path / "demo.jsonl", n=200)
    spec = fast_spec(shards=8, rounds=1, max_steps=8, extra=f"budget: {{price_per_hour: {PRICE}, total: 0.01}}\n")
    overrides = {0: {"measure_speed": True}, 3: {"can_coordinate": False}}
    async with network(tmp_path, tiny_model_dir, workers=4, overrides=overrides) as net:
        submitter, workers = net.submitter, net.workers
        w0 = net.agents["w0"]
        # the measured speed reaches the others in w0's signed capability
        with trio.fail_after(90):
            while not (submitter.peers.get(w0.peer_id) and submitter.peers[w0.peer_id].capability.speeds):
                await trio.sleep(0.2)
        speed = submitter.peers[w0.peer_id].capability.speeds[0]
        assert speed.sha256 == w0.capabilities.models_held[0].sha256 and speed.tokens_per_s > 0 and speed.device == "cpu"
        assert market.load_speeds(w0.config.home)  # cached in its home: not measured again on restart

        # providers and models: what the capabilities say
        rows = {p["peer_id"]: p for p in market.providers(submitter)}
        assert set(rows) == {w.peer_id for w in workers}
        for w in workers:
            cap = submitter.peers[w.peer_id].capability
            row = rows[w.peer_id]
            assert row["models"] == [{"name": x.name, "sha256": x.sha256.hex()} for x in cap.models]
            assert row["runtimes"] == list(cap.backends) == ["peft"] and row["accepts_training"] is True
            assert row["busy"] is False and row["reputation"]["score"] == 0.5
        assert [s["tokens_per_s"] for s in rows[w0.peer_id]["speeds"]] == [speed.tokens_per_s]
        (model,) = market.models(submitter)
        assert model["name"] == "infernet-tiny" and model["providers"] == 4 and model["training"] == 4
        assert model["sha256"] == w0.capabilities.models_held[0].sha256.hex() and model["tokens_per_s"] == [speed.tokens_per_s]

        # the estimate: tokens by the model's tokenizer, hours from the advertised speed, cost at the price
        est = await market.estimate(submitter, spec, dataset, str(tiny_model_dir))
        assert est["tokens"] > 0 and est["steps"] == 8 * 8 and est["providers"] == 1
        assert est["tokens_per_s"] == speed.tokens_per_s
        assert math.isclose(est["cost"], est["worker_hours"] * PRICE) and est["over_budget"] is True
        # issue 25: an estimate past the spec's own max_runtime_hours says so (3.4 years vs 24 h was unsaid)
        assert est["over_runtime"] is False and est["max_runtime_hours"] == spec.resources.max_runtime_hours
        short = replace(spec, resources=replace(spec.resources, max_runtime_hours=est["wall_hours"] / 2))
        over = await market.estimate(submitter, short, dataset, str(tiny_model_dir))
        assert over["over_runtime"] is True and "OVER ITS LIMIT" in market.estimate_text(over)

        # a job only w0..w2 may train (w3 is not named), on one node at most, whose budget one shard spends
        named = tuple(w.peer_id for w in workers[:3])
        terms = await submitter.submitter.prepare_terms(spec, dataset, str(tiny_model_dir), providers=named,
                                                        max_nodes=1)
        w3 = net.agents["w3"]
        assert "not one of the job's named providers" in w3.worker.refusal(terms)
        view = await submitter.submitter.announce(terms)
        await submitter.wait_for(lambda: view.state.terminal, timeout=180)
        assert view.state.phase is st.JobPhase.CANCELLED and "budget spent" in view.state.reason, view.state.reason
        accepted = [k for k, v in view.verdicts.items() if v.accepted]
        assert 1 <= len(accepted) < 8, "leasing stopped mid-round"
        detail = job_detail(submitter, view)
        assert "budget spent" in detail["budget"]["leasing_stopped"] and detail["budget"]["spent"] >= 0.01
        assert all(lease.worker != w3.peer_id for lease in view.leases.values())
        assert len({lease.worker for lease in view.leases.values()}) == 1  # max_nodes

        # no lease was granted after the first accepted verdict made the budget spent (the coordinator's ledger)
        coordinator = next(a for a in workers if a.peer_id == view.coordination.coordinator)
        await coordinator.flush_writes()  # a read on the event loop may lag the queued ledger appends
        entries = coordinator.store.ledger(view.job_id)
        first_accept = min(e.seq for e in entries if e.kind == "verdict" and e.data["accepted"])
        assert not [e for e in entries if e.kind == "lease" and e.seq > first_accept]

        # the bill: signed by the submitter, and equal to the ledgers (workers' reports x coordinator's verdicts).
        # `job bill` pulls the participants' chains, then checks every billed attempt against the report
        # and verdict entries of every chain held (the submitter's own chain has none of them)
        assert not [e for e in submitter.store.ledger(view.job_id) if e.kind in ("report", "verdict")]
        bill = await control._job_bill(submitter, view.job_id.hex())
        assert bill["signer"] == submitter.peer_id
        assert bill["ledger"]["consistent"], bill["ledger"]["problems"]
        assert bill["ledger"]["entries_checked"] == len(accepted) == len(view.verdicts) > 0
        assert bill["ledger"]["chains"] >= 3  # the submitter's, the coordinator's, the trained worker's
        assert "consistent (%d billed attempts" % len(accepted) in market.bill_text(bill)
        from protocol.identity import verify_signature
        from protocol.market import bill_bytes

        doc = {k: v for k, v in bill.items() if k not in ("state", "signature", "signer", "bill_sha256", "ledger")}
        doc["job_id"] = bytes.fromhex(doc["job_id"])
        assert verify_signature(submitter.identity.public_key, bill_bytes(doc), bytes.fromhex(bill["signature"]))
        reports = {}
        for w in workers:
            await w.flush_writes()
            for e in w.store.ledger(view.job_id):
                if e.kind == "report":
                    reports[(e.data["round"], e.data["shard"], e.data["attempt"])] = e.data
        owed: dict[str, float] = {}
        for e in entries:
            if e.kind == "verdict" and e.data["accepted"]:
                r = reports[(e.data["round"], e.data["shard"], e.data["attempt"])]
                assert r["worker"] == e.data["worker"] and r["price_per_hour"] == PRICE
                owed[r["worker"]] = owed.get(r["worker"], 0.0) + r["duration"] / 3600 * r["price_per_hour"]
        billed = {row["worker"]: row["amount"] for row in bill["workers"] if row["accepted"]}
        assert billed.keys() == owed.keys()
        assert all(math.isclose(billed[w], owed[w]) for w in owed), (billed, owed)
        assert math.isclose(bill["total"], sum(owed.values()))
        await submitter.flush_writes()  # the bill entry `job bill` queued
        kinds = [e.kind for e in submitter.store.ledger(view.job_id)]
        assert kinds.count("bill") == 1
        market.bill(submitter, view)  # the same amounts again: no second ledger entry
        assert [e.kind for e in submitter.store.ledger(view.job_id)].count("bill") == 1
        submitter.store.verify_ledger(view.job_id)

        # reputations now count the accepted work, and order the next grants: the coordinator puts the
        # worker that delivered before a stranger whose claim came first
        from protocol.market import order_claims

        (trained,) = {lease.worker for lease in view.leases.values()}
        stranger = w3.peer_id
        for agent in (submitter, coordinator):
            agent.reputations._at = -1e18
            counted = agent.reputations.get()
            assert counted[trained].accepted == len(accepted) and stranger not in counted
        assert order_claims([(stranger, 0), (trained, 1)], coordinator.reputations.get()) == [(trained, 1), (stranger, 0)]
        assert {p["peer_id"]: p for p in market.providers(submitter)}[trained]["reputation"]["accepted"] == len(accepted)

        # a tampered bill disagrees with the ledger, each way named: hours, worker, an attempt the ledger
        # lacks, one it holds that is not billed
        doc = mk.make_bill(view.job_id, submitter.peer_id, PRICE, view.terms.budget,
                           market.accepted_attempts(view), submitter.clock())
        assert market.ledger_check(submitter, view, doc)["consistent"]
        first = doc["workers"][0]["attempts"][0]
        key = (first["round"], first["shard"], first["attempt"])
        where = f"round {key[0]} shard {key[1]} attempt {key[2]}"

        # only the verdict signer's entries count: our mirror's verdicts are the coordinator's, and a third
        # peer's signed chain (w3's, copied into the submitter's store) that rejects the billed attempt and
        # judges one that never existed leaves the honest bill consistent, its entries listed as not counted
        signers = market.verdict_signers(submitter, view)
        assert signers.keys() == view.verdicts.keys() and signers[key] == coordinator.peer_id
        w3.store.append_event(view.job_id, "verdict", {
            "round": key[0], "shard": key[1], "attempt": key[2], "worker": trained, "accepted": False,
            "reason": "a third peer's say"}, w3.clock())
        w3.store.append_event(view.job_id, "verdict", {
            "round": 1, "shard": 6, "attempt": 7, "worker": trained, "accepted": True, "reason": "invented"},
            w3.clock())
        third = w3.store.ledger(view.job_id)
        assert submitter.store.extend_copy(view.job_id, w3.identity.public_key, third) == len(third) >= 2
        checked = market.ledger_check(submitter, view, doc)
        assert checked["consistent"], checked["problems"]
        assert checked["entries_checked"] == len(accepted) and len(checked["ignored"]) == 2
        assert all(w3.peer_id[-8:] in line for line in checked["ignored"])

        def problems_of(change) -> list[str]:
            tampered = copy.deepcopy(doc)
            change(tampered)
            checked = market.ledger_check(submitter, view, tampered)
            assert not checked["consistent"]
            return checked["problems"]

        assert any(where in p and "the ledger's report says" in p for p in problems_of(
            lambda d: d["workers"][0]["attempts"][0].update(hours=first["hours"] * 2)))
        assert any(where in p and "the ledger's verdict says accepted" in p for p in problems_of(
            lambda d: d["workers"][0].update(worker=stranger)))
        assert any("round 1 shard 7 attempt 9" in p and "no verdict entry" in p for p in problems_of(
            lambda d: d["workers"][0]["attempts"].append(dict(first, shard=7, attempt=9))))
        assert any(where in p and "not billed" in p for p in problems_of(
            lambda d: d["workers"][0]["attempts"].pop(0)))

        # a ledger that contradicts the bill: the coordinator's chain also records a rejection of that
        # attempt (a second, signed verdict entry); the submitter's next sync copies it and the bill
        # is no longer consistent with the ledger
        coordinator.store.append_event(view.job_id, "verdict", {
            "round": key[0], "shard": key[1], "attempt": key[2], "worker": trained, "accepted": False,
            "reason": "changed its mind"}, coordinator.clock())
        await sync_job(submitter, view, peers=[coordinator.peer_id])
        checked = market.bill(submitter, view)["ledger"]
        assert not checked["consistent"] and checked["entries_checked"] == len(accepted)
        assert any(where in p and "rejected for" in p for p in checked["problems"]), checked["problems"]
        assert "INCONSISTENT" in market.bill_text(market.bill(submitter, view))
