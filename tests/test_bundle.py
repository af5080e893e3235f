"""agent/bundle.py: deterministic packing, and unpacking of UNTRUSTED tar bytes."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from agent.bundle import ADAPTER_FILES, BundleError, pack_dir, unpack


def _entry(name: str, data: bytes = b"x", *, type: bytes = tarfile.REGTYPE, linkname: str = "") -> tuple:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = type, linkname
    info.size = len(data) if type in (tarfile.REGTYPE, tarfile.AREGTYPE) else 0
    return info, data


def _tar(path: Path, entries: list[tuple], fmt: int = tarfile.GNU_FORMAT) -> Path:
    with tarfile.open(path, "w", format=fmt) as tar:
        for info, data in entries:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return path


def _refused(tmp_path: Path, bundle: Path, match: str, **kw) -> None:
    out = tmp_path / "out"
    with pytest.raises(BundleError, match=match) as err:
        unpack(bundle, out, **kw)
    assert bundle.name in str(err.value) and "\n" not in str(err.value)
    assert not out.exists(), "a refused bundle leaves nothing behind"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], "no staging left"
    assert not (tmp_path.parent / "x").exists() and not (tmp_path / "x").exists()


def test_pack_is_deterministic_and_round_trips(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "adapter_model.safetensors").write_bytes(b"\0" * 1000)
    (src / "adapter_config.json").write_text("{}")
    (src / ".hidden").write_text("not packed")
    a = pack_dir(src, tmp_path / "a.tar").read_bytes()
    (src / "adapter_config.json").touch()  # mtime changes nothing
    assert pack_dir(src, tmp_path / "b.tar").read_bytes() == a
    out = unpack(tmp_path / "a.tar", tmp_path / "out", allowed=ADAPTER_FILES)
    assert sorted(p.name for p in out.iterdir()) == sorted(ADAPTER_FILES)
    assert (out / "adapter_model.safetensors").read_bytes() == b"\0" * 1000


@pytest.mark.parametrize("name", ["../x", "a/../../x", "/tmp/x", "sub/x", "..", ".", ".x", "a\\x", ""])
def test_names_that_are_not_plain_file_names_are_refused(tmp_path, name):
    _refused(tmp_path, _tar(tmp_path / "b.tar", [_entry(name)]), "not a plain file name|not a regular file")


@pytest.mark.parametrize("entry, match", [
    (_entry("x", type=tarfile.SYMTYPE, linkname="/etc/passwd"), "not a regular file"),
    (_entry("x", type=tarfile.LNKTYPE, linkname="adapter_config.json"), "not a regular file"),
    (_entry("x", type=tarfile.CHRTYPE), "not a regular file"),
    (_entry("x", type=tarfile.BLKTYPE), "not a regular file"),
    (_entry("x", type=tarfile.FIFOTYPE), "not a regular file"),
    (_entry("x", type=tarfile.DIRTYPE), "not a regular file"),
    (_entry("x", type=tarfile.CONTTYPE), "not a regular file"),
])
def test_links_devices_and_directories_are_refused(tmp_path, entry, match):
    _refused(tmp_path, _tar(tmp_path / "b.tar", [_entry("adapter_config.json"), entry]), match)


def test_a_link_then_a_file_through_it_is_refused(tmp_path):
    bundle = _tar(tmp_path / "b.tar", [_entry("x", type=tarfile.SYMTYPE, linkname=".."), _entry("x/evil")])
    _refused(tmp_path, bundle, "not a regular file")


def test_duplicate_names_are_refused(tmp_path):
    bundle = _tar(tmp_path / "b.tar", [_entry("adapter_config.json", b"a"), _entry("adapter_config.json", b"b")])
    _refused(tmp_path, bundle, "appears twice")


def test_names_not_allowed_are_refused(tmp_path):
    bundle = _tar(tmp_path / "b.tar", [_entry("adapter_config.json"), _entry("run.py", b"import os")])
    _refused(tmp_path, bundle, "unexpected entry 'run.py'", allowed=ADAPTER_FILES)


def test_the_size_cap_counts_every_entry(tmp_path):
    bundle = _tar(tmp_path / "b.tar", [_entry("adapter_config.json", b"a" * 600),
                                        _entry("adapter_model.safetensors", b"b" * 600)])
    _refused(tmp_path, bundle, "larger than 1000 bytes", max_bytes=1000)
    assert unpack(bundle, tmp_path / "ok", max_bytes=1200).is_dir()


def test_a_gnu_sparse_entry_is_refused(tmp_path):
    info, _ = _entry("adapter_model.safetensors")
    info.type = tarfile.GNUTYPE_SPARSE  # tarfile counts it as a regular file; the packer never writes one
    _refused(tmp_path, _tar(tmp_path / "b.tar", [(info, b"x")]), "not a regular file")


def test_truncated_tars_are_refused(tmp_path):
    whole = _tar(tmp_path / "whole.tar", [_entry("adapter_config.json", b"{}" * 400),
                                          _entry("adapter_model.safetensors", b"w" * 5000)]).read_bytes()
    (tmp_path / "whole.tar").unlink()
    bundle = tmp_path / "b.tar"
    # in a header, in data, between entries (tarfile alone ends there silently), before the end marker
    for cut in (100, 512 + 300, 512 + 1024 + 512 + 2000, 512 + 1024 + 100, 512 + 1024, 512 + 1024 + 512 + 5120):
        bundle.write_bytes(whole[:cut])
        _refused(tmp_path, bundle, "truncated|malformed|not a tar")
    bundle.write_bytes(whole + b"#!/bin/sh")
    _refused(tmp_path, bundle, "bytes after its last entry")


def test_not_a_tar_and_an_empty_tar_are_refused(tmp_path):
    bundle = tmp_path / "b.tar"
    bundle.write_bytes(b"{\"not\": \"a tar\"}" * 100)
    _refused(tmp_path, bundle, "not a tar|malformed|holds no files")
    bundle.write_bytes(b"\0" * 10240)  # a well-formed tar with no entries
    _refused(tmp_path, bundle, "holds no files")


def test_an_existing_out_dir_is_replaced_only_by_a_good_bundle(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.bin").write_text("from an earlier unpack")
    bad = _tar(tmp_path / "bad.tar", [_entry("../x")])
    with pytest.raises(BundleError):
        unpack(bad, out)
    assert (out / "stale.bin").exists(), "a refused bundle leaves the earlier contents alone"
    good = _tar(tmp_path / "good.tar", [_entry("adapter_config.json", b"{}")])
    assert unpack(good, out) == out
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json"]


def test_an_out_path_that_is_a_link_or_a_file_is_refused(tmp_path):
    good = _tar(tmp_path / "good.tar", [_entry("adapter_config.json", b"{}")])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("keep")
    (tmp_path / "link").symlink_to(elsewhere)
    with pytest.raises(BundleError, match="not a directory"):
        unpack(good, tmp_path / "link")
    assert (elsewhere / "keep").exists()
    (tmp_path / "file").write_text("keep")
    with pytest.raises(BundleError, match="not a directory"):
        unpack(good, tmp_path / "file")
    assert (tmp_path / "file").read_text() == "keep"


def test_bundle_size_bound_covers_the_largest_bundle_unpack_accepts(tmp_path):
    from agent.bundle import bundle_size_bound

    src = tmp_path / "src"
    src.mkdir()
    (src / "adapter_config.json").write_bytes(b"c" * 1)  # sizes that leave the most padding
    (src / "adapter_model.safetensors").write_bytes(b"m" * (20000 - 1))
    size = pack_dir(src, tmp_path / "b.tar").stat().st_size
    assert unpack(tmp_path / "b.tar", tmp_path / "out", allowed=ADAPTER_FILES, max_bytes=20000).is_dir()
    assert size <= bundle_size_bound(20000, ADAPTER_FILES)


def test_our_full_disk_is_our_failure_not_a_bad_bundle(tmp_path):
    """A verifier whose disk fills while it unpacks a worker's bundle must not call the bundle bad (a BundleError
    is a verdict against its worker): the demo on a 600 MB disk rejected two honest reports so. A real full disk:
    a tmpfs (root only)."""
    import errno
    from tests.conftest import fill_disk, tmpfs

    src = tmp_path / "src"
    src.mkdir()
    (src / "adapter_config.json").write_text("{}")
    (src / "adapter_model.safetensors").write_bytes(os.urandom(1 << 20))
    bundle = pack_dir(src, tmp_path / "a.tar")
    small = tmp_path / "small"
    small.mkdir()
    with tmpfs(small, "2m"):
        fill_disk(small / "filler")
        with pytest.raises(OSError) as raised:
            unpack(bundle, small / "out", allowed=ADAPTER_FILES)
        assert not isinstance(raised.value, BundleError) and raised.value.errno == errno.ENOSPC, raised.value
        assert not (small / "out").exists()
        (small / "filler").unlink()
        assert (unpack(bundle, small / "out", allowed=ADAPTER_FILES) / "adapter_model.safetensors").stat().st_size == 1 << 20
