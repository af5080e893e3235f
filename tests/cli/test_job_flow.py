"""A job through separate agent processes, driven by the CLI: announce, watch, fetch, ledger; and kill -9."""

from __future__ import annotations

import json
import time

import pytest

from tests.cli.conftest import Daemon, assert_one_line_error, cli, cli_json, model_config, small_spec
from tests.cli.test_ui import check_the_ui


def _network(tmp_path, daemons, model_dir, workers: int) -> Daemon:
    submitter = Daemon(tmp_path / "sub").init(model_config(model_dir, can_coordinate=False))
    daemons.append(submitter)
    submitter.start()
    bootstrap = submitter.addr
    for i in range(workers):
        worker = Daemon(tmp_path / f"w{i}", "--bootstrap", bootstrap).init(model_config(model_dir, accept_training=True))
        daemons.append(worker)
    for worker in daemons[1:]:
        worker.start()
    deadline = time.monotonic() + 60
    while cli_json("agent", "status", "--home", str(submitter.home))["peers"] < workers:
        assert time.monotonic() < deadline, "workers not heard within 60 s"
        time.sleep(0.5)
    return submitter


def test_job_announce_watch_fetch_between_agent_processes(tmp_path, daemons, tiny_model_dir):
    submitter = _network(tmp_path, daemons, tiny_model_dir, workers=2)  # one coordinates, one trains
    home = str(submitter.home)
    job = cli_json("job", "announce", str(small_spec(tmp_path / "spec.yml", rounds=2)), "--home", home, timeout=180)
    watch = cli("job", "watch", job["id"][:12], "--home", home, "--json", "--interval", "0.5", "--timeout", "240",
                timeout=300)
    assert watch.returncode == 0, watch.stderr
    states = [json.loads(line) for line in watch.stdout.splitlines()]
    assert states[-1]["state"] == "DONE" and len(states) > 2  # one line per change
    assert set(states[-1]) >= {"shard_states", "aggregates", "verdicts", "coordinator", "term"}
    assert {s["state"] for s in states[-1]["shard_states"]} == {"ACCEPTED"}
    # issue 27: the watch wrote the job's curves for TensorBoard (HOME/runs/JOB), read back with tensorboard's reader
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(submitter.home / "runs" / job["id"][:16]))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    rounds = len(states[-1]["aggregates"])
    assert {"validation/aggregate", "validation/base", "verdicts/accepted", "rounds/wall_seconds"} <= tags, tags
    assert [s.step for s in events.Scalars("validation/aggregate")] == list(range(1, rounds + 1))
    curves = [t for t in tags if t.startswith("train_loss/shard")]
    assert curves and all(len(events.Scalars(t)) >= 2 for t in curves)  # checkpoint losses, per shard and worker

    out = tmp_path / "adapter"
    fetched = cli_json("job", "fetch", job["id"][:12], "--out", str(out), "--home", home, timeout=120)
    assert fetched["cid"] == states[-1]["aggregates"][-1]["cid"] and fetched["final"]
    # the adapter, and the averaged AdamW state the job carried (to continue training; peft ignores it)
    # and the job it came from (issue 25: the base model's hash travels with the adapter)
    assert {p.name for p in out.iterdir()} == {"adapter_config.json", "adapter_model.safetensors",
                                               "optimizer.safetensors", "infernet-job.json"}
    from agent.train.tiny import tiny_model

    assert_one_line_error(cli("infer", str(out), "--base", str(tiny_model(seed=1)), "--prompt", "hi"),
                          "adapter/base mismatch", "sha256")
    ledger = cli_json("job", "ledger", job["id"][:12], "--home", home)
    assert ledger["verified"] and "done" in [e["kind"] for e in ledger["entries"]]
    # issue 14: the ledger of every participant, exported and checked without an agent; job show's facts;
    # any CID fetched through a running agent
    exported = tmp_path / "ledger.json"
    synced = cli_json("job", "ledger", job["id"][:12], "--home", home, "--sync", "--export", str(exported))
    assert synced["exported"]["chains"] >= 2 and not synced["conflicts"]
    assert cli_json("ledger", "verify", str(exported))["entries"] == synced["exported"]["entries"]
    # issue 25: an existing file is never overwritten by an export (one line, exit 1, the file kept)
    before = exported.read_bytes()
    again = cli("job", "ledger", job["id"][:12], "--home", home, "--export", str(exported))
    assert again.returncode == 1 and "already exists" in again.stderr and exported.read_bytes() == before
    shown = cli("job", "show", job["id"][:12], "--home", home)
    assert shown.returncode == 0 and "cost so far" in shown.stdout and "model sha256" in shown.stdout, shown.stderr
    detail = cli_json("job", "show", job["id"][:12], "--home", home)
    shard = detail["shard_cids"][0]
    got = cli_json("data", "get", shard["cid"], "--out", str(tmp_path / "shard0.jsonl"),
                   "--home", str(daemons[-1].home))
    assert got["size"] == shard["size"] == (tmp_path / "shard0.jsonl").stat().st_size
    listed = cli_json("job", "list", "--home", home)
    assert listed[0]["state"] == "DONE"
    check_the_ui(tmp_path, home, job)  # `infernet ui` on this network (issue 27)
    for daemon in daemons:
        assert daemon.terminate() == 0


