from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
IPIP_VECTORS = REPO_ROOT / "ipips" / "vectors"
SHARED_VECTORS = REPO_ROOT.parent / "shared" / "vectors"


def fill_disk(path: Path) -> None:
    """Write zeros to ``path`` until its file system is full (unbuffered: nothing is left to flush)."""
    with open(path, "wb", buffering=0) as filler:
        try:
            while True:
                filler.write(b"\0" * 65536)
        except OSError:
            pass


@contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A real small disk: a tmpfs of ``size`` (``2m``) mounted on ``path`` (an empty directory) while the block
    runs, unmounted after; the test is skipped where it cannot be mounted (not root)."""
    import subprocess

    import pytest

    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
