"""Job specs from the training configs people already have: a TRL config or an Axolotl YAML (issue 26).

Rules of this file:
- ``convert(path)`` reads a TRL config (the YAML or JSON that ``trl sft --config`` reads: ModelConfig,
  ScriptArguments and SFTConfig fields side by side; or ``SFTConfig.to_json_string()``'s JSON) or an
  Axolotl YAML, and returns our commented spec (protocol/jobspec.TEMPLATE with the values set in
  place, comments kept, as the presets do) and one line for every field it could not honour.
- Every field is either mapped, or named in a line that says why it is not: a field this converter
  does not know is named too, never dropped in silence. Defaults (the trainer's own) that equal ours
  or mean "unset" are not reported.
- The input is the user's own file: read with a size bound, parsed with ``yaml.safe_load`` (JSON is
  YAML), and a file that is neither format is one clear line (UserError), naming the file.
- A Hugging Face dataset name becomes ``input.hf`` (with its split and config); a local file
  ``input.dataset``. A DPO config (TRL's DPOConfig fields ``beta``/``loss_type``, Axolotl's ``rl: dpo``)
  becomes ``type: dpo`` with ``dpo.beta``.
- What our spec cannot say stays a line: full fine-tuning, other preference losses (IPO, KTO, ORPO,
  ...), schedulers within a run, weight decay, and the settings that are a worker's own (dtype, gradient
  checkpointing, logging, saving).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.errors import UserError

MAX_CONFIG_BYTES = 1 << 20
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""``all-linear`` / ``lora_target_linear``: the projections of Llama-, Qwen- and Mistral-style models (the
submitter's announce checks them against the model's own linear layers)."""


@dataclass
class Conversion:
    source: str  # "trl" or "axolotl"
    values: dict[tuple[str, str], str | None] = field(default_factory=dict)  # (section, key) -> YAML value text
    notes: list[str] = field(default_factory=list)  # one line per field not honoured

    def set(self, section: str, key: str, value: Any) -> None:
        self.values[(section, key)] = _yaml_value(value)

    def unset(self, section: str, key: str) -> None:
        """Comment the template's key out (presets.spec_with_values)."""
        self.values[(section, key)] = None

    def note(self, name: str, why: str) -> None:
        self.notes.append(f"{name}: {why}")


def _yaml_value(value: Any) -> str:
    import json

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(str(v) for v in value) + "]"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)
    if isinstance(value, int):
        return str(value)
    text = str(value)
    plain = text and all(c.isalnum() or c in "._/-:@+" for c in text) and not text[0] in "-:@"
    return text if plain else json.dumps(text)


def read_config(path: Path) -> dict[str, Any]:
    """The mapping a TRL or Axolotl config file holds; UserError (one line) for anything else."""
    import yaml

    from agent.files import FileInputError, read_bounded

    try:
        data = read_bounded(path, MAX_CONFIG_BYTES, "config")
    except FileInputError as error:
        raise UserError(str(error)) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text") from None
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise UserError(f"{path}{where}: not valid YAML or JSON: {getattr(error, 'problem', None) or error}") from None
    if not isinstance(loaded, dict):
        raise UserError(f"{path}: expected a mapping of training settings (a TRL or Axolotl config), got "
                        f"{type(loaded).__name__ if loaded is not None else 'an empty file'}")
    return loaded


def detect(config: dict[str, Any]) -> str:
    if "base_model" in config or "datasets" in config or "sequence_len" in config or "micro_batch_size" in config:
        return "axolotl"
    return "trl"


def convert(path: Path) -> tuple[str, Conversion]:
    """(our spec text, the conversion with its notes) for a TRL or Axolotl config file."""
    from agent.train.presets import spec_with_values
    from protocol.jobspec import TEMPLATE

    config = read_config(path)
    kind = detect(config)
    conversion = (_from_axolotl if kind == "axolotl" else _from_trl)(config, path)
    intro = (f"# converted from {path.name} ({'Axolotl' if kind == 'axolotl' else 'TRL'} config) by "
             f"`infernet train init --from`; {len(conversion.notes)} field(s) not honoured as written, listed at the end.\n")
    text = spec_with_values(TEMPLATE, conversion.values, intro)
    if conversion.notes:
        text += ("\n# from " + path.name + ", not honoured as written:\n"
                 + "".join(f"#   {line}\n" for line in conversion.notes))
    return text, conversion


# -- shared pieces ---------------------------------------------------------------------------------

