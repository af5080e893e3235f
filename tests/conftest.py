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
