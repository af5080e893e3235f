"""The training loop: one deterministic optimizer step at a time, the same code for train and replay.

Rules of this file:
- ``LoraSession.step(s)`` is a pure function of (adapter, optimizer state, shard, config, s): it
  reseeds torch from protocol.proof.step_seed(seed, s) first (so dropout never depends on
  what ran before), takes the examples ``data.step_samples`` names (at stream position
  ``offset + s``, where ``offset`` = the steps of the rounds before: config.stream_offset), runs
  ``gradient_accumulation_steps`` micro-batches of ``batch_size`` (or the worker's
  ``micro_batch_size``: the same samples split otherwise, the same token-weighted mean), and makes
  one AdamW step. This
  is what lets a verifier resume from any checkpoint and land on the same bits.
- The loss of a step is the mean cross-entropy over all its label tokens (token-weighted across
  micro-batches), computed here from the logits, not by the model. A DPO job (``objective`` "dpo",
  IPIP-0005 §6.2) steps over preference pairs instead, and its loss is the mean over the step's
  pairs of -log sigmoid(beta x ((log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log
  ref(rejected)))), each log-probability summed over the completion's label tokens; the reference
  is the same model with the adapter disabled (the base model: no second model in memory),
  computed without gradients in the same micro-batch. ``Objective`` is the one place the two differ.
- AdamW, weight decay 0, constant learning rate, gradient norm clipped to ``max_grad_norm``.
  Only LoRA parameters train; with ``freeze_a`` only the B matrices; with ``method: full`` every weight
  (agent/train/model.full_model): the loop trains what requires a gradient, and names it as
  ``adapter_state`` does.
- Optimizer state is exported as named tensors ``<adapter tensor name>.<exp_avg|exp_avg_sq|step>``
  so it can be hashed and stored as safetensors, and imported back exactly.
- Data parallel (one worker, several GPUs): when torch.distributed is initialised, rank r runs the
  micro-batches r, r + W, ... of each step and the gradients, losses and token counts are summed
  across ranks before clipping, so every rank takes the same AdamW step and the result equals a
  single process's within float summation order. So that dropout masks do not depend on which rank
  runs a micro-batch, a data-parallel step (or one with ``config.micro_batch_rng``, which a verifier
  sets to replay a data-parallel proof in one process) also reseeds before each micro-batch j from
  protocol.proof.micro_seed(seed, offset + s, j) (IPIP-0005 §6.1).
- No I/O here: the recorder (recorder.py) and the run (run.py) decide what to save and when.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F

from agent.train.config import TrainConfig
from agent.train.data import IGNORE_INDEX, Example, step_samples
from agent.train.model import adapter_state, peft_name
from protocol.proof import micro_seed, step_seed
from protocol.schedule import inner_rate_factor


def data_parallel() -> tuple[int, int]:
    """(world size, rank) of the torch.distributed group this process is in; (1, 0) when none."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def same_on_every_rank(digest: bytes, device: str = "cpu") -> bool:
    """True when every rank of the data-parallel group passed the same ``digest`` (always, alone).
    Every rank must call it at the same point; every rank gets the same answer."""
    world, _ = data_parallel()
    if world == 1:
        return True
    import torch.distributed as dist

    mine = torch.tensor(list(digest), dtype=torch.int64, device=device)
    low, high = mine.clone(), mine.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return bool(torch.equal(low, high))


def deterministic_cuda() -> None:
    """Make this process's CUDA training repeatable (IPIP-0005 §8.2): torch's deterministic algorithms in
    strict mode, unless a step already found an op without a deterministic form (``LoraSession.step``
    then falls back to warnings only). Strict matters: in warn-only mode SDPA keeps cuDNN attention and
    flash attention's atomics backward (on an H200, 1.2 % run-to-run drift over 20 steps at 16 x 1024
    packed tokens, "cuDNN Attention defaults to a non-deterministic algorithm"); strict mode leaves cuDNN
    attention out and runs flash attention's deterministic backward. cuBLAS gets a fixed workspace.
    Called before a CUDA session builds."""
    import os

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if not torch.are_deterministic_algorithms_enabled():
        torch.use_deterministic_algorithms(True, warn_only=False)


