"""Distributed efficiency: does a job spread over W workers train as well as one machine would?

For each task and worker count W, the same total optimizer steps T are spent three ways:
  centralized   one machine, `train run --local` on the whole training split, T steps;
  sync-DP       synchronous data parallel: W workers, one all-reduce per step, i.e. batch x W for
                T/W steps (the baseline DiLoCo reports against: the same examples, every step synced);
  network       the protocol's way: R rounds, each worker trains its shard for H = T/(W*R) steps from
                the round's aggregate, then the job's aggregation rule and outer optimizer make the
                next aggregate (agent/train/aggregate.py), exactly as a coordinator does.
Validation loss is measured on held-out records of the task. The figure is the distributed
efficiency E = (centralized steps that reach the network's validation loss) / T: 1.0 means the
network's W machines are worth W machines, 1/W that they are worth one. E_sync compares with
sync-DP the same way: (sync-DP steps that reach the network's loss) / (T/W).

It runs the aggregation math in this process (it tests the rule, not the network): the same
LoraSession loop a worker runs (seeded LoRA, deterministic batches, AdamW), the same shard split
(agent/train/data.split_dataset) and the same aggregation code. `--network` adds one row from a
real `infernet demo` run (separate agent processes over libp2p) to show the network lands on the
same number.

Tasks: `demo` is the demo's dataset (agent/data/demo.jsonl; validation on the demo's 48 held-out
records); `hard` is a second synthetic task made here so the defaults are not tuned to one dataset:
single-digit sums, successors of two-digit numbers, sorting three digits and spelling random
four-letter strings backwards (all need a rule, not recall). `dpo` is a preference job (IPIP-0005
§6.2, beta 0.1): the demo task's right answers chosen over evasions (three in four) or plausible wrong
answers (agent/train/preference.demo_preferences); its loss is the DPO loss on held-out pairs. It is
learnt in a dozen steps (evasions) or not at all (the wrong answers, which need facts): a curve too flat
for E. `dpo-hard` is the one to read: the hard task's right answers chosen over answers that break its
rule (a sum off by a few, a skipped successor, unsorted digits, a word spelled forwards).

Prints one JSON object per figure:
  {"bench": "efficiency/<task>/W<w>/<optimizer>", "value": E, "unit": "E", "reference": 1.0,
   "ratio": E, "goal": 0.8}
plus the same with "efficiency_sync/..." against sync-DP, and "val_loss/..." lines with the raw
losses (reference = the centralized loss at T; ratio = reference / value, higher is better).
`--train-method full` trains every weight of the tiny model instead of an adapter (method: full;
aggregate with --method fedavg and a smaller --lr, e.g. 1e-3).
Usage: python scripts/bench_quality.py [--tasks demo,hard,dpo,dpo-hard] [--train-method lora|full] [--workers 2,4,8] [--total 800]
       [--rounds 8] [--outer nesterov:0.7:0.9,none] [--records N] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import sys
import tempfile
import time
from typing import Any
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from agent.train.aggregate import (  # noqa: E402
    OuterOptimizer, aggregate, average_optimizer_states, frozen_keys, outer_step,
)
from agent.train.codec import payload_bytes, round_trip  # noqa: E402
from agent.train.config import TrainConfig  # noqa: E402
from agent.train.data import Example, read_chatml, split_dataset, write_chatml  # noqa: E402
from agent.train.loop import LoraSession  # noqa: E402
from agent.train.model import adapter_state, load_adapter_state, load_tokenizer  # noqa: E402
from agent.train.run import build_lora_model, load_shard, pad_token_id  # noqa: E402
from protocol.downlink import coded_round  # noqa: E402
from protocol.schedule import inner_rate_factor, round_learning_rate  # noqa: E402
from agent.train.tiny import demo_records, tiny_model  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GOAL = 0.8


# --- tasks -----------------------------------------------------------------------------------------

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def hard_records(n: int, seed: int) -> list[dict]:
    """The second task: rules to learn (sum, successor, sort, reverse-spell), not facts to recall."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            a, b = rng.randrange(10), rng.randrange(10)
            question, answer = f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
        elif kind == 1:
            k = rng.randrange(10, 98)
            question, answer = f"What number comes after {k}?", f"After {k} comes {k + 1}."
        elif kind == 2:
            digits = [rng.randrange(10) for _ in range(3)]
            question = "Sort: " + " ".join(map(str, digits))
            answer = " ".join(map(str, sorted(digits)))
        else:
            word = "".join(rng.choice(LETTERS) for _ in range(4))
            question, answer = f"Spell {word} backwards.", "-".join(reversed(word.upper()))
        records.append({"messages": [{"role": "user", "content": question},
                                     {"role": "assistant", "content": answer}], "meta": {"id": i}})
    return records


