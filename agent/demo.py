"""`infernet demo`: a whole network on loopback in one command, one job through it, the result measured.

Rules of this file:
- Every agent is a real, separate process (`infernet agent run`), with its own identity, home and
  config written here exactly as an operator's would be: one submitter (never trains, never
  coordinates) and ``workers`` opted-in agents, one of which the election makes coordinator. Each
  worker process uses one torch thread (the machines this runs on may have two cores).
- The demo only talks to the agents as the CLI does, over their control sockets: announce the job
  on the submitter, poll it for the live table, fetch the final aggregate by CID.
- The outcome is measured with stock transformers + peft, not with our training code: validation
  loss of the base model, then of base + the fetched adapter (HF layout), on held-out records.
- Every subprocess is ended on any exit (success, failure, Ctrl-C): SIGTERM, then SIGKILL after a
  grace period; and if the demo itself is killed (SIGKILL, SIGHUP), the kernel sends each agent
  SIGTERM (PR_SET_PDEATHSIG): no agent outlives it. Homes are 0700 with 0600 keys, as
  ``infernet agent init`` makes them. Success is exit 0; any failure is one line and exit 1.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from rich.console import Console

from agent.config import CONFIG_FILE, IDENTITY_FILE
from agent.channel import ControlError, request
from agent.keyfile import save_identity
from protocol.identity import Identity

MODEL_NAME = "infernet-tiny"
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
STOP_GRACE_SECONDS = 10.0


class DemoError(Exception):
    """The demo could not complete; ``str()`` is the one line to show."""


@dataclass(frozen=True)
class DemoOptions:
    workers: int = 3
    shards: int = 4
    # 16 short rounds: with the AdamW state carried across rounds, the shorter a round the closer the
    # job gets to one machine's training at the same compute (scripts/bench_quality.py, IPIP-0006 §2.3)
    rounds: int = 16
    steps: int = 12
    # the steps of the first rounds, before `steps` a round (training.first_round_steps, IPIP-0006 §2.5)
    first_round_steps: tuple[int, ...] = ()
    directory: Path | None = None
    timeout: float = 600.0
    verbose: bool = False
    # a ChatML dataset of your own instead of the demo's (`--dataset`): longer sequences, and the
    # validation loss measured on the job's own held-out split of it
    dataset: Path | None = None
    # sft, or dpo: a preference job (the demo task's right answers preferred over evasions and wrong ones,
    # agent/train/preference.demo_preferences; or `--dataset` preference records)
    type: str = "sft"
    # lora, or full: every weight of the tiny model trains (aggregation fedavg), and the fetched result is a
    # model directory transformers loads
    method: str = "lora"

    @property
    def max_seq_len(self) -> int:
        return 96 if self.dataset is None else 256


def demo_dataset() -> Path:
    """The demo's ChatML dataset, shipped inside the package (agent/data/demo.jsonl, 400 records)."""
    path = Path(str(resources.files("agent") / "data" / "demo.jsonl"))
    if not path.is_file():
        raise DemoError(f"{path}: the demo dataset is missing from this installation")
    return path


SEED = 7
VALIDATION_SPLIT = 0.1


def dataset_name(options: DemoOptions) -> str:
    if options.dataset is not None:
        return "dataset.jsonl"
    return "demo-preferences.jsonl" if options.type == "dpo" else "demo.jsonl"


