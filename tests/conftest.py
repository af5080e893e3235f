from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
IPIP_VECTORS = REPO_ROOT / "ipips" / "vectors"
SHARED_VECTORS = REPO_ROOT.parent / "shared" / "vectors"