def hard_preferences(n: int, seed: int) -> list[dict]:
    """The hard task as preferences: each right answer chosen over a wrong one made by breaking the rule
    (a sum off by one to three, a successor skipped or repeated, digits left unsorted, a word spelled
    forwards), so that preferring the right one on new questions takes learning the rule."""
    rng = random.Random(seed + 1)
    out = []
    for record in hard_records(n, seed):
        question, answer = record["messages"][0]["content"], record["messages"][1]["content"]
        kind = record["meta"]["id"] % 4
        if kind == 0:
            total = int(answer.rstrip(".").split()[-1])
            wrong = answer[: answer.rindex(" ") + 1] + f"{total + rng.choice((-3, -2, -1, 1, 2, 3))}."
        elif kind == 1:
            k = int(question.rstrip("?").split()[-1])
            wrong = f"After {k} comes {k + rng.choice((0, 2, 10))}."
        elif kind == 2:
            digits = question.split(": ")[1].split()
            wrong = " ".join(digits) if digits != sorted(digits) else " ".join(sorted(digits, reverse=True))
            wrong = wrong if wrong != answer else "0 " + answer
        else:
            word = question.split()[1]
            wrong = "-".join(word.upper())
        out.append({"prompt": record["messages"][:1], "chosen": record["messages"][1:],
                    "rejected": [{"role": "assistant", "content": wrong}], "meta": record["meta"]})
    return out


@dataclass
class Task:
    name: str
    train_file: Path
    validation_file: Path


def make_task(name: str, directory: Path, records: int = 0, held_out: int = 48) -> Task:
    """The task's training and validation files; ``records`` > 0: that many generated training records
    (the demo task's generator for ``demo``) instead of the shipped 400, so long jobs are not many
    epochs over a small set."""
    train, validation = directory / f"{name}-train.jsonl", directory / f"{name}-validation.jsonl"
    if name == "demo" and records:
        write_chatml(train, demo_records(records, seed=1))
        write_chatml(validation, demo_records(held_out, seed=99))
    elif name == "demo":
        from agent.demo import demo_dataset

        records = [{"messages": list(r.messages)} for r in read_chatml(demo_dataset()).records]
        write_chatml(train, records)
        write_chatml(validation, demo_records(held_out, seed=99))
    elif name == "hard":
        write_chatml(train, hard_records(records or 400, seed=1))
        write_chatml(validation, hard_records(held_out, seed=99))
    elif name == "dpo-hard":
        write_chatml(train, hard_preferences(records or 400, seed=1))
        write_chatml(validation, hard_preferences(held_out, seed=99))
    elif name == "dpo":
        from agent.train.preference import demo_preferences

        write_chatml(train, demo_preferences(records or 400, seed=1))
        write_chatml(validation, demo_preferences(held_out, seed=99))
    else:
        raise SystemExit(f"bench_quality: unknown task {name!r} (known: demo, hard, dpo, dpo-hard)")
    return Task(name, train, validation)


# --- the simulation ----------------------------------------------------------------------------------


def snapshot(tensors: dict) -> dict:
    """Copies: on the CPU adapter_state() returns views of the live parameters."""
    return {name: tensor.clone() for name, tensor in tensors.items()}


class Trainer:
    """One model in memory; trains from any adapter with a fresh AdamW, as a worker does each round."""

    def __init__(self, config: TrainConfig, task: Task) -> None:
        torch.set_num_threads(config.threads)
        self.config = config
        tokenizer = load_tokenizer(config.base_model)
        self.pad_id = pad_token_id(tokenizer)
        self.examples = load_shard(config, tokenizer, task.train_file).examples
        self.validation = load_shard(config, tokenizer, task.validation_file).examples
        self.model = build_lora_model(config, "cpu", torch.float32, "peft")
        self.initial = snapshot(adapter_state(self.model))
        self.frozen = frozen_keys(self.initial, config.freeze_a)

    def split(self, shards: int, validation_split: float = 0.1) -> list[list[Example]]:
        """The shards' examples as the submitter splits the dataset (validation held out first)."""
        split = split_dataset(len(self.examples), shards, validation_split, self.config.seed)
        return [[self.examples[i] for i in indices] for indices in split.shards]

    def session(self, adapter: dict, examples: list[Example], config: TrainConfig) -> LoraSession:
        load_adapter_state(self.model, adapter)
        return LoraSession(self.model, examples, config, device="cpu", dtype=torch.float32, pad_id=self.pad_id)

    def train(self, adapter: dict, examples: list[Example], config: TrainConfig, steps: int,
              offset: int = 0, every: int = 0, on_eval=None, optimizer: dict | None = None,
              within: str = "constant", window: tuple[int, int] | None = None, tail: float = 0.0,
              correction: dict | None = None, frozen_v: bool = False) -> tuple[dict, dict]:
        """(adapter, AdamW state) after ``steps`` steps from ``adapter`` (and ``optimizer``, else fresh);
        ``within``: the rate within the round (constant, or cosine from the round's rate to 0.1x);
        ``window`` (first, round_steps): these steps are the round's steps first.. of round_steps;
        ``correction``: added to every step's gradient of each named tensor before AdamW reads it (SCAFFOLD's
        c - c_i, a study); ``frozen_v``: AdamW's second moment held at the round's start (``optimizer``, the
        averaged state) through the round, so every worker divides by the same preconditioner (a study)."""
        session = self.session(adapter, examples, config)
        if optimizer:
            session.load_optimizer_tensors(optimizer)
        if optimizer and frozen_v:
            held = {id(p): state["exp_avg_sq"].clone() for p, state in session.optimizer.state.items()
                    if "exp_avg_sq" in state}

            def hold(*_args: Any) -> None:
                for p, state in session.optimizer.state.items():
                    if id(p) in held:
                        state["exp_avg_sq"].copy_(held[id(p)])

            session.optimizer.register_step_post_hook(hold)
        if correction:
            def corrected(*_args: Any) -> None:
                for name, parameter in session.parameters.items():
                    if name in correction and parameter.grad is not None:
                        parameter.grad.add_(correction[name])

            session.optimizer.register_step_pre_hook(corrected)
        first, total = window or (0, steps)
        averaged, counted = None, 0  # ``tail``: the mean of the iterates after the last int(tail * steps) steps
        for step in range(steps):
            if within != "constant":
                for group in session.optimizer.param_groups:
                    group["lr"] = config.learning_rate * within_round_factor(within, first + step, total)
            session.step(offset + step)
            if every and (step + 1) % every == 0:
                on_eval(step + 1, session.evaluate(self.validation))
            if tail and step >= steps - max(1, int(tail * steps)):
                now = session.adapter_tensors()
                averaged = now if averaged is None else {k: averaged[k] + now[k] for k in now}
                counted += 1
        if averaged is not None:
            last = snapshot(session.adapter_tensors())  # frozen tensors as they are (A of FFA-LoRA)
            return ({k: last[k] if k in self.frozen else v / counted for k, v in averaged.items()},
                    snapshot(session.optimizer_tensors()))
        return snapshot(session.adapter_tensors()), snapshot(session.optimizer_tensors())

    def evaluate(self, adapter: dict) -> float:
        return self.session(adapter, self.examples[:1], self.config).evaluate(self.validation)

    def gradient(self, adapter: dict, examples: list[Example], config: TrainConfig, batches: int,
                 offset: int = 0) -> dict:
        """The mean gradient of ``batches`` steps' batches of ``examples`` at ``adapter`` (no step taken)."""
        session = self.session(adapter, examples, config)
        total: dict = {}

        def accumulate() -> None:
            for name, parameter in session.parameters.items():
                if parameter.grad is not None:
                    total[name] = total.get(name, 0) + parameter.grad.detach().clone()

        session.optimizer.step = accumulate  # (the session clears the gradients after its optimizer step)
        for k in range(batches):
            session.step(offset + k)
        return {name: tensor / batches for name, tensor in total.items()}


