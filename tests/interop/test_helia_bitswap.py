"""Bitswap between our agent and Helia (JS IPFS, js-libp2p): each side fetches the other's file by CID.

The Helia peer is interop/helia/helia_peer.mjs (TCP + Noise + Yamux + identify, Bitswap as the
only block broker, no DHT): it dials or is dialed by one of our agents on loopback, so these tests
prove the handshake (multistream-select, Noise, Yamux) and Bitswap 1.2.0 between py-libp2p and
js-libp2p, and that CIDs agree with Kubo's layout. They need Node.js >= 20 and the pinned packages
(`cd interop/helia && npm ci`); without them they are skipped with that reason.
Every wait has a deadline; every Node process is killed when its test ends.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from agent.content.service import VIA_AUTO, VIA_BITSWAP
from protocol.unixfs import compute_cid, import_file
from tests.net.conftest import agents_with_content

HELIA_DIR = Path(__file__).resolve().parents[2] / "interop" / "helia"
SCRIPT = HELIA_DIR / "helia_peer.mjs"
MiB = 1024 * 1024
SIZE = 3 * MiB + 12345  # 13 chunks of 256 KiB (the last one short): a two-level DAG

pytestmark = [pytest.mark.interop, pytest.mark.network]


def _node_or_skip() -> str:
    node = shutil.which("node")
    if node is None:
        pytest.skip("Helia interop needs Node.js >= 20: `node` is not on PATH")
    version = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    if int(version.lstrip("v").split(".")[0]) < 20:
        pytest.skip(f"Helia interop needs Node.js >= 20, found {version}")
    if not (HELIA_DIR / "node_modules").is_dir():
        pytest.skip("Helia interop needs its packages: run `cd interop/helia && npm ci` (or `make interop`)")
    return node


@pytest.fixture
def node() -> str:
    return _node_or_skip()


@pytest.fixture
def random_file(tmp_path) -> tuple[Path, bytes]:
    data = os.urandom(SIZE)
    path = tmp_path / "random.bin"
    path.write_bytes(data)
    return path, data


@asynccontextmanager
async def helia_serving(node: str, path: Path, layout: str, log: Path) -> AsyncIterator[dict]:
    """A Helia peer that has added ``path`` and serves it; yields its {cid, peerId, addrs}; killed on exit."""
    with open(log, "wb") as stderr:
        proc = await trio.lowlevel.open_process(
            [node, str(SCRIPT), "serve-add", str(path), "--layout", layout], cwd=HELIA_DIR,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr)
        try:
            line = b""
            with trio.fail_after(60):  # Node start-up plus the import of a few MiB
                while b"\n" not in line:
                    chunk = await proc.stdout.receive_some(4096)
                    if not chunk:
                        raise AssertionError(f"the Helia peer exited before printing its CID: {log.read_text()[-2000:]}")
                    line += chunk
            info = json.loads(line.split(b"\n")[0])
            assert "error" not in info, info["error"]
            yield info
        finally:
            proc.kill()
            with trio.move_on_after(10):
                await proc.wait()


async def helia_fetch(node: str, cid: str, addr: str, log: Path, *, timeout: float = 60) -> dict:
    """Run a Helia peer that dials ``addr`` and cats ``cid``; its {sha256, size, seconds} or {error}."""
    with open(log, "wb") as stderr, trio.fail_after(timeout + 30):  # cancelling run_process kills it
        result = await trio.run_process(
            [node, str(SCRIPT), "fetch", cid, addr, "--timeout", str(timeout)], cwd=HELIA_DIR,
            stdin=subprocess.DEVNULL, capture_stdout=True, stderr=stderr, check=False)
    lines = result.stdout.decode().strip().splitlines()
    assert lines, f"the Helia peer printed nothing (exit {result.returncode}): {log.read_text()[-2000:]}"
    return json.loads(lines[-1])


@pytest.mark.parametrize("cid_version", [1, 0])
async def test_helia_fetches_a_file_our_agent_serves(tmp_path, node, random_file, cid_version):
    path, data = random_file
    async with agents_with_content(1, tmp_path) as [(agent, content)]:
        if cid_version == 1:
            root = await content.add_file(path, provide=False)
        else:  # CIDv0 (dag-pb leaves): their Bitswap block prefixes differ from CIDv1's
            with open(path, "rb") as fh:
                root = import_file(fh, cid_version=0, on_block=lambda b: content.store.put(b.cid, b.data))
        assert root == compute_cid(data, cid_version=cid_version)
        got = await helia_fetch(node, str(root), agent.host.addrs()[0], tmp_path / "helia.log")
    assert "error" not in got, got["error"]
    assert got["size"] == len(data) and got["sha256"] == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("layout", ["kubo", "kubo-v0", "helia"])
async def test_our_agent_fetches_a_file_helia_adds(tmp_path, node, random_file, layout):
    """Kubo's layout (256 KiB chunks, 174 links) as CIDv1 raw leaves (``ipfs add --cid-version=1``) and
    as CIDv0 dag-pb leaves (plain ``ipfs add``); and @helia/unixfs's own defaults (1 MiB, 1024 links)."""
    path, data = random_file
    async with agents_with_content(1, tmp_path) as [(agent, content)], \
            helia_serving(node, path, layout, tmp_path / "helia.log") as helia:
        # the same bytes get our CID exactly when Helia builds Kubo's layout
        if layout == "kubo":
            assert helia["cid"] == str(compute_cid(data))
        elif layout == "kubo-v0":
            assert helia["cid"] == str(compute_cid(data, cid_version=0))
        else:
            assert helia["cid"] != str(compute_cid(data))
        out = tmp_path / "out.bin"
        with trio.fail_after(60):
            report = await content.fetch(helia["cid"], out, providers=[helia["addrs"][0]],
                                         via=VIA_BITSWAP, use_dht=False)
        assert out.read_bytes() == data
        assert report.providers_used == [helia["peerId"]] and report.size == len(data)