def refused_by_strict_mode(error: RuntimeError, device: str) -> bool:
    """Whether ``error`` is strict deterministic mode refusing an op; if so the process goes on in warn-only
    mode (logged once), where that op runs, and the caller runs its work again. Such work replays within
    the tolerance, not exactly (IPIP-0005 §8.2)."""
    if not (device == "cuda" and "deterministic" in str(error).lower()
            and torch.are_deterministic_algorithms_enabled()
            and not torch.is_deterministic_algorithms_warn_only_enabled()):
        return False
    import logging

    logging.getLogger(__name__).warning(
        "an op has no deterministic CUDA form (%s); training goes on in warn-only deterministic mode, "
        "whose replays are within the tolerance, not exact", str(error).splitlines()[0][:200])
    torch.use_deterministic_algorithms(True, warn_only=True)
    return True


def collate(examples: Sequence[Example], pad_id: int, device: str) -> dict[str, torch.Tensor]:
    """Right-padded input_ids, attention_mask and labels (-100 on padding). Padding is only ever on the
    right (``token_loss_sum`` relies on it); the mask counts a batch's real tokens."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        ids[row, :n] = torch.tensor(example.input_ids)
        labels[row, :n] = torch.tensor(example.labels)
        mask[row, :n] = 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


FUSED_LOSS = "infernet_fused_loss"
"""The attribute that marks a model computing its own summed next-token loss from labels (``token_loss_sum``)."""


def token_loss_sum(model: Any, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Sum of next-token cross-entropy over the label tokens of a batch. The model gets no attention
    mask: ``collate`` pads on the right, and causal attention never lets a real token see the padding
    after it, so the mask changes nothing a label depends on; without it the attention takes its causal
    kernel (flash attention on CUDA, deterministic under ``deterministic_cuda``), where a padding mask
    sends it to the memory-efficient kernel, whose backward splits keys and adds with atomics: 1.6 %
    run-to-run drift on an H200 at 16 x 1024 packed tokens (issue 22).

    A model marked ``FUSED_LOSS`` (unsloth's, run.build_lora_model) is given the labels and returns the
    sum itself (``num_items_in_batch`` 1: sum over label tokens divided by 1), so unsloth's chunked
    cross-entropy computes it from the hidden states without materialising the step's logits (16 x 1024
    x 151,936 in float32 is 10 GB written and read again at the 0.5B shape)."""
    if getattr(model, FUSED_LOSS, False):
        return model(input_ids=batch["input_ids"], labels=batch["labels"], num_items_in_batch=1).loss.float()
    logits = model(input_ids=batch["input_ids"]).logits
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
        batch["labels"][:, 1:].reshape(-1),
        ignore_index=IGNORE_INDEX, reduction="sum",
    )