def within_round_factor(rule: str, step: int, steps: int) -> float:
    """The rate within a round: ``triangle`` is the protocol's (training.inner_schedule,
    protocol/schedule.inner_rate_factor); ``cosine`` (1 down to 0.1) was only studied."""
    if rule == "cosine":
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / max(steps - 1, 1)))
    try:
        return inner_rate_factor(rule, step, steps)
    except ValueError as error:
        raise SystemExit(f"bench_quality: --within: {error}") from None


def curve(trainer: Trainer, examples: list[Example], config: TrainConfig, steps: int, every: int) -> list[tuple[int, float]]:
    """Validation loss every ``every`` steps of one uninterrupted run (step 0 = the base + init)."""
    points = [(0, trainer.evaluate(trainer.initial))]
    trainer.train(trainer.initial, examples, config, steps, every=every,
                  on_eval=lambda step, loss: points.append((step, loss)))
    return points


def steps_to_reach(points: list[tuple[int, float]], loss: float) -> tuple[float, bool]:
    """First (interpolated) step at which the best-so-far loss of ``points`` is <= ``loss``;
    (last step, True) when the curve never gets there (the efficiency is then a lower bound)."""
    best_step, best = points[0]
    if best <= loss:
        return 0.0, False
    for step, value in points[1:]:
        if value <= loss:
            # linear between the best point so far and this one
            return best_step + (step - best_step) * (best - loss) / (best - value), False
        if value < best:
            best_step, best = step, value
    return float(points[-1][0]), True


