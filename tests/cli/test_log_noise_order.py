"""The agent's log setup holds py-libp2p's records even when py-libp2p is first imported after it."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_libp2p_records_do_not_reach_stderr_when_libp2p_is_imported_after_the_log_setup() -> None:
    code = textwrap.dedent("""
        import io, logging, sys
        from agent.daemon import setup_logging
        log = io.StringIO()
        setup_logging(log)
        import libp2p.kad_dht.kad_dht  # first import of py-libp2p after the setup (harness run does this)
        logging.getLogger("libp2p.kad_dht.kad_dht").warning("Failed to read DHT message from stream: ")
        logging.getLogger("libp2p.relay").error("a real py-libp2p error")
        sys.stdout.write(log.getvalue())
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Failed to read DHT" not in done.stderr and "a real py-libp2p error" not in done.stderr
    assert "a real py-libp2p error" in done.stdout      # kept, in the agent's JSON log
    assert "Failed to read DHT" not in done.stdout      # noise: demoted to DEBUG, out of the default log