def _epochs(conversion: Conversion, name: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        conversion.note(name, f"{value!r} is not a positive number of epochs; the spec keeps 1")
        return
    epochs = math.ceil(value)
    conversion.set("training", "epochs", epochs)
    if epochs != value:
        conversion.note(name, f"{value} is not whole; the spec trains {epochs} epoch(s) a round (max_steps can cut it)")


def _number(conversion: Conversion, name: str, value: Any, section: str, key: str, *, integer: bool,
            minimum: float = 0, unset: tuple = ()) -> None:
    if value in unset:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= minimum
    if integer:
        ok = ok and float(value).is_integer()
    if not ok:
        conversion.note(name, f"{value!r} is not a valid {key}; the spec keeps its default")
        return
    conversion.set(section, key, int(value) if integer else float(value))


# (section, key) -> (an integer?, the least value): the numbers both converters map, checked one way
NUMBER_RULES = {
    ("training", "learning_rate"): (False, 1e-12), ("training", "batch_size"): (True, 1),
    ("training", "gradient_accumulation_steps"): (True, 1), ("training", "max_seq_len"): (True, 8),
    ("training", "max_steps"): (True, 0), ("", "seed"): (True, 0),
    ("lora", "rank"): (True, 1), ("lora", "alpha"): (False, 1e-12), ("lora", "dropout"): (False, 0),
}
LORA_NUMBERS = {"lora_r": ("lora", "rank"), "lora_alpha": ("lora", "alpha"), "lora_dropout": ("lora", "dropout")}
TRL_NUMBERS = {
    "learning_rate": ("training", "learning_rate"), "per_device_train_batch_size": ("training", "batch_size"),
    "gradient_accumulation_steps": ("training", "gradient_accumulation_steps"),
    "max_length": ("training", "max_seq_len"), "max_seq_length": ("training", "max_seq_len"),
    "max_steps": ("training", "max_steps"), "seed": ("", "seed"), **LORA_NUMBERS,
}
AXOLOTL_NUMBERS = {
    "learning_rate": ("training", "learning_rate"), "micro_batch_size": ("training", "batch_size"),
    "gradient_accumulation_steps": ("training", "gradient_accumulation_steps"),
    "sequence_len": ("training", "max_seq_len"), "max_steps": ("training", "max_steps"), "seed": ("", "seed"),
    **LORA_NUMBERS,
}


def _numbers(conversion: Conversion, rest: dict[str, Any], names: dict[str, tuple[str, str]]) -> None:
    """Each numeric field of ``names`` present in ``rest`` (taken out of it) onto its spec key, by NUMBER_RULES;
    ``max_steps: -1`` (the trainers' "no limit") is unset."""
    for name, (section, key) in names.items():
        integer, minimum = NUMBER_RULES[(section, key)]
        _number(conversion, name, rest.pop(name, None), section, key, integer=integer, minimum=minimum,
                unset=(None, -1) if key == "max_steps" else (None,))


def _packing(conversion: Conversion, rest: dict[str, Any], name: str) -> None:
    if name in rest:
        packing = rest.pop(name)
        if isinstance(packing, bool):
            conversion.set("training", "packing", packing)
        else:
            conversion.note(name, f"{packing!r} is not true or false; the spec does not pack")


def _targets(conversion: Conversion, name: str, value: Any) -> None:
    if value in ("all-linear", "all_linear"):
        conversion.set("lora", "target_modules", ALL_LINEAR)
        conversion.note(name, f"'all-linear' became {', '.join(ALL_LINEAR)} (a Llama/Qwen-style model's projections; "
                              "announce checks them against the model)")
    elif isinstance(value, str) and value:
        conversion.set("lora", "target_modules", [value])
    elif isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
        conversion.set("lora", "target_modules", list(dict.fromkeys(value)))
    elif value is not None:
        conversion.note(name, f"{value!r} is not a list of module names; the spec keeps its default")


def _name(conversion: Conversion, value: Any) -> None:
    """The job's name from the run's name or output directory (a label for people)."""
    if isinstance(value, str) and Path(value).name.strip(". "):
        conversion.set("", "name", Path(value).name[:256])


def _dataset(conversion: Conversion, name: str, value: Any, config_dir: Path, *, split: Any = None,
             config: Any = None) -> None:
    """A local JSONL file becomes input.dataset; anything else a Hugging Face dataset (input.hf, its split and
    config), which the submitter reads with the datasets library (agent/hfdata.py)."""
    text = str(value)
    candidate = Path(text).expanduser()
    local = candidate if candidate.is_absolute() else config_dir / candidate
    if text.endswith((".jsonl", ".json")) or local.is_file():
        conversion.set("input", "dataset", text)
        return
    conversion.set("input", "hf", text)
    conversion.unset("input", "dataset")
    if isinstance(split, str) and split:
        conversion.set("input", "split", split)
    if isinstance(config, str) and config:
        conversion.set("input", "config", config)


def _scheduler(conversion: Conversion, name: str, value: Any) -> None:
    """A decaying schedule within a run becomes ``inner_schedule: triangle``, the closest one offered."""
    if value in (None, "constant", "constant_with_warmup"):
        if value == "constant_with_warmup":
            conversion.note(name, "'constant_with_warmup': the rate is constant within a round (warm-up across "
                                  "rounds: training.warmup_rounds)")
        return
    if value in ("cosine", "linear", "cosine_with_min_lr", "cosine_with_restarts", "polynomial", "inverse_sqrt"):
        conversion.set("training", "inner_schedule", "triangle")
        conversion.note(name, f"{value!r} became inner_schedule: triangle, the closest offered (a warm-up over a "
                              "round's first 10 % of steps, then a linear decay to 0.1x at its last)")
    else:
        conversion.note(name, f"{value!r} is not offered; the rate is constant within a round")


def _optimizer_notes(conversion: Conversion, rest: dict[str, Any], *, scheduler: str, optimizer: str) -> None:
    """The schedule, warm-up, weight decay and optimizer fields (their names differ between TRL and Axolotl)."""
    _scheduler(conversion, scheduler, rest.get(scheduler))
    for name in ("warmup_ratio", "warmup_steps"):
        if rest.get(name) not in (None, 0, 0.0):
            conversion.note(name, "warm-up is inner_schedule: triangle's first 10 % of a round's steps (and "
                                  "training.warmup_rounds across rounds), not a number of its own")
    if rest.get("weight_decay") not in (None, 0, 0.0):
        conversion.note("weight_decay", "AdamW runs with weight decay 0 (IPIP-0005: the step is fixed by the proof)")
    if rest.get(optimizer) not in (None, "adamw_torch", "adamw_torch_fused", "adamw_hf"):
        conversion.note(optimizer, f"{rest.get(optimizer)!r}: the optimizer is torch's AdamW (IPIP-0005)")


WORKER_OWN = "the worker's own choice on its machine, not the job's"
NOT_A_JOB_SETTING = "output and logging are not job settings here (see `job watch`, the run directory and the ledger)"


def _ignored(conversion: Conversion, name: str, value: Any, known: dict[str, str]) -> None:
    if name in known:
        why = known[name]
        if why:
            conversion.note(name, why)
    else:
        conversion.note(name, "unknown to this converter; not honoured")


# -- TRL -------------------------------------------------------------------------------------------

TRL_IGNORED = {  # fields with no effect on what trains, or whose default is ours: not reported
    "output_dir": "", "overwrite_output_dir": "", "logging_dir": "", "logging_steps": "", "logging_strategy": "",
    "logging_first_step": "", "report_to": "", "run_name": "", "push_to_hub": "", "hub_model_id": "",
    "save_strategy": "", "save_total_limit": "", "save_steps": "", "eval_strategy": "", "evaluation_strategy": "",
    "eval_steps": "", "per_device_eval_batch_size": "", "do_train": "", "do_eval": "", "dataset_text_field": "",
    "dataset_train_split": "", "dataset_test_split": "", "torch_dtype": "", "dtype": "",
    "bf16": "", "fp16": "", "tf32": "", "gradient_checkpointing": "", "gradient_checkpointing_kwargs": "",
    "attn_implementation": "", "use_liger_kernel": "", "dataloader_num_workers": "", "remove_unused_columns": "",
    "trust_remote_code": "", "model_revision": "", "use_peft": "", "lora_task_type": "", "bnb_4bit_quant_type": "",
    "use_bnb_nested_quant": "", "bnb_4bit_compute_dtype": "", "max_grad_norm": "", "optim": "",
    "lr_scheduler_type": "", "warmup_ratio": "", "warmup_steps": "", "weight_decay": "", "load_in_8bit": "",
    "dataset_config": "", "assistant_only_loss": "", "completion_only_loss": "",
}


def _from_trl(config: dict[str, Any], path: Path) -> Conversion:
    c = Conversion("trl")
    rest = dict(config)
    _name(c, rest.get("run_name") or rest.get("output_dir"))
    model = rest.pop("model_name_or_path", rest.pop("model", None))
    if model:
        c.set("", "base_model", model)
    dataset = rest.pop("dataset_name", None)
    if dataset:
        _dataset(c, "dataset_name", dataset, path.parent, split=rest.pop("dataset_train_split", None),
                 config=rest.pop("dataset_config", None))
    _trl_dpo(c, rest)
    if "num_train_epochs" in rest:
        _epochs(c, "num_train_epochs", rest.pop("num_train_epochs"))
    _numbers(c, rest, TRL_NUMBERS)
    _packing(c, rest, "packing")
    use_peft = config.get("use_peft", True)
    if use_peft is False:
        c.note("use_peft", "false means full fine-tuning, which jobs do not offer yet: the spec trains a LoRA adapter")
    if "lora_target_modules" in rest:
        _targets(c, "lora_target_modules", rest.pop("lora_target_modules"))
    if rest.pop("load_in_4bit", False) is True:
        c.set("", "method", "qlora")
    if rest.get("load_in_8bit") is True:
        c.note("load_in_8bit", "8-bit base models are not offered (lora, or qlora's 4-bit)")
    _optimizer_notes(c, rest, scheduler="lr_scheduler_type", optimizer="optim")
    if rest.get("max_grad_norm") not in (None, 1.0, 1):
        c.note("max_grad_norm", "the gradient norm is clipped at 1.0")
    if rest.get("gradient_checkpointing") is True or rest.get("bf16") is True or rest.get("fp16") is True:
        c.note("bf16/fp16/gradient_checkpointing", WORKER_OWN + " (dtype: bf16 on GPUs that have it; fp16 is not a "
                                                   "training dtype, IPIP-0005 §8.1)")
    for name, value in rest.items():
        _ignored(c, name, value, TRL_IGNORED)
    return c


TRL_DPO_FIELDS = ("beta", "loss_type", "label_smoothing", "reference_free", "rpo_alpha", "max_prompt_length",
                  "max_completion_length", "precompute_ref_log_probs", "sync_ref_model", "ref_model_init_kwargs",
                  "use_weighting", "ld_alpha", "f_divergence_type", "generate_during_eval")


def _beta(conversion: Conversion, name: str, value: Any) -> None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 100:
        conversion.set("dpo", "beta", float(value))
    elif value is not None:
        conversion.note(name, f"{value!r} is not a beta in (0, 100]; the spec keeps 0.1")


def _trl_dpo(c: Conversion, rest: dict[str, Any]) -> None:
    """A DPOConfig (its own fields present): ``type: dpo``; the loss variants and options it cannot honour named."""
    if not any(name in rest for name in TRL_DPO_FIELDS):
        return
    c.set("", "type", "dpo")
    _beta(c, "beta", rest.pop("beta", None))
    loss = rest.pop("loss_type", None)
    if loss not in (None, "sigmoid", ["sigmoid"]):
        c.note("loss_type", f"{loss!r}: the DPO loss is the sigmoid one (IPIP-0005 §6.2)")
    if rest.pop("label_smoothing", 0) not in (0, 0.0, None):
        c.note("label_smoothing", "the DPO loss has no label smoothing (robust/cDPO is not offered)")
    if rest.pop("reference_free", False) is True:
        c.note("reference_free", "the reference is always the base model (the adapter disabled)")
    if rest.pop("rpo_alpha", None) is not None:
        c.note("rpo_alpha", "no NLL term is added to the DPO loss (RPO is not offered)")
    for name in ("max_prompt_length", "max_completion_length"):
        if rest.pop(name, None) is not None:
            c.note(name, "each side (prompt + completion) is cut at training.max_seq_len; no separate cut")
    for name in ("precompute_ref_log_probs", "sync_ref_model", "ref_model_init_kwargs", "use_weighting", "ld_alpha",
                 "f_divergence_type", "generate_during_eval"):
        value = rest.pop(name, None)
        if value not in (None, False, "reverse_kl") and name != "precompute_ref_log_probs":
            c.note(name, f"{value!r}: not offered (the reference is the fixed base model, the loss the sigmoid one)")


# -- Axolotl ---------------------------------------------------------------------------------------

AXOLOTL_IGNORED = {
    "output_dir": "", "wandb_project": "", "wandb_entity": "", "wandb_watch": "", "wandb_name": "",
    "wandb_log_model": "", "logging_steps": "", "saves_per_epoch": "", "evals_per_epoch": "", "save_steps": "",
    "eval_steps": "", "dataset_prepared_path": "", "hub_model_id": "", "strict": "", "tokenizer_type": "",
    "model_type": "", "bf16": "", "fp16": "", "tf32": "", "gradient_checkpointing": "", "flash_attention": "",
    "sdp_attention": "", "xformers_attention": "", "train_on_inputs": "", "group_by_length": "",
    "pad_to_sequence_len": "", "early_stopping_patience": "", "resume_from_checkpoint": "", "local_rank": "",
    "special_tokens": "", "chat_template": "", "load_in_8bit": "", "lr_scheduler": "", "warmup_steps": "",
    "warmup_ratio": "", "weight_decay": "", "optimizer": "", "max_grad_norm": "", "adapter": "",
    "lora_target_linear": "", "lora_fan_in_fan_out": "", "debug": "", "deepspeed": "", "fsdp": "",
    "fsdp_config": "", "eval_sample_packing": "", "trust_remote_code": "", "lora_model_dir": "",
    "val_set_size": "", "is_llama_derived_model": "", "is_qwen_derived_model": "",
}


def _from_axolotl(config: dict[str, Any], path: Path) -> Conversion:
    c = Conversion("axolotl")
    rest = dict(config)
    _name(c, rest.get("wandb_name") or rest.get("output_dir"))
    if rest.get("base_model"):
        c.set("", "base_model", rest.pop("base_model"))
    datasets = rest.pop("datasets", None)
    rl = rest.pop("rl", None)
    if rl in ("dpo", True):
        c.set("", "type", "dpo")
        beta = rest.pop("rl_beta", None)
        _beta(c, "rl_beta" if beta is not None else "dpo_beta", beta if beta is not None else rest.pop("dpo_beta", None))
    elif rl not in (None, False, ""):
        c.note("rl", f"{rl!r} is not offered (sft, or rl: dpo)")
    if isinstance(datasets, list) and datasets and isinstance(datasets[0], dict) and datasets[0].get("path"):
        first = datasets[0]
        _dataset(c, "datasets[0].path", first["path"], path.parent, split=first.get("split"), config=first.get("name"))
        kind = first.get("type")
        if rl in ("dpo", True):
            if kind is not None:
                c.note("datasets[0].type", f"{kind!r}: the spec reads preference records as TRL does (prompt, chosen, "
                                           "rejected; text or messages), not Axolotl's per-dataset mappings")
        elif kind not in (None, "chat_template", "sharegpt", "chatml"):
            c.note("datasets[0].type", f"{kind!r}: the spec reads ChatML records ({{\"messages\": [...]}}); convert "
                                       "the file to that format")
        if len(datasets) > 1:
            c.note("datasets[1]", f"and {len(datasets) - 2} more after it: a job trains on one file; concatenate them")
    elif datasets is not None:
        c.note("datasets", "expected a list of {path, type}; input.dataset is left to set")
    adapter = rest.get("adapter")
    if adapter == "qlora" or rest.pop("load_in_4bit", False) is True:
        c.set("", "method", "qlora")
    elif adapter in (None, ""):
        c.note("adapter", "none means full fine-tuning, which jobs do not offer yet: the spec trains a LoRA adapter")
    elif adapter != "lora":
        c.note("adapter", f"{adapter!r} is not offered (lora, qlora)")
    if "num_epochs" in rest:
        _epochs(c, "num_epochs", rest.pop("num_epochs"))
    _numbers(c, rest, AXOLOTL_NUMBERS)
    _packing(c, rest, "sample_packing")
    val = rest.get("val_set_size")
    if isinstance(val, (int, float)) and not isinstance(val, bool) and val > 0:
        if val < 0.5:
            c.set("input", "validation_split", float(val))
        else:
            c.note("val_set_size", f"{val}: input.validation_split is a fraction below 0.5")
    if rest.get("lora_target_linear") is True:
        _targets(c, "lora_target_linear", "all-linear")
    elif "lora_target_modules" in rest:
        _targets(c, "lora_target_modules", rest.pop("lora_target_modules"))
    _optimizer_notes(c, rest, scheduler="lr_scheduler", optimizer="optimizer")
    if rest.get("load_in_8bit") is True:
        c.note("load_in_8bit", "8-bit base models are not offered (lora, or qlora's 4-bit)")
    for name in ("deepspeed", "fsdp", "fsdp_config"):
        if rest.get(name):
            c.note(name, "a job's shards train on separate machines; one worker with several GPUs trains data-parallel "
                         "by itself (train_processes)")
    if rest.get("gradient_checkpointing") is True or rest.get("bf16") not in (None, False, "auto") or rest.get("fp16"):
        c.note("bf16/fp16/gradient_checkpointing", WORKER_OWN + " (dtype: bf16 on GPUs that have it; fp16 is not a "
                                                   "training dtype, IPIP-0005 §8.1)")
    for name, value in rest.items():
        _ignored(c, name, value, AXOLOTL_IGNORED)
    return c