def network_run(trainer: Trainer, shards: list[list[Example]], config: TrainConfig, *, rounds: int,
                steps: int, method: str, outer: OuterOptimizer, schedule: str = "constant",
                warmup_rounds: int = 0, continue_data: bool = True, lr_scale: float = 1.0,
                carry: bool = True, codec: str = "none", sent: list | None = None,
                within: str = "constant", ramp: tuple[int, ...] = (), overlap: str = "none",
                snr: float | None = None, tail: float = 0.0, downlink: str = "none", scaffold: int = 0,
                downlink_rounds: str = "all", spread: float | None = None, frozen_v: bool = False) -> list[float]:
    """The protocol's training, in process: validation loss after each round's aggregate. With
    ``codec`` int8 every worker's end state goes through the report codec (agent/train/codec.py), as
    a worker's does; ``sent`` collects (payload bytes, whole-report bytes) per report. ``ramp``: the
    first rounds' steps (a study of shorter first rounds), then ``steps`` a round to the same total.
    ``overlap`` (issue 24 step 2, a study): rounds that do not wait for the last round's aggregate.
    ``own``: a worker starts round r+1 at once from what it knows then, the aggregate of round r-1 plus
    its own round-r update (Streaming DiLoCo's merge with a one-round delay), with its own AdamW state;
    round r's aggregate is round r-1's plus the shard-weighted mean of the workers' round-r updates.
    ``stale``: the same without its own update (a one-round-delayed outer step: PCCL's async DiLoCo).
    ``downlink`` (a study, issue 24: the aggregate is 9× the bytes of an ``int4-fresh`` report, and every
    worker fetches it): the round's aggregate and averaged AdamW state go through that report codec from the
    round's start, as a worker's end state does, before the next round starts from them.
    ``scaffold`` (a study of client drift, SCAFFOLD option I, Karimireddy et al. 2020): at each round's start every
    shard's mean gradient g_i over that many batches at the aggregate, c = their shard-weighted mean, and each
    worker's every step's gradient corrected by c - g_i (the extra gradients are not counted as steps)."""
    if overlap.startswith("lag:"):
        return lagged_run(trainer, shards, config, rounds=rounds, steps=steps, within=within, lag=overlap[4:],
                          method=method)
    if overlap != "none":
        return overlapped_run(trainer, shards, config, rounds=rounds, steps=steps, schedule=schedule,
                              warmup_rounds=warmup_rounds, within=within, mode=overlap)
    plan = round_plan(steps, rounds, ramp)
    rounds = len(plan)
    aggregate_now, state, optimizer = trainer.initial, {}, None
    losses = []
    for rnd in range(1, rounds + 1):
        lr = lr_scale * round_learning_rate(config.learning_rate, rnd, rounds, schedule=schedule,
                                            warmup_rounds=warmup_rounds)
        round_config = config.with_(learning_rate=lr)
        offset = sum(plan[:rnd - 1]) if continue_data else 0
        steps = plan[rnd - 1]
        optimizer_before = optimizer
        corrections = [None] * len(shards)
        if scaffold:
            grads = [trainer.gradient(aggregate_now, shard, round_config, scaffold, offset) for shard in shards]
            weights = [len(shard) / sum(len(s) for s in shards) for shard in shards]
            mean_grad = {k: sum(w * g[k] for w, g in zip(weights, grads)) for k in grads[0]}
            corrections = [{k: mean_grad[k] - g[k] for k in g} for g in grads]
        trained = [(trainer.train(aggregate_now, shard, round_config, steps, offset=offset, optimizer=optimizer,
                                  within=within, tail=tail, correction=correction, frozen_v=frozen_v),
                    len(shard)) for shard, correction in zip(shards, corrections)]
        if codec != "none":
            trained = [(coded(aggregate_now, adapter, opt if carry else {}, trainer.frozen, sent, codec,
                              optimizer if carry else None), n)
                       for (adapter, opt), n in trained]
        mean = aggregate(method, [(adapter, n) for (adapter, _), n in trained])
        if carry:  # IPIP-0006 §2.3: the next round starts from the averaged AdamW state
            optimizer = average_optimizer_states([(opt, n) for (_, opt), n in trained])
        if snr is not None:
            mean = snr_gain(aggregate_now, mean, optimizer, len(shards), snr,
                            sum(lr * within_round_factor(within, s, steps) if within != "constant" else lr
                                for s in range(steps)))
        if spread is not None:
            rates = [lr * within_round_factor(within, s, steps) for s in range(steps)]
            mean = spread_gain(aggregate_now, mean, [adapter for (adapter, _), _ in trained], spread,
                               sum(rates) ** 2 / sum(r * r for r in rates))
        round_start, optimizer_start = aggregate_now, optimizer_before
        aggregate_now, state = outer_step(aggregate_now, mean, state, outer, step=rnd, frozen=trainer.frozen)
        if downlink != "none" and (downlink_rounds == "all" or coded_round(rnd, rounds)):
            aggregate_now, coded_optimizer = coded(round_start, aggregate_now, optimizer if carry else {},
                                                   trainer.frozen, None, downlink,
                                                   optimizer_start if carry else None)
            if carry:
                optimizer = coded_optimizer
        losses.append(trainer.evaluate(aggregate_now))
    return losses


def overlapped_run(trainer: Trainer, shards: list[list[Example]], config: TrainConfig, *, rounds: int, steps: int,
                   schedule: str, warmup_rounds: int, within: str, mode: str) -> list[float]:
    """``network_run`` with ``overlap`` (its docstring): validation loss of each round's aggregate."""
    if mode not in ("own", "stale"):
        raise SystemExit(f"bench_quality: --overlap: {mode!r} is not one of none, own, stale")
    weights = [len(shard) / sum(len(s) for s in shards) for shard in shards]
    known = trainer.initial  # the aggregate a worker knows at the end of a round: the round before's
    aggregate_now = trainer.initial
    starts, optimizers = [trainer.initial] * len(shards), [None] * len(shards)
    losses = []
    for rnd in range(1, rounds + 1):
        lr = round_learning_rate(config.learning_rate, rnd, rounds, schedule=schedule, warmup_rounds=warmup_rounds)
        trained = [trainer.train(starts[i], shard, config.with_(learning_rate=lr), steps, offset=(rnd - 1) * steps,
                                 optimizer=optimizers[i], within=within) for i, shard in enumerate(shards)]
        updates = [{k: end[k] - starts[i][k] for k in end} for i, (end, _) in enumerate(trained)]
        mean = {k: sum(w * u[k] for w, u in zip(weights, updates)) for k in updates[0]}
        known, aggregate_now = aggregate_now, {k: aggregate_now[k] + mean[k] for k in aggregate_now}
        starts = [{k: known[k] + (updates[i][k] if mode == "own" else 0) for k in known} for i in range(len(shards))]
        optimizers = [opt for _, opt in trained]
        losses.append(trainer.evaluate(aggregate_now))
    return losses