def demo_spec(options: DemoOptions) -> str:
    what = ("the demo task (colours, French words, counting, spelling)" if options.dataset is None
            else f"the records of {options.dataset.name}")
    if options.type == "dpo":
        what = f"to prefer the chosen answers of {'the demo task' if options.dataset is None else options.dataset.name}"
    dpo = "type: dpo\ndpo:\n  beta: 0.1\n" if options.type == "dpo" else ""
    full = options.method == "full"
    if full:
        what += ", every weight of the model fine-tuned"
    method = "method: full                      # every weight trains; fedavg averages the weights\n" if full else ""
    first_rounds = (f"  first_round_steps: [{', '.join(map(str, options.first_round_steps))}]   # shorter first rounds "
                    f"(ipips/0006 §2.5)\n" if options.first_round_steps else "")
    return f"""\
# The demo job: the tiny model learns {what}.
name: infernet-demo{"-dpo" if options.type == "dpo" else ""}{"-full" if full else ""}
base_model: {MODEL_NAME}
seed: {SEED}
{method}{dpo}input:
  dataset: {dataset_name(options)}
  validation_split: {VALIDATION_SPLIT}
training:
  learning_rate: {0.001 if full else 0.01}
  batch_size: 8
  max_steps: {options.steps}
  max_seq_len: {options.max_seq_len}
  inner_schedule: triangle        # warm up, then decay within each round (ipips/0006 §2.5)
{first_rounds}lora:
  rank: 16
  alpha: 32
  target_modules: [{", ".join(TARGET_MODULES)}]
shards: {options.shards}
rounds: {options.rounds}
aggregation: {"fedavg" if full else "exact"}
max_retries: 2
proof:
  checkpoint_every: {max(1, options.steps // 4)}
  verify_segments: 1
lease_seconds: 120
"""


AGENT_CONFIG = """\
# written by `infernet {writer}`
listen = ["{listen}"]
accept_training = {accept}
can_coordinate = {coordinate}
threads = 1
heartbeat_seconds = 1.0
{extra}
[models]
"{model_name}" = "{model_path}"
"""


def agent_config(*, accept: bool, coordinate: bool, model_path: Path | str, listen: str = "/ip4/127.0.0.1/tcp/0",
                 writer: str = "demo", extra: str = "") -> str:
    """The config.toml of a demo-style agent (the demo's, the soak's, the network-age probe's)."""
    return AGENT_CONFIG.format(writer=writer, listen=listen, accept=str(accept).lower(),
                               coordinate=str(coordinate).lower(), extra=extra, model_name=MODEL_NAME,
                               model_path=model_path)


class DemoNetwork:
    """The agent processes of the demo; ``close()`` ends them all."""

    def __init__(self, root: Path, model: Path, verbose: bool) -> None:
        self.root = root
        self.model = model
        self.verbose = verbose
        self.processes: list[tuple[str, subprocess.Popen]] = []

    def home(self, name: str) -> Path:
        return self.root / name

    def start(self, name: str, *, accept_training: bool, coordinate: bool, bootstrap: str | None = None) -> Path:
        home = self.home(name)
        home.mkdir(parents=True, mode=0o700)
        os.chmod(home, 0o700)  # as `infernet agent init` makes a home (mkdir's mode is cut by the umask)
        save_identity(Identity.generate(), home / IDENTITY_FILE)
        (home / CONFIG_FILE).write_text(agent_config(accept=accept_training, coordinate=coordinate,
                                                     model_path=self.model))
        command = [sys.executable, "-m", "agent.cli", "agent", "run", "--home", str(home),
                   "--log-file", str(home / "agent.log")]
        if bootstrap:
            command += ["--bootstrap", bootstrap]
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                   PYTHONUNBUFFERED="1")
        stderr = open(home / "stderr.log", "wb")  # noqa: SIM115 - handed to the child
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, env=env,
                                   start_new_session=True,  # our Ctrl-C is ours to relay, in order
                                   preexec_fn=die_with(os.getpid()))  # ... and our death (SIGKILL, SIGHUP) theirs
        stderr.close()
        self.processes.append((name, process))
        return home

    def wait_ready(self, name: str, timeout: float = 60.0) -> dict:
        home = self.home(name)
        process = dict(self.processes)[name]
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise DemoError(f"agent {name} exited with status {process.returncode}: {self._last_error(home)}")
            try:
                return request(home, "status", timeout=5)
            except ControlError:
                if time.monotonic() > deadline:
                    raise DemoError(f"agent {name} did not answer on its control socket within {timeout:.0f} s") from None
                time.sleep(0.2)

    def check_alive(self) -> None:
        for name, process in self.processes:
            if process.poll() is not None:
                raise DemoError(f"agent {name} exited with status {process.returncode}: "
                                f"{self._last_error(self.home(name))}")

    def _last_error(self, home: Path) -> str:
        for log in (home / "stderr.log", home / "agent.log"):
            try:
                lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
            except OSError:
                continue
            if lines:
                return lines[-1][:300]
        return "no output"

    def close(self) -> None:
        for _, process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for _, process in self.processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def die_with(parent: int):
    """A preexec_fn tying the child to ``parent``: when the demo dies however it dies (SIGKILL, a
    SIGHUP from a closed terminal), the kernel sends each agent SIGTERM (Linux PR_SET_PDEATHSIG), so
    it releases its leases and stops instead of running on in its own session. Elsewhere: nothing."""
    def tie() -> None:
        import ctypes

        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:  # the demo died before the tie was made
            os.kill(os.getpid(), signal.SIGTERM)

    return tie if sys.platform.startswith("linux") else None


