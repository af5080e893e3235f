"""The reachability keys and flags (relay, announce) are checked like every other (issue 16)."""

from __future__ import annotations

import pytest

from agent.config import ConfigError, load_config
from tests.cli.conftest import assert_one_line_error, cli


def test_relay_and_announce_load_and_are_checked(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    config = home / "config.toml"
    config.write_text('relay = true\nannounce = ["/ip4/203.0.113.7/tcp/4001"]\n')
    loaded = load_config(home)
    assert loaded.relay is True and loaded.announce == ("/ip4/203.0.113.7/tcp/4001",)
    config.write_text('relay = "auto"\n')
    assert load_config(home).relay == "auto"
    config.write_text('threads = 1\n')
    assert load_config(home).relay == "auto"  # the default of an operator's agent (issue 16)
    assert load_config(home, relay=False).relay is False  # --relay false
    for line, message in [("relay = 1", 'relay: expected true, false or "auto", got 1'),
                          ("relay = 'yes'", 'relay: expected true, false or "auto", got \'yes\''),
                          ("announce = '/ip4/1.2.3.4/tcp/1'", "announce: expected a list, got str"),
                          ("announce = ['']", "announce: expected a list of non-empty strings")]:
        config.write_text(f"threads = 1\n{line}\n")
        with pytest.raises(ConfigError) as error:
            load_config(home)
        assert str(error.value) == f"{config}:2: {message}"


def test_a_bad_announce_address_is_one_line(tmp_path):
    home = tmp_path / "home"
    cli("agent", "init", "--home", str(home), check=True)
    assert_one_line_error(cli("agent", "run", "--home", str(home), "--announce", "/ip4/1.2.3.4/tcp/notaport"),
                          "announce[0]", "invalid multiaddr")