def snr_gain(start: dict, mean: dict, optimizer: dict, workers: int, cap: float, lr_sum: float) -> dict:
    """A study (issue 24 step 1, W = 8): the mean update lengthened per coordinate by how much each worker's
    AdamW step was shortened by its own batch's noise against the W-times larger batch sync data parallel
    averages. Per trained tensor: v = the averaged bias-corrected second moment (the workers' g^2 + noise),
    g^2 estimated from the mean update over the round (|delta| * sqrt(v) / sum of the round's rates), the
    global batch's v' = g^2 + (v - g^2) / W; gain = sqrt(v / v') clamped to [1, cap]."""
    out, gains = dict(mean), []
    for key, value in mean.items():
        state = {k[len(key) + 1:]: t for k, t in optimizer.items() if k.startswith(key + ".")} if optimizer else {}
        if "exp_avg_sq" not in state:
            continue
        delta = value - start[key]
        if not bool(delta.abs().sum()):
            continue
        steps = float(state["step"].max()) if "step" in state else 1.0
        v = state["exp_avg_sq"] / (1 - 0.999 ** steps)
        g2 = torch.minimum((delta.abs() * (v.sqrt() + 1e-8) / lr_sum) ** 2, v)
        global_v = g2 + (v - g2) / workers
        gain = (v / global_v.clamp_min(1e-30)).sqrt().clamp(1.0, cap)
        out[key] = start[key] + gain * delta
        gains.append(float(gain.mean()))
    print(f"# snr gain: mean {sum(gains) / max(len(gains), 1):.3f} over {len(gains)} tensors", file=sys.stderr, flush=True)
    return out


def spread_gain(start: dict, mean: dict, ends: list[dict], cap: float, steps_eff: float) -> dict:
    """A study (issue 24 step 1, W = 8): the mean update lengthened per coordinate by how much the W workers'
    AdamW steps were shortened by their batches' noise, estimated from how much their round updates disagree
    rather than from the second moment (snr_gain). Per coordinate, with d_i = end_i - start, mu their mean and
    s2 their sample variance across workers: on a locally linear loss each worker's update is H steps of
    lr (g + n)/sqrt(g^2 + sigma^2), so d_i = common drift + noise of variance s2, and the common drift's
    square is mu^2 - s2/W. rho = drift^2 / (H_eff s2) estimates (g / sigma)^2 per batch (H_eff = (sum of the
    round's rates)^2 / sum of their squares). Sync data parallel's batch W times larger divides by
    sqrt(g^2 + sigma^2/W) instead, so its step (signal and averaged noise alike) is the mean's times
    gain = sqrt((rho + 1) / (rho + 1/W)), clamped to [1, cap]."""
    workers = len(ends)
    out, gains = dict(mean), []
    for key, value in mean.items():
        mu = value - start[key]
        if workers < 2 or not bool(mu.abs().sum()):
            continue
        deltas = torch.stack([end[key] - start[key] for end in ends])
        s2 = ((deltas - mu) ** 2).sum(0) / (workers - 1)
        drift2 = (mu * mu - s2 / workers).clamp_min(0)
        rho = drift2 / (steps_eff * s2).clamp_min(1e-30)
        gain = ((rho + 1) / (rho + 1 / workers)).sqrt().clamp(1.0, cap)
        out[key] = start[key] + gain * mu
        gains.append(float(gain.mean()))
    print(f"# spread gain: mean {sum(gains) / max(len(gains), 1):.3f} over {len(gains)} tensors", file=sys.stderr,
          flush=True)
    return out


def lagged_run(trainer: Trainer, shards: list[list[Example]], config: TrainConfig, *, rounds: int, steps: int,
               within: str, lag: str, method: str) -> list[float]:
    """``network_run`` where round r+1's first ``tau`` steps are trained before round r's aggregate is in
    (Streaming DiLoCo's overlap of tau inner steps, issue 24 step 2, a study): each worker goes on from its own
    round-r end E_i (its own AdamW state) with round r+1's first tau batches to X_i, then, the aggregate A_r in,
    starts again from A_r + (X_i - E_i) for the round's other steps. ``lag`` is ``tau`` or ``tau:avg`` (the
    merge takes the round's averaged AdamW state, as a synchronous round starts with, instead of its own)."""
    tau_text, _, state_rule = lag.partition(":")
    tau = int(tau_text)
    if not 0 <= tau < steps:
        raise SystemExit(f"bench_quality: --overlap lag:{lag}: tau must be 0..{steps - 1}")
    aggregate_now, optimizer, ends = trainer.initial, None, None
    losses = []
    for rnd in range(1, rounds + 1):
        offset = (rnd - 1) * steps
        trained = []
        for i, shard in enumerate(shards):
            if ends is None or tau == 0:
                trained.append(trainer.train(aggregate_now, shard, config, steps, offset=offset, optimizer=optimizer,
                                             within=within))
                continue
            end, own = ends[i]
            ahead, ahead_state = trainer.train(end, shard, config, tau, offset=offset, optimizer=own, within=within,
                                               window=(0, steps))
            start = {k: aggregate_now[k] + (ahead[k] - end[k]) for k in aggregate_now}
            trained.append(trainer.train(start, shard, config, steps - tau, offset=offset + tau,
                                         optimizer=optimizer if state_rule == "avg" else ahead_state, within=within,
                                         window=(tau, steps)))
        pairs = [(adapter, len(shard)) for (adapter, _), shard in zip(trained, shards)]
        aggregate_now = aggregate(method, pairs)
        optimizer = average_optimizer_states([(opt, len(shard)) for (_, opt), shard in zip(trained, shards)])
        ends = trained
        losses.append(trainer.evaluate(aggregate_now))
    return losses


