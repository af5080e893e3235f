"""The ``infernet`` command line: a thin face over the agent.

Rules of this file:
- Commands that need a running agent talk to it over its control socket (agent/control.py); the
  others (init, train, data, demo) work on local files. The CLI never opens a network port.
- Every user mistake is one line on stderr, ``infernet: WHAT IS WRONG (what to do)``, and exit
  status 1 (2 for a command-line usage error, from argparse). No traceback unless ``--verbose``.
- Every read command takes ``--json``: one JSON document on stdout, nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from agent import __version__
from agent.errors import UserError
from agent.files import input_file
from protocol import PROTOCOL_VERSION

TINY_MODEL_NAME = "infernet-tiny"
"""A base-model name every command understands: the tiny demo model (agent/train/tiny.py), built on first use."""


# -- the parser -------------------------------------------------------------------------------------

def _step_list(text: str) -> tuple[int, ...]:
    """``--first-rounds 12,12,24``: a comma list of step counts, each at least 1 ('' is none)."""
    try:
        steps = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a comma list of whole numbers") from None
    if any(n < 1 for n in steps):
        raise argparse.ArgumentTypeError(f"{text!r}: every round trains at least 1 step")
    return steps


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--home", type=Path, default=None,
                        help="agent home directory (default: $INFERNET_HOME or ~/.infernet)")
    common.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="show tracebacks and debug output")
    reader = argparse.ArgumentParser(add_help=False)
    reader.add_argument("--json", action="store_true", help="print one JSON document instead of text")

    parser = argparse.ArgumentParser(
        prog="infernet", description="Peer-to-peer agent that trains LoRA adapters across many machines.")
    parser.add_argument("--version", action="version",
                        version=f"infernet-agent {__version__} (protocol v{PROTOCOL_VERSION})")
    parser.add_argument("--verbose", action="store_true", help="show tracebacks and debug output")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser("demo", parents=[common], help="run the demo network on loopback (1 submitter + 3 workers)")
    demo.add_argument("--workers", type=int, default=3, help="worker agents (default 3; one of them coordinates)")
    demo.add_argument("--shards", type=int, default=4, help="dataset shards (default 4)")
    demo.add_argument("--rounds", type=int, default=16, help="train-then-aggregate rounds (default 16)")
    demo.add_argument("--steps", type=int, default=12, help="optimizer steps per shard and round (default 12)")
    demo.add_argument("--first-rounds", type=_step_list, default=(), metavar="N,N,...",
                      help="steps of the first rounds, before --steps a round (training.first_round_steps; "
                           "'' for none)")
    demo.add_argument("--dir", type=Path, default=None, help="where the agents' homes go (default: a new temp dir)")
    demo.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds")
    demo.add_argument("--dataset", type=Path, default=None, metavar="FILE",
                      help="train on this ChatML JSONL (e.g. from `train data`) instead of the demo task")
    demo.add_argument("--method", choices=("lora", "full"), default="lora",
                      help="lora (default), or full: every weight of the tiny model trains, and the result is a "
                           "model directory")
    demo.add_argument("--type", choices=("sft", "dpo"), default="sft",
                      help="sft (default), or dpo: a preference job (the demo task's right answers preferred over "
                           "evasions and wrong ones; with --dataset, preference records)")

    agent = sub.add_parser("agent", help="run and inspect this machine's agent").add_subparsers(
        dest="action", metavar="ACTION", required=True)
    init = agent.add_parser("init", parents=[common], help="create the identity key and a commented config.toml")
    init.add_argument("--json", action="store_true", help="print the result as JSON")
    run = agent.add_parser("run", parents=[common], help="run the agent headless until SIGTERM")
    run.add_argument("--listen", action="append", metavar="MULTIADDR", help="listen address (repeatable)")
    run.add_argument("--bootstrap", action="append", metavar="MULTIADDR", help="peer to join through (repeatable)")
    run.add_argument("--announce", action="append", metavar="MULTIADDR",
                     help="address peers should dial, e.g. a port your router forwards (repeatable)")
    run.add_argument("--relay", nargs="?", const="true", choices=("auto", "true", "false"), default=None,
                     help="serve circuit relay v2 to agents behind NAT: auto (the default: while this agent "
                          "is publicly reachable), true (--relay alone) or false")
    run.add_argument("--accept-training", action="store_true", default=None,
                     help="train other people's jobs here (also INFERNET_ACCEPT_TRAINING=1)")
    run.add_argument("--no-coordinate", action="store_true", help="never coordinate jobs")
    run.add_argument("--max-concurrent-shards", type=int, metavar="N")
    run.add_argument("--allowed-base-model", action="append", metavar="NAME", help="only train these (repeatable)")
    run.add_argument("--min-price", type=float, metavar="PER_HOUR", help="refuse jobs paying less per hour")
    run.add_argument("--threads", type=int, metavar="N", help="torch threads per training")
    run.add_argument("--model", action="append", metavar="NAME=PATH", help="a local base model (repeatable)")
    run.add_argument("--log-file", type=Path, help="JSON log lines go here instead of stdout")
    run.add_argument("--metrics-port", type=int, metavar="PORT",
                     help="serve Prometheus metrics on 127.0.0.1:PORT/metrics (0 = any free port)")
    agent.add_parser("status", parents=[common, reader], help="what the running agent is doing")
    agent.add_parser("stop", parents=[common], help="stop the running agent cleanly (as SIGTERM does)")
    sub.add_parser("peers", parents=[common, reader], help="peers the running agent hears")
    sub.add_parser("providers", parents=[common, reader],
                   help="training providers the agent hears: hardware, models, price, speed, busy/idle, reputation")
    sub.add_parser("models", parents=[common, reader], help="base models the live providers hold (name, hash, count)")

    job = sub.add_parser("job", help="announce and follow training jobs").add_subparsers(
        dest="action", metavar="ACTION", required=True)
    announce = job.add_parser("announce", parents=[common, reader], help="announce a job from a spec file")
    announce.add_argument("spec", type=Path, metavar="SPEC.yml")
    announce.add_argument("--dataset", type=Path, help="ChatML JSONL dataset (default: the spec's input.dataset)")
    announce.add_argument("--yes", action="store_true", help="announce without showing the estimate and asking")
    announce.add_argument("--wait", action="store_true",
                          help="announce even when no live peer can train it now (it waits for one)")
    estimate = job.add_parser("estimate", parents=[common, reader],
                              help="tokens, steps, worker-hours and cost of a job spec on the providers heard now")
    estimate.add_argument("spec", type=Path, metavar="SPEC.yml")
    estimate.add_argument("--dataset", type=Path, help="ChatML JSONL dataset (default: the spec's input.dataset)")
    for p in (announce, estimate):
        p.add_argument("--max-nodes", type=int, metavar="N", help="lease to at most N distinct workers")
        p.add_argument("--provider", action="append", metavar="PEER",
                       help="lease only to this provider (repeatable; see `infernet providers`)")
    bill = job.add_parser("bill", parents=[common, reader],
                          help="the job's bill: per worker accepted shards, hours, price, amount (signed)")
    bill.add_argument("id", metavar="ID")
    job.add_parser("list", parents=[common, reader], help="jobs the agent knows")
    show = job.add_parser("show", parents=[common, reader], help="a job's state now: shards, leases, aggregates")
    show.add_argument("id", metavar="ID")
    watch = job.add_parser("watch", parents=[common, reader], help="live table of a job until it ends")
    watch.add_argument("id", metavar="ID")
    watch.add_argument("--interval", type=float, default=1.0)
    watch.add_argument("--timeout", type=float, default=None, help="stop watching after this many seconds")
    watch.add_argument("--logdir", type=Path, default=None, metavar="DIR",
                       help="TensorBoard logs of the job (default HOME/runs/JOB; --no-tensorboard for none)")
    watch.add_argument("--no-tensorboard", action="store_true", help="write no TensorBoard logs")
    fetch = job.add_parser("fetch", parents=[common, reader], help="fetch the job's aggregate adapter (HF layout)")
    fetch.add_argument("id", metavar="ID")
    fetch.add_argument("--out", type=Path, required=True, metavar="DIR")
    fetch.add_argument("--round", type=int, help="a round's aggregate (default: the latest)")
    cancel = job.add_parser("cancel", parents=[common, reader], help="cancel a job you submitted")
    cancel.add_argument("id", metavar="ID")
    cancel.add_argument("--reason", default="cancelled by the submitter")
    ledger = job.add_parser("ledger", parents=[common, reader], help="print and verify the job's signed event log")
    ledger.add_argument("id", metavar="ID")
    ledger.add_argument("--export", type=Path, metavar="FILE",
                        help="also write every chain of the job we hold, with the public keys, as JSON to FILE")
    ledger.add_argument("--sync", action="store_true", help="first pull the chains the job's live peers hold")
    ledgers = sub.add_parser("ledger", help="job ledgers without an agent").add_subparsers(
        dest="action", metavar="ACTION", required=True)
    lverify = ledgers.add_parser("verify", parents=[common, reader],
                                 help="check a ledger export file (from `job ledger ID --export FILE`)")
    lverify.add_argument("file", type=Path)

    ui = sub.add_parser("ui", parents=[common], help="a read-only web page of the network and its jobs, on 127.0.0.1")
    ui.add_argument("--port", type=int, default=0, help="the port on 127.0.0.1 (default: a free one)")

    train = sub.add_parser("train", help="single-node training without the network").add_subparsers(
        dest="action", metavar="ACTION", required=True)
    tinit = train.add_parser("init", parents=[common], help="write a commented infernet.train.yml")
    tinit.add_argument("--output", type=Path, default=Path("."), metavar="DIR")
    tinit_from = tinit.add_mutually_exclusive_group()
    tinit_from.add_argument("--preset", choices=("quick-test", "balanced", "quality"), default=None,
                            help="a spec tuned for: quick-test (a smoke run in about a minute), balanced (a useful "
                                 "adapter at moderate cost), quality (more rank, modules and steps)")
    tinit_from.add_argument("--from", dest="source", type=Path, default=None, metavar="CONFIG",
                            help="convert a TRL config (YAML or JSON, as `trl sft --config` reads) or an Axolotl "
                                 "YAML; every field not honoured is named, one line each")
    trun = train.add_parser("run", parents=[common, reader], help="train on this machine")
    trun.add_argument("--local", action="store_true", required=True, help="train here, without the network")
    trun.add_argument("--config", type=Path, metavar="FILE", help="the job spec (infernet.train.yml)")
    trun.add_argument("--resume", type=Path, metavar="RUN_DIR",
                      help="continue an interrupted run from its last checkpoint (its spec, data and proof chain)")
    trun.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    trun.add_argument("--no-tensorboard", action="store_true",
                      help="write no TensorBoard logs (default: RUN_DIR/tensorboard, when tensorboard is installed)")
    trun.add_argument("--dataset", type=Path, help="override input.dataset")
    trun.add_argument("--model", type=Path, help="local base model directory (default: the spec's base_model)")
    trun.add_argument("--output", type=Path, metavar="DIR", help="run directory (default: runs/NAME-TIME)")
    trun.add_argument("--threads", type=int, default=None)
    trun.add_argument("--preset", choices=("quick-test", "auto"), default=None,
                      help="quick-test: at most 20 steps, short sequences; auto: device, dtype and micro-batch "
                           "from this machine's free VRAM (the spec's effective batch kept)")

    tdata = train.add_parser("data", parents=[common, reader],
                             help="make a ChatML dataset from a web search, URLs, a sitemap or local files")
    source = tdata.add_argument_group("sources (one or more)")
    source.add_argument("--query", metavar="TEXT", help="web search (ValueSerp: VALUESERP_API_KEY or [search] in config.toml)")
    source.add_argument("--urls", type=Path, metavar="FILE", help="a file of URLs, one a line (# comments)")
    source.add_argument("--sitemap", action="append", default=[], metavar="URL", help="a sitemap.xml (repeatable)")
    source.add_argument("--dir", type=Path, metavar="PATH", help="local .html, .md and .txt files under PATH")
    tdata.add_argument("--out", type=Path, required=True, metavar="FILE", help="the ChatML JSONL to write")
    tdata.add_argument("--domains", default="", metavar="A,B", help="only pages on these domains (and below)")
    tdata.add_argument("--num", type=int, default=None, metavar="N", help="at most N pages (search default: 10)")
    tdata.add_argument("--provider", default="valueserp", help="search provider (default valueserp)")
    tdata.add_argument("--search-endpoint", metavar="URL", default=None,
                       help="the provider's API URL (default its own; also $INFERNET_SEARCH_ENDPOINT)")
    tdata.add_argument("--min-chars", type=int, default=200, help="shortest passage in characters (default 200)")
    tdata.add_argument("--max-chars", type=int, default=4000, help="longest passage in characters (default 4000)")
    tdata.add_argument("--timeout", type=float, default=20.0, help="seconds for one request (default 20)")
    tdata.add_argument("--max-bytes", type=int, default=5 << 20, help="largest page in bytes (default 5 MiB)")
    tdata.add_argument("--retries", type=int, default=2, help="tries again after a timeout or 429/5xx (default 2)")
    tdata.add_argument("--delay", type=float, default=1.0,
                       help="seconds between requests to one host (default 1; robots.txt Crawl-delay wins if longer)")


    infer = sub.add_parser("infer", parents=[common, reader],
                           help="generate with a base model + trained adapter (a prompt, dataset samples, or a chat)")
    infer.add_argument("source", metavar="RUN_OR_ADAPTER_OR_JOB",
                       help="a run directory of `train run --local`, an adapter directory, or a job ID")
    infer.add_argument("--base", type=Path, metavar="DIR", help="base model directory (default: what the source names)")
    infer.add_argument("--prompt", help="one user message; without it: --samples, stdin, or a chat on a terminal")
    infer.add_argument("--system", help="a system message before the prompt")
    infer.add_argument("--samples", type=int, metavar="N", help="N prompts drawn from a dataset, answers beside the expected")
    infer.add_argument("--dataset", type=Path, metavar="FILE",
                       help="ChatML JSONL for --samples (default: the run's validation, else training data)")
    infer.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default 0.7)")
    infer.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling mass (default 0.9)")
    infer.add_argument("--max-new-tokens", type=int, default=128, help="default 128")
    infer.add_argument("--repetition-penalty", type=float, default=1.0, help="default 1.0 (none)")
    infer.add_argument("--seed", type=int, default=0, help="sampling and --samples draw seed (default 0)")
    infer.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                       help="auto (default): a CUDA GPU when there is one, in bf16 where supported; else the CPU")
    publish = sub.add_parser("publish", parents=[common, reader],
                             help="merge a trained adapter into its base; export GGUF, an Ollama model, or to the Hub")
    publish.add_argument("source", metavar="RUN_OR_ADAPTER_OR_JOB",
                         help="a run directory of `train run --local`, an adapter directory, or a job ID")
    publish.add_argument("--base", type=Path, metavar="DIR", help="base model directory (default: what the source names)")
    publish.add_argument("--merged", type=Path, metavar="DIR", help="write the merged model here (Hugging Face layout)")
    publish.add_argument("--gguf", type=Path, metavar="FILE", help="write a GGUF file (llama.cpp's converter)")
    publish.add_argument("--quant", default="q4_k_m",
                         help="GGUF type: f32, f16, bf16, q8_0, or a llama.cpp quantization such as q4_k_m (default)")
    publish.add_argument("--llama-cpp-path", type=Path, metavar="DIR",
                         help="a llama.cpp checkout (convert_hf_to_gguf.py, build/bin/llama-quantize)")
    publish.add_argument("--ollama", metavar="NAME", help="write a Modelfile beside the GGUF and `ollama create NAME`")
    publish.add_argument("--hf", metavar="REPO", help="upload the merged model to the Hugging Face Hub (OWNER/NAME)")
    publish.add_argument("--private", action="store_true", help="with --hf: a private repository")
    publish.add_argument("--dry-run", action="store_true", help="with --hf: list what would be uploaded, send nothing")

    data = sub.add_parser("data", help="dataset files: check, content addresses").add_subparsers(
        dest="action", metavar="ACTION", required=True)
    dadd = data.add_parser("add", parents=[common, reader],
                           help="print a file's CID (CIDv1, raw leaves: as `ipfs add --cid-version=1`)")
    dadd.add_argument("file", type=Path)
    dcheck = data.add_parser("check", parents=[common, reader],
                             help="validate a ChatML (or DPO preference) JSONL file: every bad line, counts, tokens, "
                                  "duplicates")
    dcheck.add_argument("file", type=Path)
    dcheck.add_argument("--model", default=None, metavar="PATH",
                        help=f"count tokens with this model's tokenizer and chat template ({TINY_MODEL_NAME}: the tiny model)")
    dcheck.add_argument("--max-seq-len", type=int, default=None, metavar="N",
                        help="also count records training would cut at N tokens (needs --model)")
    dcheck.add_argument("--format", choices=("chatml", "preference"), default=None,
                        help="what a record is (default: preference if the first record has \"chosen\", else chatml)")
    dverify = data.add_parser("verify", parents=[common, reader], help="check that a file has the given CID")
    dverify.add_argument("file", type=Path)
    dverify.add_argument("cid")
    dget = data.add_parser("get", parents=[common, reader],
                           help="fetch any CID through the running agent, checking every block, into FILE")
    dget.add_argument("cid", metavar="CID")
    dget.add_argument("--out", type=Path, required=True, metavar="FILE")
    dget.add_argument("--max-size", type=int, default=None, metavar="BYTES", help="refuse a file larger than this")
    harness = sub.add_parser("harness", help="protocol test harness: scenarios on real agents").add_subparsers(
        dest="action", metavar="ACTION", required=True)
    hrun = harness.add_parser("run", parents=[reader], help="run scenario files (or shipped scenarios by name)")
    hrun.add_argument("scenarios", nargs="+", metavar="SCENARIO", help="a .yml file, or a shipped scenario's name")
    hrun.add_argument("--seed", type=int, default=None, help="override the scenario's seed")
    hrun.add_argument("--out", type=Path, default=None,
                      help="where homes and trace.jsonl go (default: a new temp dir, kept)")
    hrun.add_argument("--heartbeats", action="store_true", help="write heartbeats into the trace too")
    harness.add_parser("list", parents=[reader], help="the shipped scenarios")
    hcheck = harness.add_parser("check", parents=[reader], help="read scenario files and report mistakes; run nothing")
    hcheck.add_argument("scenarios", nargs="+", metavar="SCENARIO")
    hsoak = harness.add_parser("soak", parents=[reader],
                               help="jobs back to back on agent processes under seeded faults; invariants checked")
    hsoak.add_argument("--minutes", type=float, default=2.0, help="how long to start new jobs (default 2)")
    hsoak.add_argument("--agents", type=int, default=6, help="workers besides the submitter (default 6)")
    hsoak.add_argument("--seed", type=int, default=1, help="the fault schedule's seed (default 1)")
    hsoak.add_argument("--fault-every", type=float, default=8.0, metavar="SECONDS",
                       help="mean seconds between faults (default 8)")
    hsoak.add_argument("--out", type=Path, default=None, help="the agents' homes and logs (default: a new temp dir)")
    return parser


# -- main ---------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    verbose = bool(getattr(args, "verbose", False))
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return COMMANDS[(args.command, getattr(args, "action", None))](args) or 0
    except KeyboardInterrupt:
        print("infernet: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the one place errors become one line
        if verbose or not _is_user_error(exc):
            if verbose:
                raise
            print(f"infernet: internal error: {type(exc).__name__}: {_one_line(exc)} (run with --verbose for details)",
                  file=sys.stderr)
            return 1
        print(f"infernet: {_one_line(exc)}", file=sys.stderr)
        return 1


_USER_ERRORS = (("agent.files", "FileInputError"), ("agent.bundle", "BundleError"), ("agent.config", "ConfigError"), ("agent.channel", "ControlError"),
                ("agent.net.errors", "NetError"), ("agent.store", "StoreError"), ("agent.train.config", "TrainError"),
                ("agent.train.data", "DataError"), ("agent.demo", "DemoError"), ("agent.data", "DataSourceError"),
                ("agent.pipeline.source", "PipelineError"))


def _is_user_error(exc: Exception) -> bool:
    """Errors whose message is meant for the user. Looked up only in modules already imported: an error
    cannot come from a module that was never loaded, and importing agent.train would import torch."""
    from protocol.errors import ProtocolError

    types: list[type] = [UserError, ProtocolError, OSError]
    types += [getattr(sys.modules[mod], name) for mod, name in _USER_ERRORS if mod in sys.modules]
    return isinstance(exc, tuple(types))


def _one_line(exc: Exception) -> str:
    if isinstance(exc, OSError) and exc.filename and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _home(args: argparse.Namespace) -> Path:
    from agent.config import default_home

    return (args.home or default_home()).expanduser().resolve()


def _emit(args: argparse.Namespace, result: Any, text: str) -> None:
    print(json.dumps(result, indent=2, default=str) if getattr(args, "json", False) else text)


# -- agent --------------------------------------------------------------------------------------------

def cmd_agent_init(args: argparse.Namespace) -> int:
    from agent.config import CONFIG_FILE, IDENTITY_FILE, write_config
    from agent.keyfile import load_identity, save_identity
    from protocol.identity import Identity

    home = _home(args)
    key = home / IDENTITY_FILE
    created = not key.exists()
    identity = Identity.generate() if created else load_identity(key)
    if created:
        home.mkdir(parents=True, exist_ok=True)
        os.chmod(home, 0o700)
        save_identity(identity, key)
    had_config = (home / CONFIG_FILE).exists()
    config = write_config(home)
    result = {"home": str(home), "peer_id": identity.peer_id, "identity": str(key), "config": str(config),
              "created": created}
    _emit(args, result, "\n".join([
        f"{'created' if created else 'kept the existing'} identity {identity.peer_id}",
        f"  key:    {key} (mode 0600)",
        f"  config: {config}{' (kept)' if had_config else ' (edit it: every key is commented)'}",
        f"next: infernet agent run --home {home}"]))
    return 0


def exit_before_ready(signum: int, frame: Any) -> None:
    """SIGTERM before the daemon's own handler is in place (imports, the store, the network: seconds):
    end the process at once with status 0. It holds no lease yet, so there is nothing to release, and
    SQLite's journal makes an interrupted open safe. Not ``sys.exit``: a signal handled while Python runs
    a callback (an import lock's weakref callback, a finalizer) raises its SystemExit there, where it is
    printed as "Exception ignored" and dropped; the agent then started anyway and ignored that SIGTERM
    (the soak's kill: exited -9 after 30 s)."""
    os._exit(0)


def cmd_agent_run(args: argparse.Namespace) -> int:
    import signal

    signal.signal(signal.SIGTERM, exit_before_ready)  # until the daemon's own handler is in place
    from agent.config import IDENTITY_FILE, load_config
    from agent.daemon import default_log_stream, run_daemon, setup_logging
    from agent.keyfile import load_identity

    home = _home(args)
    identity = load_identity(home / IDENTITY_FILE)
    models = None
    if args.model:
        pairs = []
        for item in args.model:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise UserError(f"--model {item!r}: expected NAME=PATH")
            pairs.append((name, str(Path(path).expanduser().resolve())))
        models = tuple(pairs)
    config = load_config(
        home, listen=tuple(args.listen) if args.listen else None,
        bootstrap=tuple(args.bootstrap) if args.bootstrap else None, accept_training=args.accept_training,
        announce=tuple(args.announce) if args.announce else None,
        relay={"true": True, "false": False}.get(args.relay, args.relay),
        can_coordinate=False if args.no_coordinate else None, max_concurrent_shards=args.max_concurrent_shards,
        allowed_base_models=tuple(args.allowed_base_model) if args.allowed_base_model else None,
        min_price_per_hour=args.min_price, threads=args.threads)
    if models is not None:
        from dataclasses import replace

        config = replace(config, models=config.models + models)
    config = _with_tiny_model(config)
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise UserError(f"--metrics-port: must be between 0 and 65535, got {args.metrics_port}")
    from agent.net.host import parse_multiaddr, parse_peer_multiaddr  # bad addresses fail before anything starts

    for i, text in enumerate(config.listen):
        parse_multiaddr(text, f"listen[{i}]")
    for i, text in enumerate(config.bootstrap):
        parse_peer_multiaddr(text, f"bootstrap[{i}]")
    for i, text in enumerate(config.announce):
        parse_multiaddr(text, f"announce[{i}]")
    setup_logging(default_log_stream(args.log_file), verbose=bool(getattr(args, "verbose", False)))
    try:
        return run_daemon(identity, config, metrics_port=args.metrics_port)
    except OSError as exc:
        if exc.errno == 98 or "address already in use" in str(exc).lower():
            raise UserError(f"a listen address is already in use ({' '.join(config.listen)}); "
                            "choose another port or stop the other process") from None
        raise
    except BaseExceptionGroup as group:  # trio wraps a failure to start in a group
        first = _first_leaf(group)
        if isinstance(first, OSError) and (first.errno == 98 or "in use" in str(first).lower()):
            raise UserError(f"a listen address is already in use ({' '.join(config.listen)}); "
                            "choose another port or stop the other process") from None
        raise first from None  # noqa: B904 - the one error, not the group around it


def _first_leaf(group: BaseException) -> BaseException:
    while isinstance(group, BaseExceptionGroup):
        group = group.exceptions[0]
    return group


def _with_tiny_model(config: Any) -> Any:
    """Let jobs name ``infernet-tiny`` without configuring it: the tiny model is built locally on demand."""
    from dataclasses import replace

    if any(name == TINY_MODEL_NAME for name, _ in config.models):
        return config
    from agent.train.tiny import default_cache_dir, TINY_VERSION

    cached = default_cache_dir() / f"tiny-qwen2-v{TINY_VERSION}-seed0"
    if not (cached / "model.safetensors").exists():
        return config
    return replace(config, models=config.models + ((TINY_MODEL_NAME, str(cached)),))


def _disk_lines(d: dict | None) -> list[str]:
    if not d:
        return []
    mb = 1e6
    quota = f" of max_disk_gb {d['max_bytes'] / 1e9:g}" if d.get("max_bytes") else " (no limit: max_disk_gb = 0)"
    return [f"  disk:      {d['total_bytes'] / mb:,.1f} MB{quota}: work {d['work_bytes'] / mb:,.1f} MB, "
            f"blocks {d['blocks_bytes'] / mb:,.1f} MB, store and logs {d['other_bytes'] / mb:,.1f} MB; "
            f"collected {d['collected_bytes'] / mb:,.1f} MB since the start"]


def cmd_agent_status(args: argparse.Namespace) -> int:
    from agent.channel import request

    s = request(_home(args), "status")
    jobs = ", ".join(f"{n} {state.lower()}" for state, n in sorted(s["jobs"].items())) or "none"
    _emit(args, s, "\n".join([
        f"agent {s['peer_id']} (infernet-agent {s['version']}, pid {s['pid']}, up {s['uptime_s']:.0f} s)",
        f"  home:      {s['home']}",
        f"  listening: {' '.join(s['addrs'])}",
        f"  peers:     {s['peers']} live, {s['connected']} connected" + _streams_text(s.get("streams")),
        f"  training:  {'accepted' if s['accept_training'] else 'not accepted'}; {s['active_shards']} active shard(s);"
        f" coordinating: {'yes' if s['can_coordinate'] else 'no'}",
        f"  jobs:      {jobs}"] + _disk_lines(s.get("disk")) + _reach_lines(s.get("reach")) + ([f"  REFUSING NEW WORK: {s['refusing_work']}"] if s.get("refusing_work") else [])))
    return 0


def _streams_text(streams: dict | None) -> str:
    """``agent status``: streams open and py-libp2p's stream budget (each new stream waits for a slot)."""
    if not streams:
        return ""
    budget = f", {streams['slots_free']} stream slots free" if streams.get("slots_free") is not None else ""
    return f"; {streams['open']} streams open{budget}"


def _reach_lines(reach: dict | None) -> list[str]:
    """``agent status`` lines on reachability (agent/net/reach.py)."""
    if not reach:
        return []
    relays = ", ".join(f"{r[-8:]}" for r in reach["reservations"]) or "none"
    mode = reach.get("relay_mode")
    serving = ("; serving as a relay" + (" (relay = auto: while public)" if mode == "auto" else "")
               if reach["relay_service"] else "; relay = auto: serves once public" if mode == "auto" else "")
    lines = [f"  reach:     {reach['status']}" + serving +
             (f"; relay slots: {relays}" if reach["status"] == "private" or reach["reservations"] else ""),
             f"  links:     {len(reach['direct'])} direct, {len(reach['relayed'])} relayed" +
             (f"; {reach['circuits_served']} circuit(s) relayed for others" if reach["relay_service"] else "") +
             (f"; {reach['hole_punched']} upgraded to direct by hole punching" if reach.get("hole_punched") else "")]
    lines += [f"  relayed:   {a}" for a in reach["relayed_addrs"][:3]]
    return lines


def cmd_agent_stop(args: argparse.Namespace) -> int:
    from agent.channel import request

    request(_home(args), "stop")
    print("stopping")
    return 0


def cmd_peers(args: argparse.Namespace) -> int:
    from agent.channel import request

    peers = request(_home(args), "peers")
    _emit(args, peers, peers_table(peers) if peers else "no peers yet")
    return 0


def peers_table(peers: list[dict]) -> str:
    """``infernet peers`` as text: liveness, roles, busy/idle, price, GPU, VRAM free/total, models."""
    lines = [f"{'peer':<54} {'live':<5} {'seen':>6} {'trains':<6} {'coord':<5} {'state':<5} {'price/h':>7}  "
             f"{'gpu':<28} {'vram GB':>9}  models"]
    for p in peers:
        gpus = p.get("gpus") or []
        gpu = (f"{len(gpus)}x {gpus[0]['name']}" if len(gpus) > 1 else gpus[0]["name"]) if gpus else \
            ("cpu" if p.get("device") else "?")
        vram = f"{sum(g['vram_free_gb'] for g in gpus):.0f}/{sum(g['vram_total_gb'] for g in gpus):.0f}" if gpus else "-"
        models = ", ".join(x["name"] for x in p.get("models") or []) or "-"
        price = f"{p['price_per_hour']:.2f}" if p.get("price_per_hour") is not None else "?"
        lines.append(f"{p['peer_id']:<54} {'yes' if p['live'] else 'no':<5} {p['last_heartbeat_s']:>5.0f}s "
                     f"{_yn(p['accepts_training']):<6} {_yn(p['can_coordinate']):<5} "
                     f"{'busy' if p.get('busy') else 'idle':<5} {price:>7}  {gpu[:28]:<28} {vram:>9}  {models}")
    return "\n".join(lines)


def cmd_providers(args: argparse.Namespace) -> int:
    from agent.channel import request

    rows = request(_home(args), "providers")
    _emit(args, rows, providers_table(rows) if rows else "no provider's capability heard yet")
    return 0


def providers_table(rows: list[dict]) -> str:
    """``infernet providers`` as text: one line per peer, its models with their measured speed below."""
    lines = [f"{'peer':<20} {'live':<4} {'trains':<6} {'state':<10} {'price/h':>8} {'hardware':<26} {'vram GB':>8} "
             f"{'runtimes':<13} {'reputation (acc/rej/exp)':<26}"]
    for p in rows:
        state = f"busy {p['shards_in_progress']}/{p['max_concurrent_shards']}" if p["busy"] else "idle"
        rep = p["reputation"]
        hardware = (f"{len(p['gpus'])}x " if len(p["gpus"]) > 1 else "") + p["hardware"]
        lines.append(f"{'…' + p['peer_id'][-18:]:<20} {_yn(p['live']):<4} {_yn(p['accepts_training']):<6} "
                     f"{state:<10} {p['price_per_hour']:>8.2f} {hardware[:26]:<26} {p['vram_gb']:>8.1f} "
                     f"{','.join(p['runtimes'])[:13]:<13} {rep['accepted']}/{rep['rejected']}/{rep['expired']} "
                     f"(score {rep['score']:.2f})")
        speeds = {s["sha256"]: s["tokens_per_s"] for s in p["speeds"]}
        for model in p["models"]:
            speed = f"{speeds[model['sha256']]:,.0f} tokens/s" if model["sha256"] in speeds else "speed not measured"
            lines.append(f"{'':<20}   model {model['name']} ({model['sha256'][:12]}…): {speed}")
    return "\n".join(lines)


def cmd_models(args: argparse.Namespace) -> int:
    from agent.channel import request

    rows = request(_home(args), "models")
    lines = [f"{'model':<40} {'sha256':<16} {'providers':>9} {'training':>8}  tokens/s"]
    for r in rows:
        speeds = ", ".join(f"{s:,.0f}" for s in sorted(r["tokens_per_s"])) or "-"
        lines.append(f"{r['name'][:40]:<40} {r['sha256'][:16]:<16} {r['providers']:>9} {r['training']:>8}  {speeds}")
    _emit(args, rows, "\n".join(lines) if rows else "no live provider holds a model yet")
    return 0


def cmd_job_bill(args: argparse.Namespace) -> int:
    from agent.channel import request
    from agent.market import bill_text

    result = request(_home(args), "job.bill", job=args.id)
    _emit(args, result, bill_text(result))
    return 0 if result["ledger"]["consistent"] else 1


def _yn(value: Any) -> str:
    return "?" if value is None else ("yes" if value else "no")


# -- job ------------------------------------------------------------------------------------------------

def _spec_and_dataset(args: argparse.Namespace) -> tuple[Path, Any, Path | None]:
    """The spec and its local dataset file; None when the spec names its dataset by CID and no
    --dataset is given (the agent fetches it)."""
    from agent.specfile import load_spec
    from protocol.jobspec import dataset_cid

    spec_path = args.spec.expanduser().resolve()
    spec = load_spec(spec_path)  # a bad spec is reported here, before the agent is asked
    dataset = None
    if spec.input.hf and not args.dataset:  # read here, where the user's HF_TOKEN and cache are
        dataset = _hf_dataset(spec, _home(args))
    elif args.dataset or dataset_cid(spec.input.dataset) is None:  # else: a CID, fetched by the agent
        _no_mistyped_cid(spec.input.dataset, spec_path, given=args.dataset is not None)
        dataset = (args.dataset or (spec_path.parent / spec.input.dataset)).expanduser().resolve()
        input_file(dataset, "dataset", f" (give --dataset FILE or set input.dataset in {spec_path.name})")
    if getattr(args, "max_nodes", None) is not None and args.max_nodes < 1:
        raise UserError(f"--max-nodes: must be at least 1, got {args.max_nodes}")
    return spec_path, spec, dataset


def _hf_dataset(spec: Any, home: Path) -> Path:
    """``input.hf``'s split as a ChatML file (agent/hfdata.py), under HOME/datasets; UserError if it cannot."""
    from agent.hfdata import HubDataError, spec_dataset

    try:
        return spec_dataset(spec.input, home / "datasets")
    except HubDataError as error:
        raise UserError(f"input.hf {error}") from None


def _estimate(home: Path, spec_path: Path, dataset: Path | None, args: argparse.Namespace) -> dict:
    from agent.channel import request

    return request(home, "job.estimate", timeout=300, spec=str(spec_path),
                   dataset=str(dataset) if dataset else None,  # None: the agent fetches the spec's CID
                   max_nodes=args.max_nodes, providers=args.provider)


def cmd_job_estimate(args: argparse.Namespace) -> int:
    from agent.market import estimate_text

    spec_path, _, dataset = _spec_and_dataset(args)
    result = _estimate(_home(args), spec_path, dataset, args)
    _emit(args, result, estimate_text(result))
    return 0


def cmd_job_announce(args: argparse.Namespace) -> int:
    """Announce a job. Unless ``--yes``: at a terminal, show the estimate and ask; without a terminal,
    a paid job (budget.price_per_hour > 0) is refused (nobody saw its cost) and a volunteer job goes ahead."""
    from agent.channel import request
    from agent.market import estimate_text

    spec_path, spec, dataset = _spec_and_dataset(args)
    home = _home(args)
    if not args.yes:
        if sys.stdin.isatty():
            print(estimate_text(_estimate(home, spec_path, dataset, args)), file=sys.stderr)
            try:
                answer = input("announce this job? [y/N] ").strip().lower()
            except EOFError:
                answer = ""
            if answer not in ("y", "yes"):
                raise UserError("not announced (answer y to announce, or pass --yes)")
        elif spec.budget.price_per_hour > 0:
            raise UserError(f"{spec_path.name}: a paid job (budget.price_per_hour {spec.budget.price_per_hour:g}) "
                            f"is announced only after confirmation; see `infernet job estimate {spec_path.name}`, "
                            "then pass --yes")
    job = request(home, "job.announce", timeout=300, spec=str(spec_path),
                  dataset=str(dataset) if dataset else None,
                  max_nodes=args.max_nodes, providers=args.provider, wait=args.wait)
    _emit(args, job, f"announced job {job['id']}\n  {job['name']}: {job['shards']} shards x {job['rounds']} rounds\n"
                     + (f"  waiting: {job['waiting']}\n" if job.get("waiting") else "")
                     + f"next: infernet job watch {job['id'][:12]}")
    return 0


def cmd_job_list(args: argparse.Namespace) -> int:
    from agent.channel import request

    jobs = request(_home(args), "job.list")
    lines = [f"{'id':<16} {'name':<20} {'role':<10} {'state':<11} round  accepted"]
    for j in jobs:
        accepted = "-" if j["accepted"] is None else f"{j['accepted']}/{j['shards']}"
        lines.append(f"{j['id'][:16]:<16} {j['name'][:20]:<20} {j['role']:<10} {j['state']:<11} "
                     f"{j['round']}/{j['rounds']:<4} {accepted}")
    _emit(args, jobs, "\n".join(lines) if jobs else "no jobs yet")
    return 0


def cmd_job_show(args: argparse.Namespace) -> int:
    from rich.console import Console

    from agent.channel import request
    from agent.progress import JobProgress

    job = request(_home(args), "job.show", job=args.id)
    if args.json:
        print(json.dumps(job, indent=2, default=str))
    else:
        Console().print(JobProgress().render(job))
        from agent.jobdata import facts_text

        print("\n".join(facts_text(job)))
    return 0


def cmd_job_watch(args: argparse.Namespace) -> int:
    from agent.channel import request
    from agent.progress import JobProgress

    home = _home(args)
    started = time.monotonic()
    progress = JobProgress(json_lines=args.json)
    job = request(home, "job.show", job=args.id)
    scalars = None if args.no_tensorboard else _open_tensorboard(args.logdir or home / "runs" / job["id"][:16])
    from agent.tblog import job_scalars

    try:
        with progress:
            while True:
                progress.update(job)
                if scalars is not None:
                    scalars.add_all(job_scalars(job))
                if job["state"] in ("DONE", "FAILED", "CANCELLED"):
                    break
                if args.timeout is not None and time.monotonic() - started > args.timeout:
                    raise UserError(f"job {job['id'][:16]} still {job['state']} after {args.timeout:.0f} s")
                time.sleep(args.interval)
                job = request(home, "job.show", job=args.id)
    finally:
        if scalars is not None:
            scalars.close()
            if scalars.broken:
                print(f"note: {scalars.broken}", file=sys.stderr)
    if not args.json:
        print(progress.final_line(job))
        if scalars is not None and not scalars.broken:
            print(f"TensorBoard: tensorboard --logdir {scalars.logdir}")
    return 0 if job["state"] == "DONE" else 1


def _open_tensorboard(logdir: Path, *, fresh: bool = True) -> Any:
    """A TensorBoard log in ``logdir``, or None with one line on stderr when tensorboard is not installed."""
    from agent.tblog import MISSING, open_log

    try:
        scalars = open_log(logdir.expanduser(), fresh=fresh)
    except OSError as error:  # curves are never worth failing the command for
        print(f"note: TensorBoard log {logdir}: {error.strerror or error}; none written", file=sys.stderr)
        return None
    if scalars is None:
        print(f"note: {MISSING}", file=sys.stderr)
    return scalars


def cmd_job_fetch(args: argparse.Namespace) -> int:
    from agent.channel import request

    result = request(_home(args), "job.fetch", timeout=300, job=args.id, out=str(args.out.expanduser().resolve()),
                     round=args.round)
    from agent.pipeline.source import keep_job_record

    # the job it came from, beside it: `infer --base` checks the base model's hash against it (issue 25)
    keep_job_record(_home(args), request(_home(args), "job.show", job=result["id"]), result)
    head = f"aggregate of round {result['round']}{' (final)' if result['final'] else ''}: {result['cid']}\n"
    if result.get("layout") == "model":  # full fine-tuning: the weights themselves
        _emit(args, result, head + f"  model (Hugging Face layout, every weight fine-tuned): {result['path']}\n"
                                   f"  load: AutoModelForCausalLM.from_pretrained({result['path']!r})")
        return 0
    _emit(args, result, head + f"  adapter (Hugging Face PEFT layout): {result['path']}\n"
                               f"  load: PeftModel.from_pretrained(base_model, {result['path']!r})")
    return 0


def cmd_job_cancel(args: argparse.Namespace) -> int:
    from agent.channel import request

    job = request(_home(args), "job.cancel", job=args.id, reason=args.reason)
    _emit(args, job, f"job {job['id'][:16]}: {job['state']}")
    return 0


def cmd_job_ledger(args: argparse.Namespace) -> int:
    from agent.jobdata import cmd_job_ledger as run

    return run(args, _home(args), _emit)


def cmd_ledger_verify(args: argparse.Namespace) -> int:
    from agent.jobdata import cmd_ledger_verify as run

    return run(args, _emit)


def cmd_data_get(args: argparse.Namespace) -> int:
    from agent.jobdata import cmd_data_get as run

    return run(args, _home(args), _emit)


def cmd_ui(args: argparse.Namespace) -> int:
    """Serve the page (agent/ui) until Ctrl-C; it asks the running agent of --home for everything it shows."""
    from agent.channel import request
    from agent.ui import UiServer

    home = _home(args)
    request(home, "status")  # no agent running: its one line, before a port is opened
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port: must be between 0 and 65535, got {args.port}")
    try:
        server = UiServer(lambda method, **params: request(home, method, **params), port=args.port, home=home).start()
    except OSError as error:
        raise UserError(f"--port {args.port}: cannot listen on 127.0.0.1: {error.strerror or error}") from None
    print(f"infernet ui: {server.url}\n(read only; the token in the URL is this page's key; Ctrl-C stops it)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


# -- train and data (no network) ----------------------------------------------------------------------

def cmd_train_init(args: argparse.Namespace) -> int:
    from protocol.jobspec import SPEC_FILE_NAME, TEMPLATE

    out = args.output.expanduser()
    path = out / SPEC_FILE_NAME
    if path.exists():
        raise UserError(f"{path}: already exists; edit it, or choose another --output")
    text, notes, made = TEMPLATE, [], ""
    if args.preset:
        from agent.train.presets import preset_spec

        text, made = preset_spec(TEMPLATE, args.preset), f" (preset {args.preset})"
    elif args.source is not None:
        from agent.convert import convert

        text, conversion = convert(args.source.expanduser())
        notes = conversion.notes
        made = f" (from {args.source}, a{'n Axolotl' if conversion.source == 'axolotl' else ' TRL'} config)"
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    for line in notes:
        print(f"{args.source}: {line}")
    print(f"wrote {path}{made}\nnext: check name, base_model and the input (input.dataset or input.hf), then "
          f"`infernet train run --local --config {path}` or `infernet job announce {path}`")
    return 0


def cmd_train_run(args: argparse.Namespace) -> int:
    from agent.train import split_dataset
    from agent.train.data import check_dataset
    from agent.specfile import load_spec

    if args.resume is not None:
        if args.config is not None or args.dataset is not None or args.model is not None or args.preset:
            raise UserError("--resume continues a run with its own spec, data and model; "
                            "drop --config, --dataset, --model and --preset")
        return _resume_local(args)
    if args.config is None:
        raise UserError("train run --local needs --config FILE (or --resume RUN_DIR to continue a run)")
    config_path = args.config.expanduser().resolve()
    spec = load_spec(config_path)
    if args.dataset is None and not spec.input.hf:
        _no_mistyped_cid(spec.input.dataset, config_path, given=False)
    if args.dataset is None and spec.input.hf:
        dataset = _hf_dataset(spec, _home(args))
    else:
        dataset = (args.dataset or config_path.parent / spec.input.dataset).expanduser().resolve()
    input_file(dataset, "dataset", f" (set input.dataset in {config_path.name} or give --dataset)")
    records = check_dataset(dataset, 1, spec.input.validation_split, spec.seed, spec.input.format).records  # before anything is written
    model = _local_model(args.model, spec.base_model, config_path.parent)
    from agent.train.model import model_refusal

    problem = model_refusal(spec.method, spec.lora.target_modules, model)
    if problem is not None:
        raise UserError(f"{config_path.name}: {problem}")
    run_dir = (args.output or Path("runs") / f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}").expanduser().resolve()
    if run_dir.exists() and any(run_dir.iterdir()):
        raise UserError(f"{run_dir}: exists and is not empty; choose a new --output")
    split = split_dataset(len(records), 1, spec.input.validation_split, spec.seed)
    created = not run_dir.exists()
    try:
        return _train_local(args, spec, config_path, model, run_dir, records, split)
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt) and _has_checkpoint(run_dir):
            print(f"infernet: interrupted; checkpoints kept: continue with "
                  f"`infernet train run --local --resume {run_dir}`", file=sys.stderr)
            raise
        if created:  # nothing half-written stays behind to block a rerun with the same --output
            shutil.rmtree(run_dir, ignore_errors=True)
        if isinstance(exc, ValueError) and "assistant tokens" in str(exc):  # assistant turns cut by max_seq_len
            raise UserError(f"{dataset}: {exc} within training.max_seq_len {spec.training.max_seq_len} "
                            f"of {config_path.name}") from None
        raise


def _train_local(args: argparse.Namespace, spec: Any, config_path: Path, model: Path, run_dir: Path,
                 records: list, split: Any) -> int:
    from agent.train import TrainConfig, TrainRequest, train_shard
    from agent.train.data import write_chatml

    data_dir = run_dir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    train_path = data_dir / "train.jsonl"
    write_chatml(train_path, [records[i] for i in split.shards[0]])
    validation = None
    if split.validation:
        validation = data_dir / "validation.jsonl"
        write_chatml(validation, [records[i] for i in split.validation])
    threads = args.threads or max(1, min(os.cpu_count() or 1, 8))
    config = TrainConfig.from_spec(spec, threads=threads).with_(base_model=str(model))
    if args.preset:
        from agent.hardware import cuda_devices
        from agent.train.presets import apply_preset

        gpus = cuda_devices()
        config = apply_preset(config, args.preset, model_dir=model,
                              free_vram_gb=max(d.vram_free_gb for d in gpus) if gpus else None)
    if not args.json:
        preset = (f", preset {args.preset} (micro-batch {config.micro_batch} x "
                  f"{config.samples_per_step // config.micro_batch})") if args.preset else ""
        print(f"training {spec.name}: {len(split.shards[0])} records, base model {model}, {threads} threads{preset} -> {run_dir}")
    request = TrainRequest(config, train_path, run_dir, validation=validation, spec_text=config_path.read_text())
    return _run_and_report(args, request, resume=False)


def _has_checkpoint(run_dir: Path) -> bool:
    """A checkpoint after step 0 exists: an interrupted run worth keeping for --resume."""
    return any(p.name != "step-000000" for p in (run_dir / "checkpoints").glob("step-*"))


def _resume_local(args: argparse.Namespace) -> int:
    from agent.train import TrainConfig, TrainRequest

    run_dir = args.resume.expanduser().resolve()
    for needed in ("train_config.json", "proof.json", "data/train.jsonl"):
        if not (run_dir / needed).is_file():
            raise UserError(f"--resume {run_dir}: no {needed}; give the run directory of an interrupted "
                            f"`train run --local`")
    if (run_dir / "result.json").exists():
        raise UserError(f"--resume {run_dir}: this run already finished (result.json); nothing to resume")
    config = TrainConfig.from_json(json.loads((run_dir / "train_config.json").read_text()))
    if args.threads and args.threads != config.threads:
        raise UserError(f"--threads {args.threads}: the run used {config.threads} threads, and a resumed run must "
                        f"match it (the proof records it); drop --threads")
    validation = run_dir / "data" / "validation.jsonl"
    spec = run_dir / "infernet.train.yml"
    request = TrainRequest(config, run_dir / "data" / "train.jsonl", run_dir,
                           validation=validation if validation.is_file() else None,
                           spec_text=spec.read_text() if spec.is_file() else None)
    if not args.json:
        print(f"resuming {run_dir}")
    return _run_and_report(args, request, resume=True)


def _run_and_report(args: argparse.Namespace, request: Any, *, resume: bool) -> int:
    from agent.pipeline.progress import TrainProgress
    from agent.train import train_shard

    run_dir = request.run_dir
    # TensorBoard: metrics.jsonl's lines as they are written, into RUN_DIR/tensorboard (a resumed run adds to it)
    scalars = _open_tensorboard(run_dir / "tensorboard", fresh=not resume) if not args.no_tensorboard else None
    tail = MetricsTail(run_dir / "metrics.jsonl", scalars)

    def on_step(*values: Any) -> None:
        progress.update(*values)
        tail.read()

    try:
        with TrainProgress(enabled=not args.no_progress) as progress:
            result = train_shard(request, resume=resume, on_step=on_step)
        tail.read()
    finally:
        if scalars is not None:
            scalars.close()
            if scalars.broken:
                print(f"note: {scalars.broken}", file=sys.stderr)
    out = result.to_json()
    validation_text = (f"; validation loss {result.initial_validation_loss:.4f} -> {result.validation_loss:.4f}"
                       if result.validation_loss is not None else "")
    _emit(args, out, f"done: {result.steps} steps in {result.train_seconds:.1f} s, final loss {result.final_loss:.4f}"
                     f"{validation_text}\n  {'weights' if request.config.method == 'full' else 'adapter'}: {result.adapter_dir}\n"
                     f"  run:     {run_dir} (README.md, metrics.jsonl, proof.json)"
                     + (f"\n  curves:  tensorboard --logdir {scalars.logdir}" if scalars is not None else ""))
    return 0


class MetricsTail:
    """The lines a run appends to its metrics.jsonl, read as they come, written to a TensorBoard log."""

    def __init__(self, path: Path, scalars: Any) -> None:
        self.path, self.scalars, self.position, self.partial = path, scalars, 0, ""

    def read(self) -> None:
        if self.scalars is None or not self.path.exists():
            return
        from agent.tblog import local_scalars

        with open(self.path, encoding="utf-8") as handle:
            handle.seek(self.position)
            text = self.partial + handle.read()
            self.position = handle.tell()
        *lines, self.partial = text.split("\n")
        for line in lines:
            if line.strip():
                self.scalars.add_all(local_scalars(json.loads(line)))


def _local_model(explicit: Path | None, base_model: str, spec_dir: Path) -> Path:
    if explicit is not None:
        path = explicit.expanduser().resolve()
    elif base_model == TINY_MODEL_NAME:
        from agent.train.tiny import tiny_model

        return tiny_model()
    else:
        path = (spec_dir / base_model).expanduser().resolve()
    if not path.is_dir():
        raise UserError(f"base model {base_model!r}: {path} is not a local model directory "
                        f"(give --model DIR; `{TINY_MODEL_NAME}` names the built-in tiny model)")
    return path


def _regular_file(path: Path) -> Path:
    """``path`` if it is a regular file (following links); a device such as /dev/zero or a FIFO would
    be read forever, so it is a user error, checked before anything opens it (agent/files.py)."""
    return input_file(path, "file")


def _no_mistyped_cid(dataset: str, spec_path: Path, *, given: bool) -> None:
    """``input.dataset`` that looks like a CID but is none: say so, rather than 'no such file'."""
    from protocol.cid import parse_cid
    from protocol.errors import CIDError

    text = dataset.strip()
    if given or "/" in text or "." in text or not re.match(r"^(baf[a-z2-7]|Qm[1-9A-HJ-NP-Za-km-z])", text):
        return
    try:
        parse_cid(text)
    except CIDError as error:
        raise UserError(f"{spec_path.name}: input.dataset {text[:80]!r} looks like a CID but is not one: {error} "
                        "(write ./NAME for a file of that name)") from None


def cmd_train_data(args: argparse.Namespace) -> int:
    from agent.data.crawl import FetchPolicy, PoliteFetcher, build_dataset, check_writable, gather_documents, render_summary
    from agent.data.search import make_provider

    if args.query is None and args.urls is None and not args.sitemap and args.dir is None:
        raise UserError("no source: give --query, --urls, --sitemap or --dir")
    for name, low in (("min_chars", 1), ("max_chars", 1), ("max_bytes", 1), ("retries", 0), ("num", 1)):
        value = getattr(args, name)
        if value is not None and value < low:
            raise UserError(f"--{name.replace('_', '-')} must be at least {low}, got {value}")
    if args.max_chars < args.min_chars:
        raise UserError(f"--max-chars {args.max_chars} is below --min-chars {args.min_chars}")
    if not args.timeout > 0 or not args.delay >= 0:
        raise UserError("--timeout must be above 0 and --delay at least 0")
    if args.query is not None and not args.query.strip():
        raise UserError("--query is empty")
    out = args.out.expanduser().absolute()
    check_writable(out)  # before any request
    domains = [d.strip().lower() for d in args.domains.split(",") if d.strip()]
    provider = make_provider(args.provider, _home(args), args.search_endpoint, timeout=args.timeout) \
        if args.query is not None else None  # no key: fails here, before anything is fetched
    fetcher = PoliteFetcher(FetchPolicy(timeout=args.timeout, max_bytes=args.max_bytes, retries=args.retries,
                                        delay=args.delay))
    documents = gather_documents(fetcher, query=args.query, domains=domains, num=args.num, provider=provider,
                                 urls_file=args.urls.expanduser() if args.urls else None, sitemaps=args.sitemap,
                                 directory=args.dir.expanduser() if args.dir else None)
    show = sys.stderr.isatty() and not args.json
    if show:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(TextColumn("fetching"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                       TextColumn("{task.description}"), console=Console(stderr=True), transient=True)
        with bar:
            task = bar.add_task("", total=len(documents))
            report = build_dataset(documents, out, fetcher=fetcher, min_chars=args.min_chars, max_chars=args.max_chars,
                                   progress=lambda url: bar.update(task, advance=1, description=url[-60:]))
    else:
        report = build_dataset(documents, out, fetcher=fetcher, min_chars=args.min_chars, max_chars=args.max_chars)
    _emit(args, report.to_json(), render_summary(report))
    return 0


def cmd_data_check(args: argparse.Namespace) -> int:
    from agent.data.check import check_file, load_chat_tokenizer, render_text

    path = _regular_file(args.file.expanduser())
    if args.max_seq_len is not None and (args.model is None or args.max_seq_len < 1):
        raise UserError("--max-seq-len needs --model and a value of at least 1")
    tokenizer = None
    if args.model is not None:
        if args.model == TINY_MODEL_NAME:
            from agent.train.tiny import tiny_model

            model = tiny_model()
        else:
            model = Path(args.model).expanduser().resolve()
        tokenizer = load_chat_tokenizer(model)
    report = check_file(path, tokenizer=tokenizer, max_seq_len=args.max_seq_len, format=args.format)
    _emit(args, report.to_json(), render_text(report))
    return 0 if report.ok else 1


def cmd_data_add(args: argparse.Namespace) -> int:
    from protocol.unixfs import compute_cid

    path = _regular_file(args.file.expanduser())
    with open(path, "rb") as fh:
        cid = compute_cid(fh)
    _emit(args, {"file": str(path), "cid": cid.encode(), "size": path.stat().st_size}, cid.encode())
    return 0


def cmd_data_verify(args: argparse.Namespace) -> int:
    from protocol.cid import parse_cid
    from protocol.unixfs import compute_cid

    expected = parse_cid(args.cid)
    path = _regular_file(args.file.expanduser())
    with open(path, "rb") as fh:
        actual = compute_cid(fh, cid_version=expected.version)
    ok = actual.to_bytes() == expected.to_bytes()
    result = {"file": str(path), "cid": args.cid, "actual": actual.encode(), "match": ok}
    if getattr(args, "json", False):
        print(json.dumps(result, indent=2))
    elif ok:
        print(f"ok: {path} has CID {args.cid}")
    else:
        print(f"infernet: {path} does not match {args.cid} (its CID is {actual.encode()})", file=sys.stderr)
    return 0 if ok else 1


# -- infer and publish (agent/pipeline) ------------------------------------------------------------------

def cmd_infer(args: argparse.Namespace) -> int:
    from agent.pipeline.infer import GenerationOptions, default_dataset, generate, load_model, sample_prompts
    from agent.pipeline.source import resolve_source

    options = GenerationOptions(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                                repetition_penalty=args.repetition_penalty, seed=args.seed)
    options.check()
    if args.samples is not None and args.samples < 1:
        raise UserError(f"--samples must be at least 1, got {args.samples}")
    if args.samples is not None and args.prompt is not None:
        raise UserError("give either --prompt or --samples, not both")
    source = resolve_source(args.source, base=args.base, home=_home(args) if args.home else None)
    prompts: list[dict] = []
    if args.samples is not None:
        dataset = args.dataset or default_dataset(source)
        if dataset is None:
            raise UserError(f"--samples: {args.source} has no dataset of its own; give --dataset FILE")
        prompts = sample_prompts(dataset.expanduser(), args.samples, args.seed)
    else:
        prompt = args.prompt
        if prompt is None and not sys.stdin.isatty():
            prompt = sys.stdin.read().strip()
            if not prompt:
                raise UserError("no prompt: stdin was empty (give --prompt TEXT, --samples N, or run on a terminal to chat)")
        if prompt is not None:
            prompts = [{"messages": [{"role": "user", "content": prompt}], "expected": None}]
    if args.system:
        for item in prompts:
            if not item["messages"] or item["messages"][0]["role"] != "system":
                item["messages"].insert(0, {"role": "system", "content": args.system})
    _quiet_transformers()
    model, tokenizer = load_model(source, device=args.device)
    if not prompts:
        return _chat(model, tokenizer, options, args.system)
    results = []
    for item in prompts:
        stream = None
        if not args.json:
            print(f"> {item['messages'][-1]['content']}")
            stream = lambda piece: print(piece, end="", flush=True)  # noqa: E731
        answer = generate(model, tokenizer, item["messages"], options, on_text=stream)
        results.append({"messages": item["messages"], "output": answer, "expected": item["expected"]})
        if not args.json:
            print()
            if item["expected"] is not None:
                print(f"  expected: {item['expected']}")
    if args.json:
        print(json.dumps({"adapter": str(source.adapter_dir), "base_model": str(source.base_dir),
                          "options": options.__dict__, "results": results}, indent=2))
    return 0


def _chat(model: Any, tokenizer: Any, options: Any, system: str | None) -> int:
    from agent.pipeline.infer import generate

    print("chat with the model: an empty line or /exit ends, /reset forgets the conversation")
    history = [{"role": "system", "content": system}] if system else []
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            print()
            return 0
        if not line or line == "/exit":
            return 0
        if line == "/reset":
            history = history[:1] if system else []
            continue
        history.append({"role": "user", "content": line})
        print("model> ", end="", flush=True)
        answer = generate(model, tokenizer, history, options, on_text=lambda piece: print(piece, end="", flush=True))
        print()
        history.append({"role": "assistant", "content": answer})


def cmd_publish(args: argparse.Namespace) -> int:
    import tempfile

    from agent.pipeline import publish as pub
    from agent.pipeline.source import resolve_source

    if args.ollama and not args.gguf:
        raise UserError("--ollama needs --gguf FILE (Ollama runs the GGUF file)")
    if not (args.merged or args.gguf or args.hf):
        raise UserError("publish needs at least one of --merged DIR, --gguf FILE, --hf REPO")
    if args.dry_run and not args.hf:
        raise UserError("--dry-run goes with --hf (it lists what would be uploaded)")
    # every output place and tool is checked before the slow work starts
    if args.merged:
        pub.check_target(args.merged, "--merged")
    if args.gguf:
        pub.check_target(args.gguf, "--gguf")
        if args.quant.lower() not in pub.DIRECT_TYPES and args.quant.lower() not in pub.QUANT_TYPES:
            raise UserError(f"--quant {args.quant}: unknown (known: {', '.join(pub.DIRECT_TYPES + tuple(pub.QUANT_TYPES))})")
        llama_dir = pub.find_llama_cpp(args.llama_cpp_path)
        if args.quant.lower() in pub.QUANT_TYPES:
            pub.quantizer(llama_dir)
    if args.hf and not args.dry_run and not pub.hf_token():
        raise UserError(f"--hf {args.hf}: no token: set HF_TOKEN (or HUGGINGFACE_TOKEN) to a write token")
    source = resolve_source(args.source, base=args.base, home=_home(args) if args.home else None)
    _quiet_transformers()
    result: dict[str, Any] = {"source": str(source.adapter_dir), "base_model": str(source.base_dir)}
    lines = []
    scratch = None
    try:
        merged = args.merged
        if merged is None:
            scratch = Path(tempfile.mkdtemp(prefix="infernet-publish-"))
            merged = scratch / (args.hf.split("/")[-1] if args.hf else "merged")
        result["merged"] = pub.write_merged(source, merged)
        if args.merged:
            lines.append(f"merged model: {result['merged']['path']} ({', '.join(result['merged']['files'])})")
        if args.gguf:
            result["gguf"] = pub.write_gguf(Path(result["merged"]["path"]), args.gguf, args.quant, args.llama_cpp_path)
            lines.append(f"GGUF ({result['gguf']['quant']}): {result['gguf']['path']} ({result['gguf']['bytes']} bytes)")
        if args.ollama:
            result["ollama"] = pub.write_modelfile(Path(result["gguf"]["path"]), args.ollama)
            o = result["ollama"]
            lines.append(f"Modelfile: {o['modelfile']}")
            lines.append(f"ollama model {o['name']} created; run: ollama run {o['name']}" if o["created"] else
                         f"ollama is not installed here; to create the model run:\n  {o['command']}")
        if args.hf:
            folder = Path(result["merged"]["path"])
            if args.dry_run:
                plan = pub.hf_plan(folder, args.hf, args.private)
                result["hf"] = plan
                lines.append(f"would upload to https://huggingface.co/{args.hf}"
                             f"{' (private)' if args.private else ''}: {len(plan['files'])} files from {folder}")
                lines += [f"  {f['path']}  {f['bytes']} bytes" for f in plan["files"]]
                if plan["token"] is None:
                    lines.append("  (no HF_TOKEN set: the upload itself would fail)")
            else:
                result["hf"] = pub.upload_hf(folder, args.hf, args.private)
                lines.append(f"uploaded to https://huggingface.co/{args.hf}: {result['hf']['url']}")
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    if scratch is not None:
        result.pop("merged")
    _emit(args, result, "\n".join(lines))
    return 0


# -- demo ------------------------------------------------------------------------------------------------

def cmd_demo(args: argparse.Namespace) -> int:
    from agent.demo import DemoOptions, run_demo

    for name in ("workers", "shards", "rounds", "steps"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name} must be at least 1")
    if args.workers < 2:
        raise UserError("--workers must be at least 2: one coordinates, the others train")
    if args.method == "full" and args.type == "dpo":
        raise UserError("--method full with --type dpo: DPO's reference is the base model with the adapter disabled, "
                        "so it needs a LoRA")
    return run_demo(DemoOptions(workers=args.workers, shards=args.shards, rounds=args.rounds, steps=args.steps,
                                first_round_steps=args.first_rounds,
                                directory=args.dir, timeout=args.timeout, dataset=args.dataset, type=args.type,
                                method=args.method,
                                verbose=bool(getattr(args, "verbose", False))))


# -- harness ---------------------------------------------------------------------------------------------

def cmd_harness_list(args: argparse.Namespace) -> int:
    from agent.harness.scenario import load_scenario, shipped

    rows = []
    for path in shipped():
        scenario = load_scenario(path)
        rows.append({"name": scenario.name, "path": str(path), "slow": scenario.slow,
                     "description": scenario.description.strip().splitlines()[0] if scenario.description else ""})
    _emit(args, rows, "\n".join(f"{r['name']:22} {'(slow) ' if r['slow'] else ''}{r['description']}" for r in rows))
    return 0


def cmd_harness_check(args: argparse.Namespace) -> int:
    from agent.harness.scenario import find_scenario, load_scenario

    scenarios = [load_scenario(find_scenario(name)) for name in args.scenarios]
    _emit(args, [{"name": s.name, "source": s.source, "faults": len(s.faults)} for s in scenarios],
          "\n".join(f"{s.source}: ok ({s.name}, {s.workers} workers, {len(s.faults)} faults)" for s in scenarios))
    return 0


def cmd_harness_run(args: argparse.Namespace) -> int:
    import tempfile

    import trio

    from agent.harness.scenario import find_scenario, load_scenario, run_scenario

    scenarios = [load_scenario(find_scenario(name)) for name in args.scenarios]  # all checked before any runs
    if args.out is None:
        out = Path(tempfile.mkdtemp(prefix="infernet-harness-"))
    else:
        out = args.out
        if out.exists() and any(out.iterdir()):
            raise UserError(f"--out {out}: directory exists and is not empty (agent homes would be reused)")
    from agent.daemon import setup_logging

    out.mkdir(parents=True, exist_ok=True)
    log_file = open(out / "agents.log", "a", encoding="utf-8")  # the agents' logs (JSON lines), not the terminal
    setup_logging(log_file, verbose=bool(getattr(args, "verbose", False)))
    _quiet_transformers()
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    results = []
    for scenario in scenarios:
        directory = out / scenario.name if len(scenarios) > 1 else out
        result = trio.run(lambda: run_scenario(scenario, directory, seed=args.seed, heartbeats=args.heartbeats))
        results.append(result)
        if not getattr(args, "json", False):
            print(result.summary, flush=True)
            print(flush=True)
    if getattr(args, "json", False):
        print(json.dumps([{"scenario": r.scenario.name, "seed": r.seed, "ok": r.ok, "seconds": round(r.seconds, 1),
                           "phase": r.phase, "reason": r.reason, "job": r.job_id, "trace": str(r.trace_path),
                           "faults": [{"t": t, "what": w} for t, w in r.fired],
                           "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in r.checks]}
                          for r in results], indent=2))
    elif len(results) > 1:
        print(f"{sum(r.ok for r in results)} of {len(results)} scenarios passed")
    return 0 if all(r.ok for r in results) else 1


def cmd_harness_soak(args: argparse.Namespace) -> int:
    from agent.harness.soak import Soak, SoakOptions

    if not 0 < args.minutes <= 24 * 60:
        raise UserError(f"--minutes: must be between 0 and 1440, got {args.minutes:g}")
    if not 3 <= args.agents <= 16:
        raise UserError(f"--agents: must be between 3 and 16, got {args.agents}")
    if not 1 <= args.fault_every <= 3600:
        raise UserError(f"--fault-every: must be between 1 and 3600 seconds, got {args.fault_every:g}")
    if args.out is not None and args.out.exists() and any(args.out.iterdir()):
        raise UserError(f"--out {args.out}: directory exists and is not empty")
    quiet = bool(getattr(args, "json", False))
    soak = Soak(SoakOptions(minutes=args.minutes, agents=args.agents, seed=args.seed, directory=args.out,
                            fault_every=args.fault_every),
                say=(lambda line: None) if quiet else (lambda line: print(line, flush=True)))
    report = soak.run()
    for line in report.bench_lines():
        print(json.dumps(line), flush=True)
    if quiet:
        print(json.dumps({"violations": report.violations, "faults": report.faults, "skipped": report.skipped,
                          "jobs": report.jobs, "dir": str(soak.root)}))
    else:
        print(report.summary())
        print(f"homes and logs: {soak.root}")
    return 0 if not report.violations else 1


def _quiet_transformers() -> None:
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


COMMANDS = {
    ("demo", None): cmd_demo,
    ("agent", "init"): cmd_agent_init, ("agent", "run"): cmd_agent_run, ("agent", "status"): cmd_agent_status,
    ("agent", "stop"): cmd_agent_stop, ("peers", None): cmd_peers,
    ("providers", None): cmd_providers, ("models", None): cmd_models,
    ("job", "estimate"): cmd_job_estimate, ("job", "bill"): cmd_job_bill,
    ("job", "announce"): cmd_job_announce, ("job", "list"): cmd_job_list, ("job", "show"): cmd_job_show,
    ("job", "watch"): cmd_job_watch,
    ("job", "fetch"): cmd_job_fetch, ("job", "cancel"): cmd_job_cancel, ("job", "ledger"): cmd_job_ledger,
    ("ui", None): cmd_ui, ("train", "init"): cmd_train_init, ("train", "run"): cmd_train_run, ("train", "data"): cmd_train_data,
    ("infer", None): cmd_infer, ("publish", None): cmd_publish,
    ("data", "add"): cmd_data_add, ("data", "check"): cmd_data_check, ("data", "verify"): cmd_data_verify,
    ("data", "get"): cmd_data_get, ("ledger", "verify"): cmd_ledger_verify,
    ("harness", "run"): cmd_harness_run, ("harness", "list"): cmd_harness_list, ("harness", "check"): cmd_harness_check,
    ("harness", "soak"): cmd_harness_soak,
}


if __name__ == "__main__":
    sys.exit(main())
