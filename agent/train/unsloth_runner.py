"""Child process for the unsloth backend: ``python -m agent.train.unsloth_runner``, one warm process per agent.

Rules of this file:
- unsloth is imported first, before anything imports transformers or peft (it patches them and
  refuses to work otherwise); ``import unsloth`` raises NotImplementedError without a GPU.
- It is a *warm* process (issue 22): it reads requests from stdin, one JSON object
  per line, and answers each in turn, so unsloth's import, patching and ``torch.compile`` of the
  model's blocks are paid once per process, not once per shard, and the built model is kept between
  requests (run.ModelPool). It ends when stdin closes (its parent went away). A request is
  ``{"op": "train", "request": TrainRequest, "file_hashes": [...]}`` (a shard to train) or
  ``{"op": "replay", ...}`` (one segment to replay with unsloth, replay.verify_segment's arguments).
- It answers on stdout, one line each: ``INFERNET-EVENT {checkpoint event}`` after each checkpoint,
  then ``INFERNET-RESULT {train result}`` or ``INFERNET-VERDICT {segment verdict}``, or
  ``INFERNET-ERROR message`` (the request failed; the process stays up). The parent
  (backends.UnslothBackend) reads those lines (child.read_reply). Anything else (unsloth's banners)
  is passed through to the parent's stderr.
"""

from __future__ import annotations

import json
import sys


def _train(data: dict) -> str:
    from agent.train.child import EVENT_PREFIX, RESULT_PREFIX
    from agent.train.model import FILE_HASHES
    from agent.train.run import TrainRequest, train_shard

    request = TrainRequest.from_json(data["request"])
    FILE_HASHES.load([((str(k[0]), int(k[1]), int(k[2])), str(v)) for k, v in data.get("file_hashes", [])])

    def report(event) -> None:
        print(EVENT_PREFIX + json.dumps(event.to_json()), flush=True)

    result = train_shard(request, report, backend="unsloth")
    return RESULT_PREFIX + json.dumps(result.to_json())


def _replay(data: dict) -> str:
    from dataclasses import asdict
    from pathlib import Path

    from agent.train.child import VERDICT_PREFIX
    from agent.train.config import TrainConfig
    from agent.train.replay import verify_segment
    from protocol.proof import Commitment

    optional = lambda key: Path(data[key]) if data.get(key) else None  # noqa: E731
    verdict = verify_segment(
        Commitment.from_json(data["commitment"]), int(data["index"]), start=Path(data["start"]),
        shard=Path(data["shard"]), config=TrainConfig.from_json(data["config"]), end=optional("end"),
        claimed_head=bytes.fromhex(data["claimed_head"]) if data.get("claimed_head") else None,
        round_start=optional("round_start"), runtime="unsloth")
    return VERDICT_PREFIX + json.dumps(asdict(verdict))


def answer(data: dict) -> str:
    """The reply line to one request."""
    from agent.train.child import ERROR_PREFIX
    from agent.train.config import TrainError

    op = data.get("op")
    try:
        if op == "train":
            return _train(data)
        if op == "replay":
            return _replay(data)
        return ERROR_PREFIX + f"unknown request {op!r} (train, replay)"
    except TrainError as error:
        return ERROR_PREFIX + str(error).replace("\n", " ")
    except Exception as error:  # noqa: BLE001 - a failed request is one line; the warm process stays up
        return ERROR_PREFIX + f"{type(error).__name__}: {error}".replace("\n", " ")[:2000]


def main() -> int:
    try:
        import unsloth  # noqa: F401  (must come before transformers and peft)
    except (ImportError, NotImplementedError) as error:
        print(f"INFERNET-ERROR runtime unsloth is not usable here: {error}", flush=True)
        return 1
    from agent.train.child import READY_LINE

    print(READY_LINE, flush=True)
    for raw in sys.stdin:  # warm: one request a line until the parent closes stdin
        if not raw.strip():
            continue
        try:
            data = json.loads(raw)
        except ValueError as error:
            print(f"INFERNET-ERROR request is not JSON: {error}", flush=True)
            continue
        print(answer(data), flush=True)
    return 0



if __name__ == "__main__":
    sys.exit(main())