def round_plan(steps: int, rounds: int, ramp: tuple[int, ...] = ()) -> list[int]:
    """Steps of each round: ``ramp`` first, then ``steps`` a round, ``steps x rounds`` in all."""
    budget, plan = steps * rounds, []
    for length in (*ramp, *([steps] * rounds)):
        if budget <= 0:
            break
        plan.append(min(length, budget))
        budget -= plan[-1]
    return plan


def coded(start: dict, adapter: dict, optimizer: dict, frozen: list, sent: list | None,
          codec: str = "int8", optimizer_start: dict | None = None) -> tuple[dict, dict]:
    """A worker's end state as the coordinator gets it through the report codec (bytes counted
    at the codec's bits per value, as the payload file stores them); ``optimizer_start``: the round's."""
    payload, adapter, optimizer = round_trip(start, adapter, optimizer, frozen, codec, optimizer_start)
    if sent is not None:
        whole = sum(t.numel() * t.element_size() for t in (*adapter.values(), *optimizer.values()))
        sent.append((payload_bytes(payload), whole))
    return adapter, optimizer


def demo_network_loss(trainer: Trainer, shards: int, rounds: int, steps: int, directory: Path) -> tuple[float, float]:
    """Run a real `infernet demo` (separate agent processes over libp2p) with the job's defaults and
    score its final aggregate here, the same way as the simulated rows: (validation loss, seconds)."""
    import re
    import subprocess

    from safetensors.torch import load_file

    started = time.perf_counter()
    command = [sys.executable, "-m", "agent.cli", "demo", "--shards", str(shards), "--rounds", str(rounds),
               "--steps", str(steps), "--dir", str(directory)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    found = re.search(r"adapter \(Hugging Face PEFT layout\): (\S+)", done.stdout.replace("\n", ""))
    if done.returncode != 0 or not found:
        raise SystemExit(f"bench_quality: infernet demo failed: {(done.stdout + done.stderr)[-500:]}")
    adapter = load_file(str(Path(found.group(1)) / "adapter_model.safetensors"))
    return trainer.evaluate(adapter), time.perf_counter() - started


def inner_lr_scale(text: str, workers: int) -> float:
    """``none`` 1, ``sqrt`` sqrt(W), or a number: the factor on the network's inner learning rate."""
    if text in ("none", "sqrt"):
        return workers ** 0.5 if text == "sqrt" else 1.0
    try:
        return float(text)
    except ValueError:
        raise SystemExit(f"bench_quality: bad --inner-scale {text!r} (none, sqrt or a number)") from None


def parse_outer(text: str) -> OuterOptimizer:
    """``none``, ``sgd:LR[:MOMENTUM]``, ``nesterov:LR:MOMENTUM``, ``adam:LR[:BETA1:BETA2]``."""
    if text.startswith(("snr", "spread")):  # snr|spread[:CAP]: no outer optimizer, a per-coordinate gain (a study)
        return OuterOptimizer("none")
    name, *numbers = text.split(":")
    values = [float(x) for x in numbers]
    if name == "none":
        return OuterOptimizer()
    if name in ("sgd", "nesterov"):
        return OuterOptimizer(name, *values[:2])
    if name == "adam":
        return OuterOptimizer("adam", values[0], 0.0, *values[1:3])
    raise SystemExit(f"bench_quality: bad --outer {text!r}")


def emit(bench: str, value: float, unit: str, reference: float, ratio: float, goal: float | None, **extra) -> None:
    print(json.dumps({"bench": bench, "value": round(value, 4), "unit": unit, "reference": round(reference, 4),
                      "ratio": round(ratio, 4), "goal": goal, **extra}), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", default="demo,hard")
    parser.add_argument("--workers", default="2,4,8")
    parser.add_argument("--total", type=int, default=800, help="optimizer steps of compute, all workers together")
    parser.add_argument("--rounds", default="8", help="rounds per job (comma list to sweep)")
    parser.add_argument("--outer", default="none,nesterov:0.7:0.9", help="outer optimizers (comma list)")
    parser.add_argument("--method", default="exact", help="the aggregation rule (fedavg for --train-method full)")
    parser.add_argument("--train-method", default="lora", choices=("lora", "full"),
                        help="what trains: a LoRA adapter, or every weight of the tiny model (method: full)")
    parser.add_argument("--validation", type=int, default=48, help="held-out records (pairs) each task is scored on")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--schedule", default="constant", help="constant | cosine (comma list): inner lr across rounds")
    parser.add_argument("--warmup-rounds", type=int, default=0)
    parser.add_argument("--inner-scale", default="none",
                        help="none | sqrt | a number (comma list): the network's inner lr is --lr x that (sqrt: x sqrt(W))")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--worker-batch", default="",
                        help="the network's per-worker batch (comma list; default --batch): at the same compute in "
                             "examples, a round of H steps at batch 2b holds the examples of 2H steps at batch b")
    parser.add_argument("--extend", type=float, default=1.5, help="centralized run length as a multiple of --total")
    parser.add_argument("--same-data-each-round", action="store_true",
                        help="restart each round's sample order at step 0 (the protocol before IPIP-0006 §2.5)")
    parser.add_argument("--no-sync", action="store_true", help="skip the sync-DP baseline")
    parser.add_argument("--optimizer-state", default="carried,fresh",
                        help="carried | fresh (comma list): each round's AdamW from the averaged state, or afresh")
    parser.add_argument("--codec", default="none", help="none | int8 (comma list): the report codec (IPIP-0006 §2.8)")
    parser.add_argument("--within", default="constant",
                        help="constant | triangle | cosine (comma list): the inner rate within a round "
                             "(triangle: training.inner_schedule; cosine: a study)")
    parser.add_argument("--ramp", default="",
                        help="first rounds' steps, ';'-separated plans of ','-separated steps (e.g. '25,25,50;12,12,25,50'), "
                             "taken out of the same total (the job option training.first_round_steps); an empty plan "
                             "is no ramp")
    parser.add_argument("--overlap", default="none",
                        help="none | own | stale | lag:TAU[:avg] (comma list): rounds that do not wait for the last aggregate "
                             "(a study; lag: the next round's first TAU steps trained from the worker's own end)")
    parser.add_argument("--downlink", default="none",
                        help="a study: the report codec the round's aggregate and AdamW state go through too "
                             "(comma list; none | int8 | int4-fresh ...)")
    parser.add_argument("--downlink-rounds", default="all", choices=("all", "protocol"),
                        help="which rounds' aggregates --downlink codes: every one (the first study), or rounds 2 to "
                             "the last but one, as the protocol does (IPIP-0006 §2.8.1)")
    parser.add_argument("--tail", default="0",
                        help="comma list of fractions: a worker reports the mean of its iterates over the round's last "
                             "fraction of steps (tail averaging, a study); 0: its last iterate")
    parser.add_argument("--scaffold", default="0",
                        help="comma list of batch counts: a study of SCAFFOLD's drift correction (network_run); 0: off")
    parser.add_argument("--frozen-v", action="store_true",
                        help="a study: each worker's AdamW second moment held at the round's averaged one through "
                             "the round (one preconditioner for all workers; network_run)")
    parser.add_argument("--quick", action="store_true", help="demo task, W=4, T=200: a smoke run")
    parser.add_argument("--seeds", default="7",
                        help="training seeds (comma list: LoRA init, shard split, batch order); with several, each row "
                             "is run per seed (names end /seed<k>) and a codec's rows are paired with the uncoded ones "
                             "of the same seed: codec_E/... and codec_loss/... print the means and their change")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--records", type=int, default=0,
                        help="training records per task (0: the shipped 400); more keeps long jobs off many epochs")
    parser.add_argument("--network", action="store_true",
                        help="also one row from a real `infernet demo` (demo task, W=4, the first --rounds)")
    args = parser.parse_args(argv)
    if args.quick:
        args.tasks, args.workers, args.total, args.extend = "demo", "4", 200, 1.0
    model = tiny_model()
    seeds = [int(x) for x in args.seeds.split(",")]
    results: dict[tuple, dict[str, tuple[float, float]]] = {}  # (task, W, R, label w/o codec, seed) -> codec -> (E, loss)
    for seed in seeds:
        _one_seed(args, model, seed, results, suffix=f"/seed{seed}" if len(seeds) > 1 else "")
    if len(seeds) > 1:
        _codec_deltas(results)
    return 0


