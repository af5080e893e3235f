"""Commands that need no running agent: init, data, train init, and the one-line errors."""

from __future__ import annotations

import json
import stat
import tomllib

import pytest

from agent.config import ConfigError, load_config
from agent.keyfile import load_identity
from protocol.unixfs import compute_cid
from tests.cli.conftest import assert_one_line_error, cli, cli_json


def test_version_and_help():
    done = cli("--version", check=True)
    assert done.stdout.startswith("infernet-agent ")
    assert "job" in cli("--help", check=True).stdout


def test_agent_init_writes_a_0600_key_and_a_commented_config_that_loads(tmp_path):
    home = tmp_path / "home"
    result = cli_json("agent", "init", "--home", str(home))
    assert set(result) >= {"home", "peer_id", "identity", "config", "created"} and result["created"]
    key = home / "identity.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert load_identity(key).peer_id == result["peer_id"]
    text = (home / "config.toml").read_text()
    assert text.count("#") > 15  # every key explained
    assert tomllib.loads(text)["accept_training"] is False
    config = load_config(home)
    assert config.home == home and config.accept_training is False
    again = cli_json("agent", "init", "--home", str(home))  # keeps the key
    assert again["peer_id"] == result["peer_id"] and not again["created"]


def test_bad_config_key_is_one_line(tmp_path):
    home = tmp_path / "home"
    cli("agent", "init", "--home", str(home), check=True)
    (home / "config.toml").write_text("acept_training = true\n")
    assert_one_line_error(cli("agent", "run", "--home", str(home)), "config.toml", "unknown key 'acept_training'")
    (home / "config.toml").write_text("threads = 'four'\n")
    assert_one_line_error(cli("agent", "run", "--home", str(home)), "threads", "expected an integer")


def test_every_config_key_is_checked_against_its_range_at_load(tmp_path):
    """Issue 17: heartbeat_seconds = 0 was a busy loop flooding peers (-1: internal error), and
    max_concurrent_shards = -1 was reported by its wire field; a metrics port out of range or in use
    was served elsewhere or blamed on the listen address. Each is one line naming file:line and key."""
    import socket

    home = tmp_path / "home"
    cli("agent", "init", "--home", str(home), check=True)
    config = home / "config.toml"
    for line, message in [("heartbeat_seconds = 0", "heartbeat_seconds: must be between 0.1 and 60 seconds, got 0"),
                          ("heartbeat_seconds = -1", "heartbeat_seconds: must be between 0.1 and 60 seconds, got -1"),
                          ("max_concurrent_shards = -1", "max_concurrent_shards: must be between 1 and 64, got -1"),
                          ("missed_heartbeats = 0", "missed_heartbeats: must be between 2 and 100, got 0"),
                          ("fetch_timeout = inf", "fetch_timeout: must be between 1 and 86400 seconds, got inf"),
                          ("listen = []", "listen: expected at least one multiaddr")]:
        config.write_text(f"# a comment\nthreads = 1\n{line}\n")
        with pytest.raises(ConfigError) as error:
            load_config(home)
        assert str(error.value).startswith(f"{config}:3: {message}"), str(error.value)
    config.write_text("threads = 1\n")
    with pytest.raises(ConfigError, match="^--max-concurrent-shards: must be between 1 and 64, got 0$"):
        load_config(home, max_concurrent_shards=0)
    config.write_text("threads = 1\nheartbeat_seconds = 0\n")  # and the CLI says it in one line
    assert_one_line_error(cli("agent", "run", "--home", str(home)),
                          f"{config}:2: heartbeat_seconds: must be between 0.1 and 60 seconds, got 0")
    config.write_text("threads = 1\n")
    assert_one_line_error(cli("agent", "run", "--home", str(home), "--metrics-port", "99999"),
                          "--metrics-port: must be between 0 and 65535, got 99999")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        done = cli("agent", "run", "--home", str(home), "--metrics-port", str(port), timeout=90)
        assert_one_line_error(done, f"--metrics-port {port}: cannot serve metrics on 127.0.0.1:{port}")
        assert "listen address" not in done.stderr
    finally:
        busy.close()


def test_agent_run_refuses_a_bad_multiaddr_and_a_missing_key(tmp_path):
    home = tmp_path / "home"
    assert_one_line_error(cli("agent", "run", "--home", str(home)), "no key file", "infernet agent init")
    cli("agent", "init", "--home", str(home), check=True)
    assert_one_line_error(cli("agent", "run", "--home", str(home), "--bootstrap", "/ip4/1.2.3.4/tcp/notaport"),
                          "bootstrap[0]")


