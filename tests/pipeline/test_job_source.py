"""infer and publish from a job ID: the aggregate fetched by CID through the running agent (real daemons,
or real agents on loopback with the submitter's control channel served in process)."""

from __future__ import annotations

import json

import pytest
import trio
import yaml

from tests.cli.conftest import cli, cli_json, daemons, small_spec, tiny_model_dir  # noqa: F401 - fixtures
from tests.cli.test_job_flow import _network

JOB_SPEC = """
name: card-test
description: |
  a job whose terms the model card states
base_model: infernet-tiny
seed: 3
input: {{dataset: "ipfs://{cid}", validation_split: 0.1}}
training: {{batch_size: 8, learning_rate: 0.01, max_steps: 8, max_seq_len: 96}}
lora: {{rank: 4, alpha: 8, target_modules: [q_proj, v_proj]}}
shards: 2
rounds: 1
proof: {{checkpoint_every: 4, verify_segments: 1, tolerance: 0.0001}}
lease_seconds: 60
budget: {{price_per_hour: 2.5, total: 10}}
"""


@pytest.mark.network
async def test_a_jobs_model_card_states_its_spec_from_the_terms(tmp_path, tiny_model_dir):  # noqa: F811
    """``publish --merged`` from a job ID: the card's spec is the job's terms (model, description, method,
    parameters, shards and rounds, dataset CID, price and budget), read through the control channel."""
    from agent import control
    from agent.harness.network import network
    from agent.pipeline.publish import write_merged
    from agent.pipeline.source import resolve_source
    from agent.train.data import write_chatml
    from agent.train.tiny import demo_records
    from protocol import state as st

    async with network(tmp_path / "n", tiny_model_dir, 2) as net, trio.open_nursery() as served:
        submitter = net.submitter
        data = tmp_path / "elsewhere.jsonl"
        write_chatml(data, demo_records(120, seed=5))
        cid = str(await net.workers[1].content.add_file(data))  # the dataset is already in IPFS, by CID
        spec = tmp_path / "spec" / "infernet.train.yml"
        spec.parent.mkdir()
        spec.write_text(JOB_SPEC.format(cid=cid))
        announced = await control._job_announce(submitter, str(spec))
        view = submitter.jobs[bytes.fromhex(announced["id"])]
        await submitter.wait_for(lambda: view.state.terminal, timeout=120)
        assert view.state.phase is st.JobPhase.DONE, view.state.reason
        home = submitter.config.home
        listener = control.bind_control_socket(home / "control.sock")
        served.start_soon(control.serve_control, submitter, listener)
        source = await trio.to_thread.run_sync(lambda: resolve_source(announced["id"][:12], home=home))
        text = source.provenance.spec_text
        assert text and announced["id"] in text
        terms = view.terms
        stated = yaml.safe_load(text)
        assert stated["name"] == "card-test" and stated["description"].startswith("a job whose terms")
        assert stated["base_model"] == "infernet-tiny" and stated["base_model_sha256"] == terms.base_model_sha256.hex()
        assert stated["input"] == {"dataset": f"ipfs://{cid}"} and stated["method"] == terms.method
        assert (stated["shards"], stated["rounds"], stated["seed"]) == (2, 1, 3)
        assert stated["training"] == terms.training.to_wire() and stated["lora"]["rank"] == 4
        assert stated["lora"]["target_modules"] == ["q_proj", "v_proj"]
        assert stated["budget"] == {"price_per_hour": 2.5, "total": 10.0}
        assert stated["aggregation"] == terms.aggregation and stated["lease_seconds"] == 60
        out = tmp_path / "merged"
        await trio.to_thread.run_sync(write_merged, source, out)
        card = (out / "README.md").read_text()
        assert "## Training spec" in card and f"ipfs://{cid}" in card and "price_per_hour: 2.5" in card
        assert json.loads((out / "infernet.json").read_text())["spec_text"] == text
        served.cancel_scope.cancel()


@pytest.mark.slow
def test_infer_and_publish_a_jobs_aggregate(tmp_path, daemons, tiny_model_dir):  # noqa: F811
    submitter = _network(tmp_path, daemons, tiny_model_dir, workers=2)
    home = str(submitter.home)
    job = cli_json("job", "announce", str(small_spec(tmp_path / "spec.yml")), "--home", home, timeout=180)
    watch = cli("job", "watch", job["id"][:12], "--home", home, "--json", "--interval", "0.5", "--timeout", "240",
                timeout=300)
    assert watch.returncode == 0, watch.stderr
    final = json.loads(watch.stdout.splitlines()[-1])
    answer = cli_json("infer", job["id"][:12], "--home", home, "--prompt", "Spell the word cat.",
                      "--temperature", "0", "--max-new-tokens", "8", timeout=180)
    adapter = submitter.home / "adapters" / f"{job['id'][:16]}-r{final['aggregates'][-1]['round']}"
    assert answer["adapter"] == str(adapter) and isinstance(answer["results"][0]["output"], str)
    out = tmp_path / "merged"
    done = cli("publish", job["id"][:12], "--home", home, "--merged", str(out), timeout=180)
    assert done.returncode == 0, done.stderr
    card = (out / "README.md").read_text()
    ledger = cli_json("job", "ledger", job["id"][:12], "--home", home)
    assert job["id"] in card and final["aggregates"][-1]["cid"] in card
    assert ledger["entries"][-1]["hash"] in card and "Dataset shard-0" in card
    provenance = json.loads((out / "infernet.json").read_text())
    assert provenance["job_id"] == job["id"] and provenance["base_model_sha256"]
    for daemon in daemons:
        assert daemon.terminate() == 0
