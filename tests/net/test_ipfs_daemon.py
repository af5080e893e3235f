"""The IPFS daemon backend, against a real Kubo daemon named by INFERNET_IPFS_API.

Example: INFERNET_IPFS_API=/ip4/127.0.0.1/tcp/5001 (skipped when unset: no daemon on CI).
"""

import os

import pytest
import trio

from agent.content.service import open_content
from protocol.unixfs import compute_cid
from tests.net.conftest import agents

API = os.environ.get("INFERNET_IPFS_API")
pytestmark = [pytest.mark.ipfs_daemon,
              pytest.mark.skipif(not API, reason="INFERNET_IPFS_API is not set (no IPFS daemon to test against)")]


async def test_add_and_fetch_through_the_daemon_are_hash_checked(tmp_path):
    data = os.urandom(3 * 1024 * 1024 + 7)
    source = tmp_path / "data.bin"
    source.write_bytes(data)
    async with agents(2) as (a, b):
        async with open_content(a.host, a.discovery, tmp_path / "a", ipfs_api=API) as a_content, \
                open_content(b.host, b.discovery, tmp_path / "b", ipfs_api=API) as b_content:
            assert await a_content.ipfs.version()
            root = await a_content.add_file(source, provide=False)  # the daemon's CID must equal ours
            assert root == compute_cid(data)
            out = tmp_path / "out.bin"
            with trio.fail_after(120):  # no peer provides it: every block comes from the daemon
                report = await b_content.fetch(root, out, use_dht=False)
            assert out.read_bytes() == data and report.providers_used == ["ipfs-daemon"]
