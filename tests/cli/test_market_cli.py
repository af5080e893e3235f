"""The market through the CLI: providers, models, job estimate, a paid announce that asks first, job bill."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import time

from tests.cli.conftest import REPO, Daemon, assert_one_line_error, cli, cli_json, model_config, small_spec


def _at_a_terminal(args: list[str], answer: str) -> subprocess.CompletedProcess:
    """``infernet ARGS`` with a pseudo-terminal as its stdin, ``answer`` typed into it."""
    master, slave = pty.openpty()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        process = subprocess.Popen([sys.executable, "-m", "agent.cli", *args], stdin=slave, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
        os.write(master, answer.encode())
        out, err = process.communicate(timeout=180)
    finally:
        os.close(master)
        os.close(slave)
    return subprocess.CompletedProcess(args, process.returncode, out, err)


def test_providers_models_estimate_announce_and_bill(tmp_path, daemons, tiny_model_dir):
    submitter = Daemon(tmp_path / "sub").init(model_config(tiny_model_dir, can_coordinate=False))
    daemons.append(submitter)
    submitter.start()
    home = str(submitter.home)
    worker = Daemon(tmp_path / "w0", "--bootstrap", submitter.addr).init(
        model_config(tiny_model_dir, accept_training=True))  # measure_speed defaults to true for `agent run`
    daemons.append(worker)
    worker_id = worker.start()["peer_id"]

    deadline = time.monotonic() + 90  # the worker measures its speed with a short burst, then re-advertises
    while True:
        providers = cli_json("providers", "--home", home)
        if providers and providers[0]["speeds"]:
            break
        assert time.monotonic() < deadline, providers
        time.sleep(1)
    (row,) = providers
    assert row["peer_id"] == worker_id and row["accepts_training"] and row["runtimes"] == ["peft"]
    assert [m["name"] for m in row["models"]] == ["infernet-tiny"] and row["busy"] is False
    assert row["reputation"] == {"accepted": 0, "rejected": 0, "expired": 0, "score": 0.5}
    speed = row["speeds"][0]["tokens_per_s"]
    assert speed > 0 and row["speeds"][0]["sha256"] == row["models"][0]["sha256"]
    assert "tokens/s" in cli("providers", "--home", home, check=True).stdout
    (model,) = cli_json("models", "--home", home)
    assert model == {"name": "infernet-tiny", "sha256": row["models"][0]["sha256"], "providers": 1, "training": 1,
                     "tokens_per_s": [speed]}

    spec = small_spec(tmp_path / "spec.yml")
    spec.write_text(spec.read_text() + "budget: {price_per_hour: 7.5, total: 0.5}\n")
    estimate = cli_json("job", "estimate", str(spec), "--home", home, timeout=180)
    assert estimate["tokens"] > 0 and estimate["steps"] == 16 and estimate["tokens_per_s"] == speed
    assert abs(estimate["cost"] - estimate["worker_hours"] * 7.5) < 1e-9
    text = cli("job", "estimate", str(spec), "--home", home, check=True, timeout=180).stdout
    assert "worker-hours" in text and "at 7.5/h" in text

    # at a terminal, announce shows the estimate and asks; anything but y announces nothing
    asked = _at_a_terminal(["job", "announce", str(spec), "--home", home], answer="n\n")
    assert asked.returncode == 1 and "worker-hours" in asked.stderr and "announce this job? [y/N]" in asked.stdout
    assert asked.stderr.strip().splitlines()[-1] == "infernet: not announced (answer y to announce, or pass --yes)"
    assert cli_json("job", "list", "--home", home) == []
    # a paid job is announced only once someone confirmed its cost: no terminal and no --yes is refused
    assert_one_line_error(cli("job", "announce", str(spec), "--home", home), "paid job", "--yes")
    assert_one_line_error(cli("job", "announce", str(spec), "--home", home, "--yes", "--provider", "nobody"),
                          "--provider", "not a peer ID")
    assert_one_line_error(cli("job", "announce", str(spec), "--home", home, "--yes", "--max-nodes", "0"),
                          "--max-nodes")
    # one worker and a submitter that does not coordinate: the worker would coordinate and train nothing
    assert_one_line_error(cli("job", "announce", str(spec), "--home", home, "--yes", timeout=180),
                          "not announced", "also the only one that can coordinate")
    job = cli_json("job", "announce", str(spec), "--home", home, "--yes", "--max-nodes", "1",
                   "--provider", worker_id, "--wait", timeout=180)
    shown = cli_json("job", "show", job["id"][:12], "--home", home)
    assert shown["budget"]["max_nodes"] == 1 and shown["budget"]["providers"] == [worker_id]
    assert shown["budget"]["paid"] and shown["budget"]["leasing_stopped"] is None
    cli("job", "cancel", job["id"][:12], "--home", home, check=True)

    # nothing was accepted: a bill of 0, signed by the submitter, consistent with its ledger
    bill = cli_json("job", "bill", job["id"][:12], "--home", home)
    status = cli_json("agent", "status", "--home", home)
    assert bill["total"] == 0 and bill["workers"] == [] and bill["signer"] == status["peer_id"]
    assert bill["ledger"]["consistent"] and len(bill["signature"]) == 128
    assert "total" in cli("job", "bill", job["id"][:12], "--home", home, check=True).stdout
    ledger = cli_json("job", "ledger", job["id"][:12], "--home", home)
    assert ledger["verified"] and [e["kind"] for e in ledger["entries"]] == ["announced", "cancel", "bill"]
    assert_one_line_error(cli("job", "bill", "abcdef12", "--home", home), "unknown job")
    for daemon in daemons:
        assert daemon.terminate() == 0
