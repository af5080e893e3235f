"""LoRA training for one shard, with proof of training; knows nothing about the network.

A worker calls::

    config = TrainConfig.from_spec(spec, threads=4)
    backend = select_backend(config.runtime, processes=2)       # TrainError if unusable here; > 1:
                                                                # data parallel (parallel.py)
    result = backend.train(TrainRequest(config, shard_path, run_dir, validation=..., job_id=...,
                                        round=..., shard_index=..., attempt=..., worker=peer_id),
                           on_checkpoint=lambda event: ...)     # CheckpointEvent per link
    result.adapter_dir, result.head                             # checkpoint-final/, chain head

and a verifier::

    verdict = verify_segment(commitment, index, start=ckpt_dir, end=next_ckpt_dir,
                             shard=shard_path, config=config)   # SegmentVerdict

Modules: config (TrainConfig), data (ChatML, tokenization, splits, sample order), tiny (the
test/demo model), model (base hash, seeded LoRA), loop (the training step), recorder (checkpoints
and hash chain), run (train_shard and the run directory), replay (verify_segment), backends
(peft, unsloth), parallel (one shard in N processes: NCCL on GPUs, gloo on the CPU). Importing this package does not import transformers, peft or unsloth.
"""

from agent.train.backends import Backend, PeftBackend, UnslothBackend, select_backend
from agent.train.config import TrainConfig, TrainError
from agent.train.data import DataError, split_dataset
from agent.train.model import base_model_sha256
from agent.train.recorder import CheckpointEvent
from agent.train.replay import verify_segment
from agent.train.run import TrainRequest, TrainResult, train_shard

__all__ = [
    "Backend", "CheckpointEvent", "DataError", "PeftBackend", "TrainConfig", "TrainError",
    "TrainRequest", "TrainResult", "UnslothBackend", "base_model_sha256", "select_backend",
    "split_dataset", "train_shard", "verify_segment",
]
