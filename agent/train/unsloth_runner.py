"""Child process for the unsloth backend: ``python -m agent.train.unsloth_runner REQUEST.json``.

Rules of this file:
- unsloth is imported first, before anything imports transformers or peft (it patches them and
  refuses to work otherwise); ``import unsloth`` raises NotImplementedError without a GPU.
- It then runs the same ``train_shard`` as the peft backend, with the unsloth model builder, and
  reports on stdout, one JSON object per line: ``INFERNET-EVENT {checkpoint event}`` after each
  checkpoint, ``INFERNET-RESULT {train result}`` at the end, or ``INFERNET-ERROR message`` and
  exit status 1 on failure. The parent (backends.UnslothBackend) reads those lines (child.read_child).
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    try:
        import unsloth  # noqa: F401  (must come before transformers and peft)
    except (ImportError, NotImplementedError) as error:
        print(f"INFERNET-ERROR runtime unsloth is not usable here: {error}", flush=True)
        return 1
    from agent.train.child import ERROR_PREFIX, EVENT_PREFIX, RESULT_PREFIX
    from agent.train.config import TrainError
    from agent.train.model import FILE_HASHES
    from agent.train.run import TrainRequest, train_shard

    with open(argv[0], encoding="utf-8") as handle:
        data = json.load(handle)
    request = TrainRequest.from_json(data)
    FILE_HASHES.load([((str(k[0]), int(k[1]), int(k[2])), str(v)) for k, v in data.get("file_hashes", [])])

    def report(event) -> None:
        print(EVENT_PREFIX + json.dumps(event.to_json()), flush=True)

    try:
        result = train_shard(request, report, backend="unsloth")
    except TrainError as error:
        print(ERROR_PREFIX + str(error), flush=True)
        return 1
    print(RESULT_PREFIX + json.dumps(result.to_json()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