def _codec_deltas(results: dict) -> None:
    """Each codec against no codec, paired by seed: the mean E and final validation loss of both (value: the
    codec's, reference: the uncoded run's), and the mean change. E's goal: lower by at most 0.02 (issue 24)."""
    pairs: dict[tuple, list[tuple[float, float, float, float]]] = {}
    for (task, workers, rounds, label, seed), by_codec in results.items():
        if "none" not in by_codec:
            continue
        e0, l0 = by_codec["none"]
        for codec, (e, loss) in by_codec.items():
            if codec != "none":
                pairs.setdefault((task, workers, rounds, label, codec), []).append((e, e0, loss, l0))
    for (task, workers, rounds, label, codec), rows in sorted(pairs.items()):
        n = len(rows)
        e, e0, loss, l0 = (sum(r[i] for r in rows) / n for i in range(4))
        name = f"{task}/W{workers}/{rounds}/{label}+{codec}"
        emit(f"codec_E/{name}", e, "E", e0, e / e0, round((e0 - 0.02) / e0, 4), seeds=n, delta=round(e - e0, 4),
             per_seed=[round(r[0] - r[1], 4) for r in rows])
        emit(f"codec_loss/{name}", loss, "nats", l0, l0 / loss, None, seeds=n, delta=round(loss - l0, 4),
             per_seed=[round(r[2] - r[3], 4) for r in rows])


