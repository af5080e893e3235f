"""One worker, several devices: a shard trained data-parallel by N processes of torch.distributed.

Rules of this file:
- ``DataParallelBackend(processes).train(request, on_checkpoint)`` is a backend like the others
  (backends.py): it writes the request beside the run, starts ``processes`` children
  ``python -m agent.train.parallel REQUEST.json RANK WORLD INIT`` and reads rank 0's stdout, which
  speaks the unsloth runner's lines (``INFERNET-EVENT`` after each checkpoint, ``INFERNET-RESULT`` at
  the end, ``INFERNET-ERROR`` on failure). A checkpoint is therefore announced by the worker as it
  happens, as with one process.
- A child joins the group by a ``file://`` rendezvous in the run directory (no port to pick): NCCL
  with rank r on ``cuda:r`` when torch sees CUDA and the config does not ask for the CPU, gloo on
  the CPU otherwise (on Linux over ``lo`` unless ``GLOO_SOCKET_IFNAME`` says another interface).
  Asking for more processes than CUDA devices on a CUDA machine is a TrainError before any work.
- Rank 0 runs ``run.train_shard``: it alone writes the run directory and records the proof; the
  other ranks run ``run.train_replica`` (same session, same steps, no files). loop.py deals each
  step's micro-batches round-robin to the ranks and sums gradients, losses and token counts, so the
  step is the whole step's, the batch digest names every sample of the step (all ranks'), and rank
  0's adapter is every rank's (checked at each link, loop.same_on_every_rank).
- ``split_for(config, processes)``: at least one micro-batch per rank, so no rank idles: the micro-batch
  becomes the largest divisor of the effective batch that is at most ``effective // processes`` (and
  at most what the worker chose before). The header records it and ``data_parallel``, and a verifier
  in one process replays with that micro-batch; only the summation order differs (IPIP-0005 §6.1).
- A child that fails ends the group: the others are killed, and the error is that child's own line
  (rank 0's ``INFERNET-ERROR`` or the ``rank-N.error`` file another rank wrote), else its exit status.
- Only the peft runtime trains data-parallel; unsloth trains on one GPU (backends.select_backend).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from agent.train.config import TrainConfig, TrainError
from agent.train.recorder import OnCheckpoint
from agent.train.run import TrainRequest, TrainResult

RENDEZVOUS_FILE = ".rendezvous"
REQUEST_FILE = ".parallel-request.json"
FINISH_SECONDS = 60.0
"""How long the ranks may take to exit after rank 0 reported its result."""


def split_for(config: TrainConfig, processes: int) -> TrainConfig:
    """``config`` with a micro-batch that gives each of ``processes`` ranks at least one micro-batch."""
    if processes <= 1:
        return config
    effective = config.samples_per_step
    most = min(config.micro_batch, max(1, effective // processes))
    micro = max(d for d in range(1, most + 1) if effective % d == 0)
    return config.with_(micro_batch_size=micro)


def plan_processes(configured: int, cuda_devices: int) -> int:
    """How many processes train one shard: the operator's ``train_processes`` when set (> 0), else one
    per CUDA device the agent measured (one on a machine without)."""
    return configured if configured > 0 else max(1, cuda_devices)


class DataParallelBackend:
    name = "peft"

    def __init__(self, processes: int, python: str | None = None):
        if processes < 2:
            raise ValueError("a data-parallel backend needs at least 2 processes")
        self.processes = processes
        self.python = python or sys.executable

    def train(self, request: TrainRequest, on_checkpoint: OnCheckpoint | None = None) -> TrainResult:
        import torch

        from agent.train.model import FILE_HASHES, resolve_model_dir

        cuda = request.config.device != "cpu" and torch.cuda.is_available()
        if cuda and torch.cuda.device_count() < self.processes:
            raise TrainError(f"{self.processes} training processes asked for, but torch sees "
                             f"{torch.cuda.device_count()} CUDA device(s): one process per GPU")
        work = request.run_dir.parent
        work.mkdir(parents=True, exist_ok=True)
        rendezvous = work / RENDEZVOUS_FILE
        rendezvous.unlink(missing_ok=True)
        data = request.to_json()
        data["file_hashes"] = [[list(key), digest] for key, digest in
                               FILE_HASHES.under(resolve_model_dir(request.config.base_model))]
        request_path = work / REQUEST_FILE
        request_path.write_text(json.dumps(data))
        for rank in range(1, self.processes):
            (work / f"rank-{rank}.error").unlink(missing_ok=True)
        try:
            return self._run(request_path, rendezvous, on_checkpoint)
        finally:
            request_path.unlink(missing_ok=True)
            rendezvous.unlink(missing_ok=True)

    def _run(self, request_path: Path, rendezvous: Path, on_checkpoint: OnCheckpoint | None) -> TrainResult:
        from agent.train.child import read_child

        env = dict(os.environ)
        if sys.platform.startswith("linux"):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        command = [self.python, "-m", "agent.train.parallel", str(request_path)]
        init = f"file://{rendezvous}"
        children = [subprocess.Popen(command + [str(rank), str(self.processes), init], env=env,
                                     stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                                     text=True, bufsize=1)
                    for rank in range(self.processes)]
        done = threading.Event()
        watcher = threading.Thread(target=_end_group_on_failure, args=(children, done), daemon=True)
        watcher.start()
        result, error = None, None  # a failed read (a checkpoint announcement that failed) must still end the ranks
        try:
            result, error = read_child(children[0], on_checkpoint)
        finally:
            done.set()
            for child in children:
                if child.poll() is None and result is None:
                    child.kill()
            for child in children:
                try:
                    child.wait(timeout=FINISH_SECONDS)  # the others end right after rank 0's last step
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
            watcher.join()
        if result is not None and all(child.returncode == 0 for child in children):
            return result
        for rank, child in enumerate(children[1:], start=1):
            own = request_path.parent / f"rank-{rank}.error"
            if own.exists():
                error = f"rank {rank}: {own.read_text().strip()}"
                break
        failed = [f"rank {r} exited with status {c.returncode}" for r, c in enumerate(children) if c.returncode]
        raise TrainError(error or "; ".join(failed) or "data-parallel training ended with no result")


def _end_group_on_failure(children: list[subprocess.Popen], done: threading.Event) -> None:
    """Kill every rank once one of them fails: the others would wait in a collective for ever."""
    while not done.wait(0.2):
        if any(child.poll() not in (None, 0) for child in children):
            for child in children:
                if child.poll() is None:
                    child.kill()
            return


def main(argv: list[str]) -> int:
    """A child: ``python -m agent.train.parallel REQUEST.json RANK WORLD INIT_METHOD``."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from agent.train.child import ERROR_PREFIX, EVENT_PREFIX, RESULT_PREFIX
    from agent.train.model import FILE_HASHES
    from agent.train.run import train_replica, train_shard

    request_path, rank, world, init = Path(argv[0]), int(argv[1]), int(argv[2]), argv[3]
    data = json.loads(request_path.read_text())
    request = TrainRequest.from_json(data)
    FILE_HASHES.load([((str(k[0]), int(k[1]), int(k[2])), str(v)) for k, v in data.get("file_hashes", [])])
    cuda = request.config.device != "cpu" and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(minutes=30))
    try:
        if rank == 0:
            result = train_shard(request, lambda event: print(EVENT_PREFIX + json.dumps(event.to_json()), flush=True))
            print(RESULT_PREFIX + json.dumps(result.to_json()), flush=True)
        else:
            train_replica(request)
        # every rank ends together, so a replica never tears the group down while rank 0 still writes its
        # proof: the likely cause of one CI failure under load (2026-11-28: rank 1 aborted by gloo, "terminate
        # called without an active exception", status -6; the watcher then killed rank 0 before its result)
        dist.barrier()
    except (TrainError, RuntimeError, ValueError, OSError) as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        if rank == 0:
            print(ERROR_PREFIX + message, flush=True)
        else:
            (request_path.parent / f"rank-{rank}.error").write_text(message + "\n")
        return 1
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
