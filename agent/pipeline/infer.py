"""``infernet infer``: talk to a base model with a trained adapter, or try it on prompts from a dataset.

Rules of this file:
- The model is the base (agent/pipeline/source.py says which) with the adapter loaded through
  peft, in eval mode, on the CPU unless ``device`` says otherwise. Before peft loads it, every
  adapter tensor is checked against the base module it adapts (name and shape): a wrong base is a
  one-line PipelineError, never a half-loaded model or a torch traceback.
- Prompts go through the model's own chat template (``tokenizer.chat_template``); a tokenizer that
  has none gets ChatML, and generation stops at the template's end-of-turn token. The answer
  streams to ``on_text`` piece by piece as tokens decode (transformers' TextStreamer).
- Sampling: ``temperature`` 0 is greedy; otherwise top-p sampling from a generator seeded with
  ``seed``, so the same inputs give the same text on the same machine.
- ``sample_prompts`` draws prompts from a ChatML dataset: each record's turns up to its last
  assistant turn are the prompt, that turn is the expected answer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from agent.pipeline.source import PipelineError, Source

CHATML_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class GenerationOptions:
    temperature: float = 0.7
    top_p: float = 0.9
    max_new_tokens: int = 128
    repetition_penalty: float = 1.0
    seed: int = 0

    def check(self) -> None:
        if self.temperature < 0:
            raise PipelineError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise PipelineError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise PipelineError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.repetition_penalty <= 0:
            raise PipelineError(f"--repetition-penalty must be > 0, got {self.repetition_penalty}")


def adapter_mismatches(model: Any, tensors: dict[str, Any]) -> list[str]:
    """Adapter tensors that fit no module of ``model`` (missing module, or the wrong shape)."""
    problems = []
    for name, tensor in tensors.items():
        for kind in ("lora_A", "lora_B"):
            marker = f".{kind}."
            if marker not in name:
                continue
            module_name = name.split(marker)[0].removeprefix("base_model.model.")
            try:
                module = model.get_submodule(module_name)
            except AttributeError:
                problems.append(f"{name}: the base model has no module {module_name}")
                break
            fan_in, fan_out = getattr(module, "in_features", None), getattr(module, "out_features", None)
            want = fan_in if kind == "lora_A" else fan_out
            have = tensor.shape[1] if kind == "lora_A" else tensor.shape[0]
            if want is not None and have != want:
                problems.append(f"{name}: shape {tuple(tensor.shape)} does not fit {module_name} "
                                f"({fan_in} -> {fan_out})")
            break
    return problems


def load_model(source: Source, *, device: str = "cpu", merge: bool = False) -> tuple[Any, Any]:
    """(model, tokenizer): the base with the adapter, checked to fit it; merged into plain weights if ``merge``.
    ``device`` "auto" is a CUDA GPU when there is one (bf16 where supported), else the CPU (float32)."""
    import logging
    import warnings

    import torch

    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # peft imports it; its CPU-kernel notice is noise here
    warnings.filterwarnings("ignore", category=FutureWarning)
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    from agent.train.model import pick_device, pick_dtype

    try:
        device = pick_device(device)
    except RuntimeError as exc:
        raise PipelineError(f"--device {device}: {exc}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source.base_dir))
        base = AutoModelForCausalLM.from_pretrained(str(source.base_dir), dtype=pick_dtype("auto", device))
    except (OSError, ValueError) as exc:
        raise PipelineError(f"base model {source.base_dir}: cannot load ({str(exc).splitlines()[0][:160]})") from None
    from agent.train.model import FULL_MARKER_FILE, load_full_weights, saved_full

    if (source.adapter_dir / FULL_MARKER_FILE).is_file() or saved_full(source.adapter_dir):
        # a full fine-tuning's weights (method: full): the base model's architecture, every weight replaced
        weights = "model.safetensors" if (source.adapter_dir / FULL_MARKER_FILE).is_file() else "adapter_model.safetensors"
        try:
            load_full_weights(base, load_file(str(source.adapter_dir / weights)))
        except ValueError as exc:
            raise PipelineError(f"{source.adapter_dir}: the fine-tuned weights do not fit base model "
                                f"{source.base_dir} ({exc})") from None
        model = base
    else:
        tensors = load_file(str(source.adapter_dir / "adapter_model.safetensors"))
        problems = adapter_mismatches(base, tensors)
        if problems:
            raise PipelineError(f"adapter {source.adapter_dir} does not fit base model {source.base_dir} "
                                f"(adapter/base mismatch: {problems[0]}{f'; {len(problems) - 1} more' if len(problems) > 1 else ''})")
        model = PeftModel.from_pretrained(base, str(source.adapter_dir))
        if merge:
            model = model.merge_and_unload()
    model.to(device)
    model.eval()
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHATML_TEMPLATE
    return model, tokenizer


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for token in ("<|im_end|>", "<|eot_id|>", "<|end|>"):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id and token_id >= 0:
            ids.add(token_id)
    return sorted(ids)


def generate(model: Any, tokenizer: Any, messages: list[dict[str, str]], options: GenerationOptions,
             on_text: Callable[[str], None] | None = None) -> str:
    """The assistant's answer to ``messages``, streamed piece by piece to ``on_text``."""
    import torch
    from transformers import TextStreamer

    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False).to(model.device)
    pieces: list[str] = []

    class _Stream(TextStreamer):
        def on_finalized_text(self, piece: str, stream_end: bool = False) -> None:
            if piece:
                pieces.append(piece)
                if on_text is not None:
                    on_text(piece)

    stops = end_of_turn_ids(tokenizer)
    kwargs: dict[str, Any] = dict(max_new_tokens=options.max_new_tokens, repetition_penalty=options.repetition_penalty,
                                  eos_token_id=stops, pad_token_id=tokenizer.pad_token_id or stops[0],
                                  streamer=_Stream(tokenizer, skip_prompt=True, skip_special_tokens=True))
    if options.temperature > 0:
        kwargs.update(do_sample=True, temperature=options.temperature, top_p=options.top_p, top_k=0)
    else:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    torch.manual_seed(options.seed)
    with torch.no_grad():
        model.generate(**inputs, **kwargs)
    return "".join(pieces).strip()


def sample_prompts(dataset: Path, n: int, seed: int) -> list[dict]:
    """``n`` records of a ChatML file drawn with ``seed``: {"messages": prompt turns, "expected": answer}."""
    from agent.train.data import read_chatml

    chatml = read_chatml(dataset, skip_bad=True)
    records = [r for r in chatml.records if any(m["role"] == "assistant" for m in r.messages)]
    if not records:
        why = f" ({chatml.skipped} lines refused; the first: {chatml.problems[0]})" if chatml.problems else ""
        raise PipelineError(f"{dataset}: no record with an assistant turn to draw prompts from{why}")
    chosen = random.Random(seed).sample(records, min(n, len(records)))
    out = []
    for record in chosen:
        messages = list(record.messages)
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        out.append({"messages": [dict(m) for m in messages[:last]], "expected": messages[last]["content"]})
    return out


def default_dataset(source: Source) -> Path | None:
    """The run's held-out validation split, else its training data; None for adapters and jobs."""
    if source.run_dir is None:
        return None
    for name in ("validation.jsonl", "train.jsonl"):
        if (source.run_dir / "data" / name).is_file():
            return source.run_dir / "data" / name
    return None