def sequence_log_probs(model: Any, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Per row of a batch, the sum of the log-probabilities of its label tokens (no attention mask, as in
    ``token_loss_sum``)."""
    logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    per_token = -F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                                 ignore_index=IGNORE_INDEX, reduction="none")
    return per_token.view(labels.shape).sum(dim=1)


@dataclass(frozen=True)
class Scores:
    """What a micro-batch adds to a step or an evaluation: the loss summed over its units, the input tokens
    it holds, and for DPO its pairs' implicit reward margins beta x (chosen - rejected) log-ratios."""

    loss_sum: torch.Tensor
    tokens: int
    margins: torch.Tensor | None = None


class Objective:
    """Supervised fine-tuning: the loss is summed over label tokens, so a step's weight is its label tokens."""

    name = "sft"

    def weight(self, examples: Sequence[Any]) -> int:
        return sum(e.n_label_tokens for e in examples)

    def scores(self, model: Any, examples: Sequence[Any], pad_id: int, device: str) -> Scores:
        batch = collate(examples, pad_id, device)
        return Scores(token_loss_sum(model, batch), int(batch["attention_mask"].sum()))


class DpoObjective(Objective):
    """Direct preference optimization (Rafailov et al. 2023; TRL's ``sigmoid`` loss): summed over pairs,
    so a step's weight is its pairs. Chosen and rejected sides go through the model in one batch."""

    name = "dpo"

    def __init__(self, beta: float) -> None:
        self.beta = beta

    def weight(self, pairs: Sequence[Any]) -> int:
        return len(pairs)

    def scores(self, model: Any, pairs: Sequence[Any], pad_id: int, device: str) -> Scores:
        batch = collate([p.chosen for p in pairs] + [p.rejected for p in pairs], pad_id, device)
        with torch.no_grad(), adapter_disabled(model):
            reference = sequence_log_probs(model, batch)
        policy, n = sequence_log_probs(model, batch), len(pairs)
        losses, margins = dpo_loss(policy[:n], policy[n:], reference[:n], reference[n:], self.beta)
        return Scores(losses.sum(), int(batch["attention_mask"].sum()), margins.detach())


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, reference_chosen: torch.Tensor,
             reference_rejected: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pair, DPO's loss -log sigmoid(m) and its reward margin m = beta x ((log pi(c) - log ref(c)) -
    (log pi(r) - log ref(r))), from the sequences' summed log-probabilities (IPIP-0005 §6.2; vectors in
    ipips/vectors/dpo-loss.json)."""
    margins = beta * ((policy_chosen - reference_chosen) - (policy_rejected - reference_rejected))
    return -F.logsigmoid(margins), margins


@contextmanager
def adapter_disabled(model: Any) -> Iterator[None]:
    """The base model, for DPO's reference: peft's ``disable_adapter``, with every parameter's requires_grad
    kept as it was. Re-enabling the adapter marks all of its tensors trainable (peft's ``set_adapter``): a
    frozen A (``freeze_a``) would then train in the next session built on the same model (run.ModelPool)."""
    trainable = [(parameter, parameter.requires_grad) for parameter in model.parameters()]
    try:
        with model.disable_adapter():
            yield
    finally:
        for parameter, flag in trainable:
            parameter.requires_grad_(flag)


def objective_for(config: TrainConfig) -> Objective:
    return DpoObjective(config.dpo_beta) if config.objective == "dpo" else Objective()


@dataclass(frozen=True)
class Evaluation:
    """A model's score on held-out examples: the mean loss; for DPO also the share of pairs whose chosen
    side has the larger implicit reward, and the mean reward margin."""

    loss: float
    reward_accuracy: float | None = None
    reward_margin: float | None = None


@dataclass(frozen=True)
class StepResult:
    step: int  # optimizer steps done after this one (1-based)
    indices: tuple[int, ...]
    loss: float
    tokens: int  # non-padding input tokens processed


class LoraSession:
    """A LoRA-wrapped model, its AdamW and one shard's examples."""

    def __init__(self, model: Any, examples: Sequence[Example], config: TrainConfig, *, device: str,
                 dtype: torch.dtype, pad_id: int):
        if not examples:
            raise ValueError("a shard needs at least one example with assistant tokens")
        self.model = model
        self.examples = list(examples)
        self.config = config
        self.device = device
        self.dtype = dtype
        self.pad_id = pad_id
        self.objective = objective_for(config)
        self.parameters = {peft_name(n): p for n, p in model.named_parameters() if p.requires_grad}
        self.round_steps = config.total_steps(len(self.examples))
        self.offset = config.stream_offset(len(self.examples))
        self.optimizer = torch.optim.AdamW(
            list(self.parameters.values()), lr=config.learning_rate, weight_decay=0.0, foreach=False)
        self.on_close: Callable[[], None] | None = None  # run.py's model pool takes the model back
        self._in_train_mode = False  # model.train() walks every module: once, not every step (``_score`` undoes it)

    def close(self) -> None:
        """Done with the model: hand it back (run.ModelPool); the session must not be used after."""
        release, self.on_close = self.on_close, None
        self.optimizer.state.clear()
        if release is not None:
            release()
        if self.device == "cuda":  # the allocator's cache back to the device: another process may train on it
            torch.cuda.empty_cache()

    def step(self, step: int) -> StepResult:
        """Optimizer step number ``step`` (0-based) of this shard. On CUDA, an op that strict deterministic
        mode refuses (deterministic_cuda) turns the process to warn-only mode and the step runs again from
        its start: nothing of it was applied (the optimizer steps last; the gradients are cleared)."""
        return self._again_if_refused(lambda: self._step(step))

    def _again_if_refused(self, run: Callable[[], Any]) -> Any:
        try:
            return run()
        except RuntimeError as error:
            if not refused_by_strict_mode(error, self.device):
                raise
            self.optimizer.zero_grad(set_to_none=True)
            return run()

    def _step(self, step: int) -> StepResult:
        config = self.config
        position = self.offset + step
        if config.inner_schedule != "constant":  # the rate at this step of the round (IPIP-0006 §2.5)
            rate = config.learning_rate * inner_rate_factor(config.inner_schedule, step, self.round_steps)
            for group in self.optimizer.param_groups:
                group["lr"] = rate
        torch.manual_seed(step_seed(config.seed, position))
        indices = step_samples(len(self.examples), config.samples_per_step, config.seed, position)
        weight = self.objective.weight([self.examples[i] for i in indices])
        if not self._in_train_mode:
            self.model.train()
            self._in_train_mode = True
        loss_total, tokens = 0.0, 0
        world, rank = data_parallel()
        per_micro = world > 1 or config.micro_batch_rng
        starts = list(range(0, len(indices), config.micro_batch))
        for j in range(rank, len(starts), world):  # data parallel: micro-batches dealt round-robin to ranks
            start = starts[j]
            if per_micro:
                torch.manual_seed(micro_seed(config.seed, position, j))
            scores = self.objective.scores(self.model, [self.examples[i] for i in indices[start:start + config.micro_batch]],
                                           self.pad_id, self.device)
            (scores.loss_sum / weight).backward()
            loss_total += scores.loss_sum.item()
            tokens += scores.tokens
        if world > 1:
            loss_total, tokens = self._all_reduce(loss_total, tokens)
        if config.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(self.parameters.values(), config.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(step + 1, tuple(indices), loss_total / weight, tokens)

    def _all_reduce(self, loss_total: float, tokens: int) -> tuple[float, int]:
        """Sum every rank's gradients, loss and token count: each rank then holds the whole step's
        gradient (the token-weighted mean, as one process computes it) and takes the same AdamW step."""
        import torch.distributed as dist

        for parameter in self.parameters.values():
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            dist.all_reduce(parameter.grad)
        totals = torch.tensor([loss_total, float(tokens)], dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)
        return float(totals[0]), int(totals[1])

    def evaluate(self, examples: Sequence[Example]) -> float:
        """Mean loss over ``examples`` with dropout off (per label token; for DPO per pair)."""
        return self.score(examples).loss

    def score(self, examples: Sequence[Any]) -> Evaluation:
        """``evaluate``'s loss, and for DPO the reward accuracy and margin."""
        return self._again_if_refused(lambda: self._score(examples))

    @torch.no_grad()
    def _score(self, examples: Sequence[Any]) -> Evaluation:
        self.model.eval()
        self._in_train_mode = False
        total, count, margins = 0.0, 0, []
        for start in range(0, len(examples), self.config.batch_size):
            chunk = examples[start:start + self.config.batch_size]
            scores = self.objective.scores(self.model, chunk, self.pad_id, self.device)
            total += scores.loss_sum.item()
            count += self.objective.weight(chunk)
            if scores.margins is not None:
                margins.append(scores.margins.float().cpu())
        if not margins:
            return Evaluation(total / max(count, 1))
        every = torch.cat(margins)
        return Evaluation(total / max(count, 1), float((every > 0).float().mean()), float(every.mean()))

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        return adapter_state(self.model)

    def optimizer_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, parameter in self.parameters.items():
            for key, value in self.optimizer.state.get(parameter, {}).items():
                out[f"{name}.{key}"] = value.detach().to("cpu", copy=True).contiguous()  # a copy: see adapter_state
        return out

    def load_optimizer_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Restore state written by ``optimizer_tensors`` (empty: a fresh optimizer)."""
        state: dict[int, dict[str, torch.Tensor]] = {}
        for index, name in enumerate(self.parameters):
            entries = {key: tensors[f"{name}.{key}"] for key in ("step", "exp_avg", "exp_avg_sq")
                       if f"{name}.{key}" in tensors}
            if entries:
                state[index] = {k: v.clone() for k, v in entries.items()}
        used = sum(len(entries) for entries in state.values())
        if used != len(tensors):
            raise ValueError(f"optimizer state has {len(tensors) - used} tensors that fit no trainable parameter")
        groups = self.optimizer.state_dict()["param_groups"]
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
