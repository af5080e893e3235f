"""A job travels the whole way between real agents: announce, lease, train, verify, aggregate, publish."""

from __future__ import annotations

import pytest
import trio

from agent.train.data import write_chatml
from agent.train.tiny import demo_records
from protocol import state as st
from tests.roles.conftest import fast_spec, network, write_dataset

pytestmark = pytest.mark.network


async def test_job_completes_and_aggregate_beats_base(tmp_path, tiny_model_dir):
    """With an outer optimizer, a schedule across rounds and coded reports (every segment replayed,
    the last one through the codec; int4-fresh, so round 2's reports decode onto the carried AdamW state
    too): each aggregate is scored and carries its state."""
    dataset = write_dataset(tmp_path / "demo.jsonl")
    spec = fast_spec(extra="outer: {optimizer: nesterov, lr: 0.8, momentum: 0.5}\n",
                     training=", schedule: cosine, report_codec: int4-fresh", verify_segments=2)
    async with network(tmp_path, tiny_model_dir) as net:
        submitter, workers = net.submitter, net.workers
        terms = await submitter.submitter.prepare_terms(spec, dataset, str(tiny_model_dir))
        assert terms.outer.optimizer == "nesterov" and terms.training.schedule == "cosine"
        assert terms.training.report_codec == "int4-fresh"
        view = await submitter.submitter.announce(terms)
        await submitter.wait_for(lambda: view.state.terminal, timeout=240)
        assert view.state.phase is st.JobPhase.DONE, view.state.reason
        assert set(view.aggregates) == {1, 2}
        final = view.aggregates[2]
        assert final.final and final.method == "exact" and sorted(final.shards) == [0, 1, 2, 3]
        first = view.aggregates[1]  # scored by the coordinator on the job's validation split
        assert first.base_validation_loss > first.validation_loss > final.validation_loss > 0, \
            (first.base_validation_loss, first.validation_loss, final.validation_loss)
        assert final.base_validation_loss is None
        # the verifier fetched only what its replays read: no step-0 checkpoint (the header commits to the start
        # it holds) and no segment end (its replays here are bit-exact): per report, the starts of its two replayed
        # segments at most (before: step 0, the starts and the ends, three or more)
        judge = next(a for a in [submitter, *workers] if a.peer_id == view.coordination.coordinator)
        verdicts = judge.counters["verdicts_accepted"]
        assert verdicts >= 8 and judge.counters["verify_starts_known"] >= verdicts, dict(judge.counters)
        assert judge.counters["verify_checkpoints_fetched"] <= 2 * verdicts, dict(judge.counters)
        assert judge.counters["replays_needing_end"] == 0
        # every worker's mirror agrees
        for w in workers:
            await w.wait_for(lambda w=w: view.job_id in w.jobs and w.jobs[view.job_id].state.terminal, timeout=20)
            assert w.jobs[view.job_id].state.published == view.state.published
        out = tmp_path / "aggregate.tar"
        await submitter.content.fetch(final.adapter_cid, out, timeout=30)
        report, _ = next(iter(view.reports.values()))  # what a worker sent: the config and the payload
        await submitter.content.fetch(report.adapter_cid, tmp_path / "report.tar", timeout=30)
        import tarfile

        with tarfile.open(tmp_path / "report.tar") as tar:
            assert sorted(name.rsplit("/", 1)[-1] for name in tar.getnames() if name.endswith((".json", ".safetensors"))) \
                == ["adapter_config.json", "delta.safetensors"]
    losses = await trio.to_thread.run_sync(_losses, tiny_model_dir, out, tmp_path, terms)
    assert losses["adapter"] < losses["base"], losses


def _losses(model_dir, bundle, tmp_path, terms):
    """Validation loss of the base model and of base + the published adapter, via stock peft."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from agent.bundle import AGGREGATE_FILES, unpack
    from agent.train.runner import train_config
    from agent.train.run import load_shard
    from agent.train.model import load_tokenizer

    adapter_dir = unpack(bundle, tmp_path / "aggregate", allowed=AGGREGATE_FILES)
    assert (adapter_dir / "outer_state.safetensors").exists()  # the successor's outer momentum
    tokenizer = load_tokenizer(str(model_dir))
    val = tmp_path / "val.jsonl"
    write_chatml(val, demo_records(48, seed=99))
    config = train_config(terms, str(model_dir), threads=1)
    examples = load_shard(config, tokenizer, val).examples
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)

    def loss(model):
        model.eval()
        total = n = 0.0
        with torch.no_grad():
            for ex in examples:
                ids = torch.tensor([ex.input_ids])
                labels = torch.tensor([ex.labels])
                total += float(model(input_ids=ids, labels=labels).loss)
                n += 1
        return total / n

    before = loss(base)
    tuned = PeftModel.from_pretrained(base, str(adapter_dir))
    return {"base": before, "adapter": loss(tuned)}


async def test_a_job_stops_early_when_its_stop_rule_holds(tmp_path, tiny_model_dir):
    """stop_when (IPIP-0006 §2.6): the round-1 score is below the threshold, so round 1's aggregate is
    final and the 3-round job ends DONE after one round on every mirror; nobody trains round 2."""
    dataset = write_dataset(tmp_path / "demo.jsonl")
    spec = fast_spec(shards=2, rounds=3, extra="stop_when: {validation_loss_below: 100}\n")
    async with network(tmp_path, tiny_model_dir, workers=2) as net:
        submitter = net.submitter
        terms = await submitter.submitter.prepare_terms(spec, dataset, str(tiny_model_dir))
        assert terms.stop.validation_loss_below == 100.0
        view = await submitter.submitter.announce(terms)
        await submitter.wait_for(lambda: view.state.terminal, timeout=180)
        assert view.state.phase is st.JobPhase.DONE, view.state.reason
        assert set(view.aggregates) == {1} and view.aggregates[1].final
        assert view.aggregates[1].validation_loss < 100.0
        assert view.refused["final-flag"] == 0
        for w in net.workers:
            await w.wait_for(lambda w=w: view.job_id in w.jobs and w.jobs[view.job_id].state.terminal, timeout=20)
            assert w.jobs[view.job_id].state.phase is st.JobPhase.DONE
            assert not any(k[0] == 2 for k in w.jobs[view.job_id].leases)  # no round 2 was leased
            # nor announced early: the stop rule reads the score, so it is scored before any early start
            assert w.counters.get("early_starts_announced", 0) == 0 and w.counters.get("early_starts", 0) == 0