async def test_a_default_fetch_from_helia_serving_alone_falls_back_to_bitswap(tmp_path, node, random_file):
    """Helia is the only provider and does not speak /infernet/blocks/1.0.0: a fetch with no ``via``
    (what every role calls) must not fail on the refused negotiation but go on over Bitswap, within
    its deadline and size bound; the next fetch from it goes to Bitswap at once."""
    path, data = random_file
    async with agents_with_content(1, tmp_path) as [(agent, content)], \
            helia_serving(node, path, "kubo", tmp_path / "helia.log") as helia:
        with trio.fail_after(60):
            report = await content.fetch(helia["cid"], tmp_path / "out.bin", providers=[helia["addrs"][0]],
                                         use_dht=False, max_size=len(data), timeout=50)
        assert (tmp_path / "out.bin").read_bytes() == data
        assert report.protocols == {helia["peerId"]: VIA_BITSWAP} and report.attempts == []
        assert content._protocol_for(helia["peerId"], VIA_AUTO) == VIA_BITSWAP


async def test_an_empty_file_and_a_one_block_file_go_both_ways(tmp_path, node):
    """Edge layouts: a file that is its one raw leaf, and the empty file (one empty raw leaf)."""
    for name, data in [("empty", b""), ("small", b"hello bitswap\n")]:
        path = tmp_path / f"{name}.bin"
        path.write_bytes(data)
        async with agents_with_content(2, tmp_path / name) as [(a, a_content), (_, b_content)]:
            root = await a_content.add_bytes(data, provide=False)
            got = await helia_fetch(node, str(root), a.host.addrs()[0], tmp_path / f"{name}-fetch.log")
            assert got.get("sha256") == hashlib.sha256(data).hexdigest(), got
            async with helia_serving(node, path, "kubo", tmp_path / f"{name}-serve.log") as helia:
                assert helia["cid"] == str(root)
                with trio.fail_after(30):
                    report = await b_content.fetch(helia["cid"], tmp_path / f"{name}.out",
                                                   providers=[helia["addrs"][0]], via=VIA_BITSWAP, use_dht=False)
            assert (tmp_path / f"{name}.out").read_bytes() == data
            assert report.providers_used == [helia["peerId"]]