def test_commands_that_need_a_daemon_say_so(tmp_path):
    for args in (("agent", "status"), ("peers",), ("job", "list"), ("job", "cancel", "abcd"),
                 ("job", "ledger", "abcd"), ("job", "watch", "abcd")):
        assert_one_line_error(cli(*args, "--home", str(tmp_path)), "no agent is running", "infernet agent run")


def test_data_add_prints_the_ipfs_cid_and_verify_checks_it(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"messages": []}\n' * 40000)  # > one 256 KiB chunk: a dag-pb root
    expected = compute_cid(path.read_bytes()).encode()
    done = cli("data", "add", str(path), check=True)
    assert done.stdout.strip() == expected and expected.startswith("bafy")
    assert cli_json("data", "add", str(path))["cid"] == expected
    assert "ok" in cli("data", "verify", str(path), expected, check=True).stdout
    other = compute_cid(b"something else").encode()
    done = cli("data", "verify", str(path), other)
    assert done.returncode == 1 and "does not match" in done.stderr
    assert_one_line_error(cli("data", "verify", str(path), "not-a-cid"))
    assert_one_line_error(cli("data", "add", str(tmp_path / "missing.jsonl")), "missing.jsonl")


def test_data_add_and_verify_refuse_devices_and_fifos_at_once(tmp_path):
    """Issue 17: /dev/zero or a FIFO was read forever; now one line, before anything opens it."""
    import os

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    some_cid = compute_cid(b"x").encode()
    for args in (("data", "add", "/dev/zero"), ("data", "verify", "/dev/zero", some_cid),
                 ("data", "add", str(fifo)), ("data", "verify", str(fifo), some_cid), ("data", "add", str(tmp_path))):
        assert_one_line_error(cli(*args, timeout=30), args[2], "not a regular file")


def test_train_init_writes_the_template_once(tmp_path):
    from agent.specfile import load_spec
    from protocol.jobspec import TEMPLATE

    done = cli("train", "init", "--output", str(tmp_path), check=True)
    path = tmp_path / "infernet.train.yml"
    assert path.read_text() == TEMPLATE and str(path) in done.stdout
    assert load_spec(path).name == "my-adapter"
    assert_one_line_error(cli("train", "init", "--output", str(tmp_path)), "already exists")


def test_bad_spec_is_one_line_naming_the_field(tmp_path):
    spec = tmp_path / "bad.yml"
    spec.write_text("name: x\nbase_model: m\ninput: {dataset: d.jsonl}\nshards: zero\n")
    assert_one_line_error(cli("job", "announce", str(spec), "--home", str(tmp_path)), "bad.yml", "shards")
    assert_one_line_error(cli("train", "run", "--local", "--config", str(spec)), "shards")
    assert_one_line_error(cli("job", "announce", str(tmp_path / "nope.yml"), "--home", str(tmp_path)), "nope.yml")


def test_train_run_local_trains_and_writes_the_run_layout(tmp_path, tiny_model_dir):
    from tests.cli.conftest import small_spec

    spec = small_spec(tmp_path / "infernet.train.yml", shards=1, steps=6)
    out = tmp_path / "run"
    result = cli_json("train", "run", "--local", "--config", str(spec), "--output", str(out), "--threads", "1",
                      "--preset", "auto", timeout=300)
    assert result["steps"] == 6 and result["validation_loss"] < result["initial_validation_loss"]
    used = json.loads((out / "train_config.json").read_text())
    if not result["environment"]["device"].startswith("cuda"):  # preset auto on a CPU keeps the spec's split
        assert used["micro_batch_size"] == used["batch_size"] and result["environment"]["micro_batch"] == used["batch_size"]
    for name in ("README.md", "metrics.jsonl", "proof.json", "train_config.json", "infernet.train.yml", "result.json"):
        assert (out / name).is_file(), name
    assert {p.name for p in (out / "checkpoint-final").iterdir()} == {
        "adapter_config.json", "adapter_model.safetensors", "optimizer.safetensors"}  # optimizer_state: carried
    assert json.loads((out / "result.json").read_text())["steps"] == 6


def test_train_run_local_refuses_an_untrainable_dataset_before_writing_anything(tmp_path):
    """Issue 17: an empty dataset, or one whose assistant turns are all empty, is one line naming the
    file, before the model is loaded; no run directory is left to block a rerun with the same --output."""
    from tests.cli.conftest import small_spec

    spec = small_spec(tmp_path / "infernet.train.yml", shards=1)
    data = tmp_path / "data.jsonl"
    out = tmp_path / "run"
    data.write_text("")
    assert_one_line_error(cli("train", "run", "--local", "--config", str(spec), "--output", str(out)),
                          f"{data}: no records")
    assert not out.exists()
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]}\n' * 4)
    assert_one_line_error(cli("train", "run", "--local", "--config", str(spec), "--output", str(out)),
                          f"{data}: the training split has no assistant text to learn from")
    assert not out.exists()