def _one_seed(args: Any, model: Path, seed: int, results: dict, suffix: str) -> None:
    config = TrainConfig(base_model=str(model), seed=seed, learning_rate=args.lr, batch_size=args.batch,
                         max_seq_len=96, rank=16, alpha=32.0, target_modules=TARGETS, method=args.train_method,
                         freeze_a=args.method == "exact" and args.train_method != "full", threads=args.threads)
    outers = [(text, parse_outer(text)) for text in args.outer.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-quality-") as tmp:
        for task_name in args.tasks.split(","):
            task = make_task(task_name, Path(tmp), args.records, args.validation)
            trainer = Trainer(config.with_(objective="dpo", dpo_beta=0.1) if task_name.startswith("dpo") else config, task)
            started = time.perf_counter()
            [everything] = trainer.split(1)
            every = max(1, args.total // 32)
            central = curve(trainer, everything, trainer.config, int(args.total * args.extend), every)
            central_at_total = min(loss for step, loss in central if step <= args.total)
            print("# centralized curve: " + " ".join(f"{step}:{loss:.3f}" for step, loss in central),
                  file=sys.stderr, flush=True)
            print(f"# {task_name}: centralized {args.total} steps: best val loss {central_at_total:.4f} "
                  f"({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
            for workers in (int(w) for w in args.workers.split(",")):
                shards = trainer.split(workers)
                sync = None
                if not args.no_sync:
                    sync_steps = args.total // workers
                    sync = curve(trainer, everything, trainer.config.with_(batch_size=args.batch * workers), sync_steps,
                                 max(1, sync_steps // 32))
                    sync_final = min(loss for _, loss in sync)
                    reached, capped = steps_to_reach(central, sync_final)
                    emit(f"efficiency/{task_name}/W{workers}/sync-DP", reached / args.total, "E", 1.0,
                         reached / args.total, GOAL, lower_bound=capped, val_loss=round(sync_final, 4))
                for rounds, worker_batch in itertools.product(
                        (int(r) for r in args.rounds.split(",")),
                        (int(b) for b in (args.worker_batch or str(args.batch)).split(","))):
                    steps = args.total * args.batch // (workers * rounds * worker_batch)
                    if steps < 1:
                        continue
                    variants = itertools.product(outers, args.optimizer_state.split(","), args.codec.split(","),
                                                 args.schedule.split(","), args.inner_scale.split(","),
                                                 args.within.split(","), args.ramp.split(";"), args.overlap.split(","),
                                                 [float(t) for t in args.tail.split(",")], args.downlink.split(","),
                                                 [int(b) for b in args.scaffold.split(",")])
                    for (label, outer), carried, codec, schedule, inner_scale, within, ramp_text, overlap, tail, \
                            downlink, scaffold in variants:
                        ramp = tuple(int(x) for x in ramp_text.split(",") if x)
                        started, sent = time.perf_counter(), []
                        snr = spread = None
                        if label.startswith("snr"):
                            snr = float(label.split(":")[1]) if ":" in label else workers ** 0.5
                        if label.startswith("spread"):
                            spread = float(label.split(":")[1]) if ":" in label else workers ** 0.5
                        losses = network_run(trainer, shards, trainer.config.with_(batch_size=worker_batch), snr=snr,
                                             tail=tail,
                                             rounds=rounds, steps=steps, method=args.method,
                                             outer=outer, schedule=schedule, warmup_rounds=args.warmup_rounds,
                                             continue_data=not args.same_data_each_round,
                                             lr_scale=inner_lr_scale(inner_scale, workers),
                                             carry=carried == "carried", codec=codec, sent=sent, within=within,
                                             ramp=ramp, overlap=overlap, downlink=downlink, scaffold=scaffold,
                                             downlink_rounds=args.downlink_rounds, spread=spread,
                                             frozen_v=args.frozen_v)
                        label = f"{label}+{carried}" + "".join(f"+{x}" for x in (codec, schedule, inner_scale)
                                                               if x not in ("none", "constant"))
                        label += f"+within-{within}" if within != "constant" else ""
                        label += f"+ramp-{'-'.join(map(str, ramp))}" if ramp else ""
                        label += f"+overlap-{overlap}" if overlap != "none" else ""
                        label += f"+batch{worker_batch}" if worker_batch != args.batch else ""
                        label += f"+tail{tail:g}" if tail else ""
                        label += f"+down-{downlink}" if downlink != "none" else ""
                        label += "-protocol" if downlink != "none" and args.downlink_rounds == "protocol" else ""
                        label += f"+scaffold{scaffold}" if scaffold else ""
                        label += "+frozen-v" if args.frozen_v else ""
                        final = losses[-1]
                        reached, capped = steps_to_reach(central, final)
                        efficiency = reached / args.total
                        name = f"{task_name}/W{workers}/R{rounds}x{steps}/{label}{suffix}"
                        plain = label.replace(f"+{codec}", "") if codec != "none" else label
                        results.setdefault((task_name, workers, f"R{rounds}x{steps}", plain, seed), {})[codec] = \
                            (efficiency, final)
                        emit(f"efficiency/{name}", efficiency, "E", 1.0, efficiency, GOAL, lower_bound=capped)
                        if sync is not None:
                            reached_sync, capped_sync = steps_to_reach(sync, final)
                            e_sync = reached_sync / (args.total // workers)
                            emit(f"efficiency_sync/{name}", e_sync, "E", 1.0, e_sync, None, lower_bound=capped_sync)
                        emit(f"val_loss/{name}", final, "nats", central_at_total, central_at_total / final, None,
                             per_round=[round(x, 4) for x in losses],
                             seconds=round(time.perf_counter() - started, 1))
                        if sent:
                            payload, whole = sum(p for p, _ in sent) / len(sent), sum(w for _, w in sent) / len(sent)
                            emit(f"report_bytes/{name}", payload, "bytes", whole, whole / payload, 8.0)
            if args.network and task_name == "demo":
                rounds = int(args.rounds.split(",")[0])
                steps = args.total // (4 * rounds)
                final, seconds = demo_network_loss(trainer, 4, rounds, steps, Path(tmp) / "demo-net")
                reached, capped = steps_to_reach(central, final)
                emit(f"efficiency/demo/W4/R{rounds}x{steps}/infernet-demo", reached / args.total, "E", 1.0,
                     reached / args.total, GOAL, lower_bound=capped, val_loss=round(final, 4), seconds=round(seconds))


if __name__ == "__main__":
    raise SystemExit(main())