@pytest.mark.slow
def test_worker_killed_with_sigkill_restarts_from_its_home_and_the_job_completes(tmp_path, daemons, tiny_model_dir):
    submitter = _network(tmp_path, daemons, tiny_model_dir, workers=3)
    home = str(submitter.home)
    spec = small_spec(tmp_path / "spec.yml", shards=3, rounds=2, steps=24)
    job = cli_json("job", "announce", str(spec), "--home", home, timeout=180)
    # wait for accepted work, then kill -9 a worker that holds an accepted report or a lease
    deadline = time.monotonic() + 180
    while True:
        detail = cli_json("job", "show", job["id"][:12], "--home", home)
        accepted = [s for s in detail["shard_states"] if s["state"] == "ACCEPTED"]
        leased = [s for s in detail["shard_states"] if s["state"] == "LEASED"]
        if accepted and leased:
            break
        assert time.monotonic() < deadline, detail
        time.sleep(0.5)
    victim_peer = leased[0]["worker"]
    victim = next(d for d in daemons[1:] if cli_json("agent", "status", "--home", str(d.home))["peer_id"] == victim_peer)
    accepted_before = {(detail["round"], s["index"]): s["worker"] for s in accepted}
    victim.kill9()
    victim.start()  # same home: same identity, same store
    watch = cli("job", "watch", job["id"][:12], "--home", home, "--json", "--interval", "1", "--timeout", "300",
                timeout=360)
    assert watch.returncode == 0, watch.stdout[-2000:]
    final = json.loads(watch.stdout.splitlines()[-1])
    assert final["state"] == "DONE"
    log = (victim.home / "agent.log").read_text()
    assert "resumed from the store" in log  # the restarted worker rebuilt the job from its SQLite store
    from agent.store import Store
    from agent.keyfile import load_identity

    store = Store.in_data_dir(submitter.home, load_identity(submitter.home / "identity.key"))
    verdicts = [v.message for v in store.verdicts(bytes.fromhex(job["id"]))]
    store.close()
    for (rnd, shard), worker in accepted_before.items():  # accepted work stayed accepted, never redone
        accepted = [v for v in verdicts if (v.round, v.shard) == (rnd, shard) and v.accepted]
        assert [v.worker for v in accepted] == [worker]


@pytest.mark.slow
def test_sigterm_mid_shard_releases_the_lease_and_exits_0(tmp_path, daemons, tiny_model_dir):
    submitter = _network(tmp_path, daemons, tiny_model_dir, workers=3)
    home = str(submitter.home)
    spec = small_spec(tmp_path / "spec.yml", shards=2, rounds=1, steps=200)
    text = spec.read_text().replace("lease_seconds: 60", "lease_seconds: 3600")  # only a release reopens it soon
    spec.write_text(text)
    job = cli_json("job", "announce", str(spec), "--home", home, timeout=180)
    deadline = time.monotonic() + 120
    while True:
        detail = cli_json("job", "show", job["id"][:12], "--home", home)
        leased = [s for s in detail["shard_states"] if s["state"] == "LEASED" and s["step"] > 0]
        if leased:
            break
        assert time.monotonic() < deadline, detail
        time.sleep(0.3)
    shard = leased[0]["index"]
    victim = next(d for d in daemons[1:]
                  if cli_json("agent", "status", "--home", str(d.home))["peer_id"] == leased[0]["worker"])
    assert victim.terminate() == 0
    assert not (victim.home / "control.sock").exists()
    deadline = time.monotonic() + 60
    while cli_json("job", "show", job["id"][:12], "--home", home)["shard_states"][shard]["attempt"] < 2:
        assert time.monotonic() < deadline, "the shard was not reopened by a release"
        time.sleep(0.5)
