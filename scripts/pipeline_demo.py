"""From a topic to an Ollama model, end to end on this machine (`make pipeline` runs it):

  1. a small website about one topic (scripts/demo_site.py) served on 127.0.0.1;
  2. `infernet train data --sitemap URL` makes a ChatML dataset of it, `infernet data check` checks it;
  3. `infernet demo --dataset FILE`: a job on a real loopback network (1 submitter + N worker agents,
     each its own process) trains the tiny demo model on that dataset; the submitter fetches the final
     aggregate by its CID (as `infernet job fetch --out` does) before the agents are stopped;
  4. `infernet publish ADAPTER --merged DIR --gguf FILE --quant q4_k_m --ollama NAME`: the merged
     model, a GGUF made by llama.cpp's converter and quantizer, and a Modelfile (the `ollama create`
     command is printed when ollama is not installed);
  5. text generated from the GGUF by llama.cpp (llama-cpp-python), and by `infernet infer` from the
     same adapter.

Every step is the real CLI as a subprocess (except step 5's llama.cpp call, in this process); each is
printed with its time. Files go to a new temporary directory (or `--dir`, which must be new or empty)
and are kept. On any exit (an error, Ctrl-C, SIGTERM) the running step is stopped: SIGTERM (the demo
then stops its agents), SIGKILL after a grace period; if this script is killed, the kernel sends its
child SIGTERM. Exit 0 when every step succeeded; otherwise one line on stderr and exit 1.

    python scripts/pipeline_demo.py [--dir DIR] [--workers 3] [--rounds 3] [--steps 8]
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from agent.config import CONTROL_SOCKET  # noqa: E402 - after the path fix above
from agent.control import MAX_SOCKET_PATH  # noqa: E402
from agent.demo import die_with  # noqa: E402
from scripts.demo_site import DemoSite  # noqa: E402

PROMPT = 'What does "The Danube" say about Capitals?'  # a question of the dataset (its answer: the passage)
STOP_GRACE_SECONDS = 30.0


class PipelineDemoError(Exception):
    """A step failed; ``str()`` is the one line to show."""


def cli_env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=str(REPO) + (os.pathsep + path if path else ""), COLUMNS="200",
                PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")


def infernet(*args: str, timeout: float, log: Path, show: bool = True) -> str:
    """Run ``infernet ARGS`` (this tree's CLI) to its end; its output (stdout + stderr) is returned,
    written to ``log`` and, with ``show``, printed indented. Stopped on any exception here."""
    command = [sys.executable, "-m", "agent.cli", *args]
    print(f"  $ infernet {shlex.join(args)}", flush=True)
    with open(log, "wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO, env=cli_env(),
                                   start_new_session=True,  # our Ctrl-C is ours to relay, in order
                                   preexec_fn=die_with(os.getpid()))  # ... and our death its own
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise PipelineDemoError(f"infernet {args[0]} did not finish within {timeout:.0f} s (see {log})") from None
        finally:
            stop(process)
    output = log.read_text(errors="replace")
    if show:
        for line in output.rstrip().splitlines():
            print(f"    {line}")
    if code != 0:
        last = [line for line in output.splitlines() if line.strip()]
        raise PipelineDemoError(f"infernet {args[0]} exited with status {code}: "
                                f"{last[-1] if last else 'no output'} (see {log})")
    return output


def stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=STOP_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def check_llama_cpp() -> None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise PipelineDemoError("llama-cpp-python is not installed: run `make pipeline` "
                                "(it compiles llama-cpp-python and installs llama.cpp's converter)") from None
    from agent.pipeline.source import PipelineError
    from agent.pipeline.publish import find_llama_cpp

    try:
        find_llama_cpp()
    except PipelineError as error:
        raise PipelineDemoError(str(error)) from None
    from agent.pipeline.publish import llama_cpp_runs

    why = llama_cpp_runs()  # generation runs llama.cpp in this process: a build this CPU cannot run says so first
    if why:
        raise PipelineDemoError(why)


def generate_from_gguf(gguf: Path, prompt: str, max_tokens: int) -> tuple[str, int]:
    """Greedy text from the GGUF by llama.cpp, with the ChatML turn the model was trained on."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=512, n_threads=max(1, min(os.cpu_count() or 1, 4)), seed=0,
                verbose=False)
    text = f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
    out = llm.create_completion(text, max_tokens=max_tokens, temperature=0.0, stop=["<|im_end|>"])
    return out["choices"][0]["text"], out["usage"]["completion_tokens"]


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    root = (args.dir or Path(tempfile.mkdtemp(prefix="infernet-pipeline-"))).absolute()  # the CLI runs in the repo
    network = root / "net"
    longest = network / "submitter" / CONTROL_SOCKET
    if len(str(longest)) > MAX_SOCKET_PATH:
        raise PipelineDemoError(f"{root}: too deep for the agents' control sockets ({longest} is over "
                                f"{MAX_SOCKET_PATH} characters); give a shorter --dir")
    root.mkdir(parents=True, exist_ok=True)
    if any(root.iterdir()):
        raise PipelineDemoError(f"{root}: not empty; give --dir a new directory")
    check_llama_cpp()
    logs = root / "logs"
    logs.mkdir()
    timings: list[tuple[str, float]] = []

    def step(number: int, title: str) -> float:
        print(f"\n[{number}/5] {title}", flush=True)
        return time.monotonic()

    def done(title: str, since: float) -> None:
        timings.append((title, time.monotonic() - since))
        print(f"  ({time.monotonic() - since:.1f} s)", flush=True)

    print(f"From a topic to an Ollama model, on this machine (files in {root})")
    dataset = root / "rivers.jsonl"
    with DemoSite() as site:
        t = step(1, f"a website about the rivers of Europe on loopback: {site.base}")
        print(f"  {len(site.pages)} pages, {site.url('/sitemap.xml')}, robots.txt forbids /drafts/")
        done("site", t)

        t = step(2, "a dataset from its sitemap, checked")
        infernet("train", "data", "--sitemap", site.url("/sitemap.xml"), "--out", str(dataset), "--delay", "0",
                 timeout=120, log=logs / "train-data.log")
        if "/drafts/oder.html" in site.requests:
            raise PipelineDemoError("the crawler fetched /drafts/oder.html, which robots.txt forbids")
        infernet("data", "check", str(dataset), "--model", "infernet-tiny", "--max-seq-len", "256",
                 timeout=120, log=logs / "data-check.log")
        done("dataset", t)

    t = step(3, f"a job on a loopback network: 1 submitter + {args.workers} workers, {args.shards} shards x "
                f"{args.rounds} rounds x {args.steps} steps")
    output = infernet("demo", "--dataset", str(dataset), "--dir", str(network), "--workers", str(args.workers),
                      "--shards", str(args.shards), "--rounds", str(args.rounds), "--steps", str(args.steps),
                      timeout=args.timeout, log=logs / "demo.log", show=False)
    job = re.search(r"announced job (\S+)", output)
    summary = output[output.find("\njob "):].strip().splitlines() if "\njob " in output else []
    for line in summary:
        print(f"    {line}")
    adapter = network / "adapter"
    if not job or not (adapter / "adapter_model.safetensors").is_file():
        raise PipelineDemoError(f"the demo gave no job ID or adapter (see {logs / 'demo.log'})")
    print(f"  job ID {job.group(1)}; its final aggregate fetched by CID into {adapter} (the agents are stopped)")
    done("network job", t)

    out = root / "out"
    gguf = out / f"{args.name}.gguf"
    t = step(4, f"publish: merged model, GGUF ({args.quant}), Ollama Modelfile")
    infernet("publish", str(adapter), "--merged", str(out / args.name), "--gguf", str(gguf), "--quant", args.quant,
             "--ollama", args.name, timeout=600, log=logs / "publish.log")
    done("publish", t)

    t = step(5, f"generate: {PROMPT!r}, greedy")
    text, tokens = generate_from_gguf(gguf, PROMPT, args.max_tokens)
    print(f"  llama.cpp, {gguf.name} ({gguf.stat().st_size} bytes), {tokens} tokens:")
    print(f"    {text.strip()!r}")
    print("  infernet infer, the same adapter on the base model (transformers + peft):")
    infernet("infer", str(adapter), "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", str(args.max_tokens),
             timeout=300, log=logs / "infer.log")
    done("generate", t)

    print(f"\ndone in {time.monotonic() - started:.0f} s: " + ", ".join(f"{name} {s:.1f} s" for name, s in timings))
    print(f"files in {root}; try it: ollama create {args.name} -f {out / 'Modelfile'} && ollama run {args.name}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="From a topic to an Ollama model, end to end on this machine.")
    parser.add_argument("--dir", type=Path, default=None, help="where every file goes (default: a new temp dir)")
    parser.add_argument("--workers", type=int, default=3, help="worker agents (default 3; one coordinates)")
    parser.add_argument("--shards", type=int, default=3, help="dataset shards (default 3)")
    parser.add_argument("--rounds", type=int, default=3, help="train-then-aggregate rounds (default 3)")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per shard and round (default 8)")
    parser.add_argument("--quant", default="q4_k_m", help="GGUF type (default q4_k_m)")
    parser.add_argument("--name", default="rivers", help="the model's name (files, Ollama; default rivers)")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens to generate (default 48)")
    parser.add_argument("--timeout", type=float, default=900.0, help="give up on the network job after this many seconds")
    args = parser.parse_args(argv)

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)  # a SIGTERM stops the running step too, like Ctrl-C
    try:
        return run(args)
    except PipelineDemoError as error:
        print(f"pipeline_demo: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pipeline_demo: interrupted; the running step was stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
