"""What ``infernet infer`` and ``infernet publish`` start from: a trained adapter and its base model.

Rules of this file:
- A source is one of: a run directory of ``train run --local`` (it has ``checkpoint-final/``), an
  adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``, as ``job fetch``
  writes), or a job ID (hex prefix), whose aggregate is fetched by its CID through the running
  agent (the control channel's ``job.fetch``) into ``HOME/adapters/JOBID-rROUND`` once, then reused.
- The base model comes from ``--base DIR`` if given, else from what the source records (the run's
  ``train_config.json``, the job's ``base_model``, the adapter's ``base_model_name_or_path``);
  ``infernet-tiny`` is the built-in tiny model, a name configured in the agent's ``[models]`` table
  is that directory. The base's sha256 is checked against the one the run's proof or the job spec
  names, when either does, before any weights load: the wrong base is a one-line PipelineError.
- Everything known about where the adapter came from (spec text, dataset CIDs, proof head, ledger
  head, validation losses) is gathered into ``Provenance`` for the model card; unknown is None.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TINY_MODEL_NAME = "infernet-tiny"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
_JOB_ID = re.compile(r"[0-9a-fA-F]{4,64}")


class PipelineError(Exception):
    """A mistake the user can fix (bad source, wrong base, missing tool); ``str()`` is the one line."""


@dataclass
class Provenance:
    kind: str  # "run", "adapter" or "job"
    name: str
    spec_text: str | None = None
    job_id: str | None = None
    round: int | None = None
    aggregate_cid: str | None = None
    dataset_cids: dict[str, str] = field(default_factory=dict)
    proof_head: str | None = None
    ledger_head: str | None = None
    ledger_entries: int | None = None
    validation_loss: float | None = None
    base_validation_loss: float | None = None
    final_loss: float | None = None
    steps: int | None = None
    base_model_name: str | None = None
    base_model_sha256: str | None = None

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Source:
    adapter_dir: Path
    base_dir: Path
    provenance: Provenance
    run_dir: Path | None = None


def _is_adapter_dir(path: Path) -> bool:
    """An adapter directory, or the model directory a full fine-tuning job's fetch writes
    (agent/train/model.as_model_dir)."""
    from agent.train.model import FULL_MARKER_FILE

    if (path / FULL_MARKER_FILE).is_file() and (path / "model.safetensors").is_file():
        return True
    return all((path / name).is_file() for name in ADAPTER_FILES)


def resolve_source(text: str, *, base: Path | None = None, home: Path | None = None,
                   check_hash: bool = True) -> Source:
    """The adapter and base model ``text`` names (see the module docstring)."""
    path = Path(text).expanduser()
    if path.exists():
        path = path.resolve()
        if (path / "checkpoint-final").is_dir():
            source = _from_run(path)
        elif _is_adapter_dir(path):
            source = _from_adapter(path)
        elif path.is_dir():
            raise PipelineError(f"{path}: neither a run directory (no checkpoint-final/) nor an adapter directory "
                                f"(no {' + '.join(ADAPTER_FILES)})")
        else:
            raise PipelineError(f"{path}: a file; give a run directory, an adapter directory or a job ID")
    elif _JOB_ID.fullmatch(text):
        source = _from_job(text, home)
    elif text.startswith(("Qm", "bafy", "bafk", "baf")):
        from protocol.cid import parse_cid

        try:
            parse_cid(text)
        except Exception as exc:  # noqa: BLE001 - CidError and friends: one line
            raise PipelineError(f"{text[:70]!r}: bad CID ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
        raise PipelineError(f"{text[:70]}: a CID; give the job ID it is the aggregate of (`infernet job list`): "
                            f"the agent fetches the aggregate by its CID and checks it")
    else:
        raise PipelineError(f"{text!r}: no such directory, and not a job ID (hex); give a run directory of "
                            f"`train run --local`, an adapter directory or a job ID")
    if base is not None:
        source.base_dir = base.expanduser().resolve()
        if not (source.base_dir / "config.json").is_file():
            raise PipelineError(f"--base {source.base_dir}: not a model directory (no config.json)")
    if check_hash and source.provenance.base_model_sha256:
        from agent.train.model import base_model_sha256

        actual = base_model_sha256(str(source.base_dir))
        if actual != source.provenance.base_model_sha256:
            raise PipelineError(
                f"base model {source.base_dir}: sha256 {actual[:16]}... but the adapter was trained on "
                f"{source.provenance.base_model_sha256[:16]}... (adapter/base mismatch; give the right --base)")
    return source


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise PipelineError(f"{path}: not valid JSON ({exc})") from None


def _from_run(run_dir: Path) -> Source:
    from protocol.unixfs import compute_cid

    adapter = run_dir / "checkpoint-final"
    if not _is_adapter_dir(adapter):
        raise PipelineError(f"{adapter}: incomplete adapter (needs {' + '.join(ADAPTER_FILES)})")
    config = _read_json(run_dir / "train_config.json") or {}
    result = _read_json(run_dir / "result.json") or {}
    proof = _read_json(run_dir / "proof.json") or {}
    spec = run_dir / "infernet.train.yml"
    provenance = Provenance(kind="run", name=run_dir.name, spec_text=spec.read_text() if spec.is_file() else None,
                            proof_head=result.get("head"), validation_loss=result.get("validation_loss"),
                            base_validation_loss=result.get("initial_validation_loss"),
                            final_loss=result.get("final_loss"), steps=result.get("steps"),
                            base_model_sha256=(proof.get("header") or {}).get("base_model_sha256"))
    for name in ("train.jsonl", "validation.jsonl"):
        data = run_dir / "data" / name
        if data.is_file():
            with open(data, "rb") as fh:
                provenance.dataset_cids[name] = compute_cid(fh).encode()
    base_name = config.get("base_model") or _adapter_base_name(adapter)
    provenance.base_model_name = _spec_base_name(provenance.spec_text) or base_name
    return Source(adapter, _base_dir(base_name, None), provenance, run_dir=run_dir)


def _from_adapter(adapter: Path) -> Source:
    name = _adapter_base_name(adapter)
    record = _read_json(adapter / JOB_RECORD) if (adapter / JOB_RECORD).is_file() else None
    if isinstance(record, dict) and isinstance(record.get("detail"), dict) and "id" in record["detail"]:
        try:
            provenance = job_provenance(record["detail"], record.get("ledger") or {}, int(record["round"]),
                                        str(record["cid"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise PipelineError(f"{adapter / JOB_RECORD}: not a job record ({exc})") from None
        provenance.base_model_name = provenance.base_model_name or name
    else:
        provenance = Provenance(kind="adapter", name=adapter.name, base_model_name=name)
    return Source(adapter, _base_dir(name, None), provenance)


def _adapter_base_name(adapter: Path) -> str | None:
    from agent.train.model import FULL_MARKER_FILE

    config = _read_json(adapter / "adapter_config.json") or _read_json(adapter / FULL_MARKER_FILE) or {}
    return config.get("base_model_name_or_path") if isinstance(config, dict) else None


def _spec_base_name(spec_text: str | None) -> str | None:
    if not spec_text:
        return None
    import yaml

    try:
        data = yaml.safe_load(spec_text)
    except yaml.YAMLError:
        return None
    return data.get("base_model") if isinstance(data, dict) else None


def _from_job(job: str, home: Path | None) -> Source:
    from agent.config import default_home
    from agent.channel import request

    home = (home or default_home()).expanduser().resolve()
    detail = request(home, "job.show", job=job)
    job_id = detail["id"]
    if not detail.get("aggregates"):
        raise PipelineError(f"job {job_id[:16]} has no published aggregate yet ({detail['state']}); "
                            f"wait for it (`infernet job watch {job_id[:12]}`)")
    latest = max(detail["aggregates"], key=lambda a: a["round"])
    target = home / "adapters" / f"{job_id[:16]}-r{latest['round']}"
    if not _is_adapter_dir(target):
        staging = home / "adapters" / f".{target.name}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        staging.parent.mkdir(parents=True, exist_ok=True)
        fetched = request(home, "job.fetch", timeout=300, job=job_id, out=str(staging), round=latest["round"])
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        latest_cid = fetched["cid"]
    else:
        latest_cid = latest["cid"]
    try:
        ledger = request(home, "job.ledger", job=job_id)
    except Exception:  # noqa: BLE001 - the ledger is nice to have in the card, not needed to run
        ledger = {}
    provenance = job_provenance(detail, ledger, latest["round"], latest_cid)
    config = _agent_models(home)
    return Source(target, _base_dir(detail.get("base_model"), config), provenance)


def job_provenance(detail: dict, ledger: dict, rnd: int, cid: str) -> Provenance:
    """What a card states of a job's aggregate of round ``rnd`` (CID ``cid``): from its ``job show``
    detail and its ``job ledger`` answer (``{}`` when not had)."""
    job_id = detail["id"]
    agg = next((a for a in detail.get("aggregates", []) if a.get("round") == rnd), {})
    provenance = Provenance(kind="job", name=detail.get("name") or job_id[:16], job_id=job_id,
                            round=rnd, aggregate_cid=cid, validation_loss=agg.get("validation_loss"),
                            base_validation_loss=_first_base_loss(detail), base_model_name=detail.get("base_model"),
                            spec_text=job_spec_text(detail))
    if detail.get("base_model_sha256") and set(detail["base_model_sha256"]) != {"0"}:
        provenance.base_model_sha256 = detail["base_model_sha256"]
    provenance.dataset_cids.update(detail.get("dataset_cids") or {})
    if ledger.get("entries"):
        provenance.ledger_head = ledger["entries"][-1]["hash"]
        provenance.ledger_entries = ledger["length"]
    return provenance


JOB_RECORD = "infernet-job.json"  # beside a fetched aggregate: the job it came from (written by `infernet demo`)


def write_job_record(adapter: Path, detail: dict, ledger: dict, rnd: int, cid: str) -> None:
    """Keep, in a fetched aggregate's directory, what ``job_provenance`` needs once the agents are gone."""
    head = ledger["entries"][-1] if ledger.get("entries") else None
    record = {"detail": detail, "round": rnd, "cid": cid,
              "ledger": {"entries": [head], "length": ledger.get("length")} if head else {}}
    (adapter / JOB_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def keep_job_record(home: Path, detail: dict, fetched: dict) -> None:
    """Beside an aggregate fetched by the agent in ``home`` (``job.fetch``'s answer), the job it came
    from: terms, signed losses, the base model's hash, the ledger head. `infernet publish` states it in
    the card once the agents are gone, and `infer --base` refuses a base model of another hash."""
    from agent.channel import request

    try:
        ledger = request(home, "job.ledger", job=detail["id"])
    except Exception:  # noqa: BLE001 - the ledger head is nice to have in a card, not needed
        ledger = {}
    write_job_record(Path(fetched["path"]), detail, ledger, int(fetched["round"]), fetched["cid"])


def job_spec_text(detail: dict) -> str:
    """The job's spec as its signed terms state it (``job show``'s detail), as YAML in the spec's own
    keys (IPIP-0007): model, description, method and parameters, shards and rounds, the dataset's CID,
    price and budget. The job ID is the hash of those terms."""
    import yaml

    params = detail.get("parameters") or {}
    spec: dict[str, Any] = {"name": detail.get("name"), "description": detail.get("description") or None,
                            "base_model": detail.get("base_model"),
                            "base_model_sha256": detail.get("model_sha256") or detail.get("base_model_sha256")}
    for key in ("method", "runtime", "seed"):
        spec[key] = params.get(key)
    if detail.get("dataset_cid"):
        spec["input"] = {"dataset": f"ipfs://{detail['dataset_cid']}"}
    for key in ("training", "lora", "proof"):
        spec[key] = params.get(key)
    spec["shards"] = detail.get("shards")
    spec["rounds"] = params.get("rounds", detail.get("rounds"))
    spec["aggregation"] = params.get("aggregation")
    spec["lease_seconds"] = params.get("lease_seconds")
    spec["budget"] = {"price_per_hour": detail.get("price_per_hour"), "total": detail.get("budget_total")}
    spec["private"] = detail.get("private")
    text = yaml.safe_dump({k: v for k, v in spec.items() if v is not None}, sort_keys=False, allow_unicode=True)
    return f"# the terms of job {detail.get('id', '?')} as announced (its ID is their hash)\n{text}"


def _first_base_loss(detail: dict) -> float | None:
    for agg in sorted(detail.get("aggregates", []), key=lambda a: a["round"]):
        if agg.get("base_validation_loss") is not None:
            return agg["base_validation_loss"]
    return None


def _agent_models(home: Path) -> dict[str, str]:
    try:
        from agent.config import load_config

        return dict(load_config(home).models)
    except Exception:  # noqa: BLE001 - no config: no named models
        return {}


def _base_dir(name: str | None, models: dict[str, str] | None) -> Path:
    if not name:
        raise PipelineError("the adapter does not say which base model it was trained on; give --base DIR")
    if name == TINY_MODEL_NAME:
        from agent.train.tiny import tiny_model

        return tiny_model()
    if models and name in models:
        return Path(models[name])
    path = Path(name).expanduser()
    if (path / "config.json").is_file():
        return path.resolve()
    from agent.train.tiny import TINY_VERSION, default_cache_dir

    if path.resolve().parent == default_cache_dir().resolve() and path.name.startswith(f"tiny-qwen2-v{TINY_VERSION}-seed"):
        from agent.train.tiny import tiny_model

        return tiny_model(seed=int(path.name.rsplit("seed", 1)[1]))  # the tiny model, rebuilt on this machine
    raise PipelineError(f"base model {name!r}: not a local model directory here; give --base DIR")