def _check_spec(options: DemoOptions) -> None:
    """The job the options make is refused here, in one line, before anything starts (e.g. ``--first-rounds``
    naming as many rounds as ``--rounds``)."""
    from protocol.errors import SpecError
    from protocol.jobspec import parse_spec

    try:
        parse_spec(demo_spec(options), "the demo's job spec")
    except SpecError as err:
        raise DemoError(str(err)) from None


def run_demo(options: DemoOptions) -> int:
    console = Console(soft_wrap=True)  # a path or CID printed whole (copied from the terminal), never cut in two
    started = time.monotonic()
    root = options.directory or Path(tempfile.mkdtemp(prefix="infernet-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    if any(root.iterdir()):
        raise DemoError(f"{root}: not empty; give --dir a new directory")
    _check_spec(options)
    network: DemoNetwork | None = None
    signal.signal(signal.SIGTERM, _interrupt)  # a SIGTERM stops the agents too, like Ctrl-C
    try:
        from agent.train.tiny import tiny_model

        console.print(f"[bold]infernet demo[/bold]: 1 submitter + {options.workers} workers on loopback, "
                      f"a {options.shards}-shard x {options.rounds}-round job  (files in {root})")
        with console.status("building the tiny base model (cached after the first run)"):
            model = tiny_model()
        from agent.train.data import check_dataset

        if options.dataset is None and options.type == "dpo":
            from agent.train.data import write_chatml
            from agent.train.preference import demo_preferences

            dataset = root / dataset_name(options)
            write_chatml(dataset, demo_preferences(400, seed=SEED))
        elif options.dataset is None:
            dataset = shutil.copy(demo_dataset(), root / dataset_name(options))
        else:
            check_dataset(options.dataset, options.shards, VALIDATION_SPLIT, SEED,  # DataError: one line
                          "preference" if options.type == "dpo" else "chatml")
            dataset = shutil.copy(options.dataset, root / dataset_name(options))
        spec = root / "infernet.train.yml"
        spec.write_text(demo_spec(options))

        network = DemoNetwork(root, model, options.verbose)
        network.start("submitter", accept_training=False, coordinate=False)
        status = network.wait_ready("submitter")
        bootstrap = status["addrs"][0]
        for i in range(options.workers):
            network.start(f"worker{i}", accept_training=True, coordinate=True, bootstrap=bootstrap)
        for i in range(options.workers):
            network.wait_ready(f"worker{i}")
        submitter = network.home("submitter")
        with console.status(f"waiting for the {options.workers} workers to be heard on the network"):
            deadline = time.monotonic() + 60
            while request(submitter, "status")["peers"] < options.workers:
                network.check_alive()
                if time.monotonic() > deadline:
                    raise DemoError("the workers were not heard by the submitter within 60 s (see agent.log in each home)")
                time.sleep(0.3)
        console.print(f"network up in {time.monotonic() - started:.0f} s: submitter {status['peer_id']}")

        job = request(submitter, "job.announce", timeout=300, spec=str(spec), dataset=str(dataset))
        console.print(f"announced job {job['id']}")
        from agent.progress import JobProgress

        deadline = time.monotonic() + options.timeout
        from agent.tblog import job_scalars, open_log

        try:  # the job's curves, as `job watch` writes them (None: no tensorboard)
            scalars = open_log(root / "tensorboard")
        except OSError:
            scalars = None
        with JobProgress(console=console) as progress:
            while True:
                detail = request(submitter, "job.show", job=job["id"])
                progress.update(detail)
                if scalars is not None:
                    scalars.add_all(job_scalars(detail))
                if detail["state"] in ("DONE", "FAILED", "CANCELLED"):
                    break
                network.check_alive()
                if time.monotonic() > deadline:
                    raise DemoError(f"the job did not finish within {options.timeout:.0f} s "
                                    f"(it is {detail['state']} in round {detail['round']})")
                time.sleep(0.5)
        if detail["state"] != "DONE":
            raise DemoError(f"the job ended {detail['state']}: {detail['reason']}")

        fetched = request(submitter, "job.fetch", timeout=120, job=job["id"], out=str(root / "adapter"))
        _keep_job_record(submitter, detail, fetched)
        with console.status("measuring validation loss with stock transformers + peft"):
            measure = preference_scores if options.type == "dpo" else validation_losses
            before, after = measure(model, Path(fetched["path"]), root / "validation.jsonl",
                                    dataset=None if options.dataset is None else Path(dataset),
                                    max_seq_len=options.max_seq_len)
        console.print(f"\njob {job['id'][:16]} DONE in {time.monotonic() - started:.0f} s")
        from agent.progress import round_timing, utilization_line

        timing = round_timing(detail)
        for agg in detail.get("aggregates", []):  # the coordinator's own score, signed in each aggregate
            if agg.get("validation_loss") is not None:
                base = agg.get("base_validation_loss")
                console.print(f"round {agg['round']}: validation loss "
                              + (f"{base:.3f} (base) -> " if base is not None else "")
                              + f"{agg['validation_loss']:.3f}"
                              + (f", reward accuracy {agg['reward_accuracy']:.2f}" if agg.get("reward_accuracy") is not None
                                 else "") + timing.get(agg["round"], ""), highlight=False)

        if line := utilization_line(detail):
            console.print(line, highlight=False)
        console.print(f"aggregate CID:   {fetched['cid']}")
        if options.type == "dpo":
            console.print(f"validation DPO loss: {before.loss:.3f} (base) -> {after.loss:.3f} (base + adapter); "
                          f"reward accuracy {after.reward_accuracy:.2f}, margin {after.reward_margin:.2f}")
            before, after = before.loss, after.loss
        else:
            console.print(f"validation loss: {before:.3f} (base) -> {after:.3f} "
                          + ("(fine-tuned model)" if fetched.get("layout") == "model" else "(base + adapter)"))
        if fetched.get("layout") == "model":
            console.print(f"model (Hugging Face layout, every weight fine-tuned): {fetched['path']}")
        else:
            console.print(f"adapter (Hugging Face PEFT layout): {fetched['path']}")
        if scalars is not None:
            scalars.close()
            console.print(f"curves: tensorboard --logdir {scalars.logdir}", highlight=False)
        if not after < before:
            raise DemoError(f"the adapter did not lower the validation loss ({before:.3f} -> {after:.3f})")
        return 0
    except DemoError as exc:
        console.print(f"[red]infernet demo failed:[/red] {exc}", highlight=False)
        return 1
    except ControlError as exc:
        console.print(f"[red]infernet demo failed:[/red] {exc}", highlight=False)
        return 1
    except KeyboardInterrupt:
        console.print("infernet demo: interrupted; stopping the agents")
        return 130
    finally:
        if network is not None:
            network.close()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _keep_job_record(submitter: Path, detail: dict, fetched: dict) -> None:
    """Beside the fetched aggregate, the job it came from (agent/pipeline/source.keep_job_record)."""
    from agent.pipeline.source import keep_job_record

    keep_job_record(submitter, detail, fetched)


def _stock_measure(out: Path, dataset: Path | None, fresh: list[dict], read: Any) -> None:
    """Ready the stock (transformers + peft) measure of a demo's outcome: their logging quiet, a few torch
    threads, and the held-out records in ``out``: ``fresh`` ones, or with ``dataset`` the job's own
    validation split of it, read with ``read`` (all of it when the split is empty)."""
    import warnings

    import torch
    from transformers.utils import logging as hf_logging

    from agent.train.data import split_dataset, write_chatml

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(max(1, min(os.cpu_count() or 1, 4)))
    if dataset is None:
        write_chatml(out, fresh)
    else:
        records = read(dataset).records
        held = split_dataset(len(records), 1, VALIDATION_SPLIT, SEED).validation or range(len(records))
        write_chatml(out, [records[i] for i in held])


def validation_losses(model_dir: Path, adapter_dir: Path, out: Path, *, dataset: Path | None = None,
                      max_seq_len: int = 96) -> tuple[float, float]:
    """Mean loss on assistant tokens of held-out records (``_stock_measure``): base model, then base +
    adapter (stock peft), or the fetched model of a full fine-tuning."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from agent.train import TrainConfig
    from agent.train.data import read_chatml
    from agent.train.model import load_tokenizer
    from agent.train.run import load_shard
    from agent.train.tiny import demo_records

    _stock_measure(out, dataset, demo_records(48, seed=99), read_chatml)
    tokenizer = load_tokenizer(str(model_dir))
    examples = load_shard(TrainConfig(base_model=str(model_dir), max_seq_len=max_seq_len, threads=1), tokenizer,
                          out).examples
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)

    def loss(model) -> float:
        model.eval()
        total = 0.0
        with torch.no_grad():
            for ex in examples:
                total += float(model(input_ids=torch.tensor([ex.input_ids]), labels=torch.tensor([ex.labels])).loss)
        return total / len(examples)

    before = loss(base)
    if (adapter_dir / "adapter_config.json").exists():
        return before, loss(PeftModel.from_pretrained(base, str(adapter_dir)))
    # full fine-tuning: the fetched directory is a whole model (agent/train/model.as_model_dir)
    return before, loss(AutoModelForCausalLM.from_pretrained(str(adapter_dir), dtype=torch.float32))


def preference_scores(model_dir: Path, adapter_dir: Path, out: Path, *, dataset: Path | None = None,
                      max_seq_len: int = 96) -> tuple:
    """A DPO job's outcome on held-out preference pairs, measured with stock transformers + peft: the DPO
    loss (beta 0.1, the reference being the base model: peft's ``disable_adapter``), reward accuracy and
    margin, of the base model and of base + adapter (train.loop.Evaluation each). Held out: fresh demo
    preference records, or with ``dataset`` the job's own validation split of it (``_stock_measure``)."""
    import torch
    import torch.nn.functional as F
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from agent.train.loop import Evaluation
    from agent.train.model import load_tokenizer
    from agent.train.preference import demo_preferences, read_preferences, tokenize_pairs

    _stock_measure(out, dataset, demo_preferences(48, seed=99), read_preferences)
    pairs, _ = tokenize_pairs(load_tokenizer(str(model_dir)), read_preferences(out).records, max_seq_len)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32),
                                      str(adapter_dir))
    model.eval()

    def log_prob(example) -> float:
        logits = model(input_ids=torch.tensor([example.input_ids])).logits[0, :-1].float()
        labels = torch.tensor(example.labels[1:])
        keep = labels != -100
        return float(logits.log_softmax(-1)[keep].gather(1, labels[keep].unsqueeze(1)).sum())

    with torch.no_grad():
        with model.disable_adapter():
            reference = [log_prob(p.chosen) - log_prob(p.rejected) for p in pairs]
        policy = [log_prob(p.chosen) - log_prob(p.rejected) for p in pairs]

    def score(ratios: list[float]) -> Evaluation:
        margins = torch.tensor([0.1 * (r - ref) for r, ref in zip(ratios, reference)])
        return Evaluation(float(-F.logsigmoid(margins).mean()), float((margins > 0).float().mean()),
                          float(margins.mean()))

    return score(reference), score(policy)
