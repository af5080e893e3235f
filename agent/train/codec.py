"""Compressed round reports (IPIP-0006 §2.8, spec key ``training.report_codec``).

A worker's report carries its round's end state: the trained adapter and, when the job carries the
optimizer state (§2.3), its AdamW moments. Sent whole in float32 that is four copies' worth of the
trainable tensors a round (A, B, exp_avg, exp_avg_sq), which a home uplink pays for every round.
With ``report_codec: int8``, ``int4`` or ``int4-log`` the worker sends instead:

- the round's *delta* of every trained adapter tensor (end - start; a frozen tensor such as lora_A
  under FFA-LoRA is not sent at all: the coordinator holds the round's start),
- ``exp_avg`` as it is, and ``exp_avg_sq`` through its square root (the scale Adam divides by),
- each cut into blocks of ``BLOCK`` values, every block coded with one float32 scale:
  ``q = round(x / s)``, ``s = max|x| / 127`` (int8; the root: / 255, uint8), or with ``int4``
  ``s = max|x| / 7`` (the root: / 15), the codes packed two to a byte; ``step`` counters as they are;
- ``int4-log``: as ``int4``, but the root on a log scale (``encode_root_log``): the block's scale is its
  largest root, and code q > 0 stands for ``s * 2^(-(15 - q) / 2)``, so every root within a factor 128
  of the largest is coded to within 19 % of itself. A second moment spans decades within a block, so on
  ``int4``'s linear scale most roots fell below its first step and were raised to it: Adam then divided
  by roots up to 15x too large, and those coordinates nearly stopped learning (measured in
  scripts/bench_quality.py: that, not the delta's or exp_avg's codes, was most of ``int4``'s loss).
- ``int4-fresh``: as ``int4-log``, but of ``exp_avg_sq`` only what the round added is coded: u = v_end -
  BETA2^n * v_start >= 0 (v_start: the round's start state, which the coordinator holds; n: the steps
  between the start's and the end's step counters), and v' = BETA2^n * v_start + u'. A second moment
  keeps ~1/(1 - BETA2) steps of memory, so ``int4-log``'s error on the whole v (up to 19 %, the same
  rounding every round while v moves slowly) stayed in it round after round; here the decayed start,
  most of v after the first round, is carried exactly and only the round's own part is rounded.

Rules of this file:
- Bit-exact. Encoding and decoding are float32 operations in a fixed order on the CPU (round half
  to even), so every machine turns the same state into the same bytes and back into the same
  tensors: the verifier can recompute them.
- The state is what is sent. The worker does not keep its unrounded end state: its last step is
  followed by ``round_trip``, which replaces the adapter and moments by what the payload decodes
  to, and the proof's last link commits *that* state. So the coordinator checks the payload against
  the chain by decoding it and hashing (as it checks a whole adapter today), and a replay of the last
  segment applies the same ``round_trip`` before it compares.
- A root never decodes to zero where it was not zero: Adam divides by it, and a zero would make a
  step of lr·m/eps. Its quantum is at least 1 where the value was positive.
- Decoding untrusted bytes checks every key, dtype and length against the state it applies to and
  raises ``CodecError`` naming the key.
This module imports no networking code.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

BLOCK = 64
# bits per value of (adapter delta, exp_avg, root of exp_avg_sq) for each codec (protocol/messages.REPORT_CODECS)
BITS = {"int8": (8, 8, 8), "int4": (4, 4, 4), "int4-log": (4, 4, 4), "int4-fresh": (4, 4, 4)}
# codecs whose roots of exp_avg_sq are coded on a log scale: code q > 0 stands for max * 2^(-(2^bits - 1 - q) * step)
# (relative steps: a second moment spans decades within a block, and Adam divides by its root)
LOG_ROOT_STEP = {"int4-log": 0.5, "int4-fresh": 0.5}
# codecs that code of exp_avg_sq only what the round added: v_end - BETA2^n * v_start, where v_start is the round's
# start state (which the coordinator holds) and n the steps trained (the step counters'); decoded v = that + BETA2^n * v_start
FRESH = {"int4-fresh"}
BETA2 = 0.999  # the inner AdamW's (IPIP-0005 §3: betas 0.9/0.999)
PAYLOAD_FILE = "delta.safetensors"


def payload_format(codec: str, kind: str = "report") -> str:
    """The ``format`` metadata of a payload: a worker's report, or a coded aggregate's ``update`` (IPIP-0006 §2.8.1)."""
    return f"infernet-{kind}-{codec}/1"


class CodecError(ValueError):
    """A payload that does not decode onto the given state; the message names the key."""


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` as float32 on the CPU, flattened, zero-padded to whole blocks: (blocks, BLOCK)."""
    flat = x.detach().to("cpu", torch.float32).reshape(-1)
    padded = torch.zeros(((flat.numel() + BLOCK - 1) // BLOCK) * BLOCK, dtype=torch.float32)
    padded[:flat.numel()] = flat
    return padded.view(-1, BLOCK)


def encode_signed(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes in [-(2^(bits-1) - 1), 2^(bits-1) - 1], float32 scale per block) of ``x``."""
    top = float(2 ** (bits - 1) - 1)
    blocks = _blocks(x)
    scale = blocks.abs().amax(dim=1) / top
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(blocks / safe[:, None]).clamp_(-top, top).to(torch.int8)
    return codes.reshape(-1), scale


def decode_signed(codes: torch.Tensor, scale: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    values = (codes.view(-1, BLOCK).to(torch.float32) * scale[:, None]).reshape(-1)
    return values[:like.numel()].reshape(like.shape)


def encode_root(v: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes in [0, 2^bits - 1], float32 scale per block) of sqrt(v), v >= 0; a positive
    value codes to >= 1."""
    top = float(2 ** bits - 1)
    blocks = _blocks(v)
    # float32 sqrt on the CPU is not correctly rounded in every build (torch 2.13's vector path gave
    # 1.00000005e-4 for sqrt(1e-8)); float64 sqrt is (IEEE 754), and its rounding to float32 is exact
    root = blocks.clamp(min=0).to(torch.float64).sqrt().to(torch.float32)
    scale = root.amax(dim=1) / top
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(root / safe[:, None]).clamp_(0, top)
    codes = torch.where(root > 0, codes.clamp(min=1), codes).to(torch.uint8)
    return codes.reshape(-1), scale


def _log_levels(bits: int, step: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the root each positive code 1..2^bits - 1 stands for, as a fraction of the block's largest; the
    thresholds between neighbouring codes, the geometric midpoints), float32 constants computed in float64."""
    top = 2 ** bits - 1
    levels = torch.tensor([2.0 ** (-(top - q) * step) for q in range(1, top + 1)], dtype=torch.float64)
    between = torch.tensor([2.0 ** (-(top - q) * step - step / 2) for q in range(2, top + 1)], dtype=torch.float64)
    return levels.to(torch.float32), between.to(torch.float32)


def encode_root_log(v: torch.Tensor, bits: int = 4, step: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes in [0, 2^bits - 1], float32 scale per block) of sqrt(v), v >= 0, on a log scale: the scale is
    the block's largest root r_max; a root r > 0 codes to 1 + the number of thresholds ``r_max * between[k]``
    it reaches (float32 products and comparisons: exact everywhere), so the nearest level in ratio, the
    smallest level where r is below the range; 0 codes for 0 only."""
    _, between = _log_levels(bits, step)
    blocks = _blocks(v)
    root = blocks.clamp(min=0).to(torch.float64).sqrt().to(torch.float32)  # (see encode_root)
    scale = root.amax(dim=1)
    thresholds = scale[:, None, None] * between[None, None, :]
    codes = (root[:, :, None] >= thresholds).sum(dim=2) + 1
    codes = torch.where(root > 0, codes, torch.zeros_like(codes)).to(torch.uint8)
    return codes.reshape(-1), scale


def decode_root_log(codes: torch.Tensor, scale: torch.Tensor, like: torch.Tensor, bits: int = 4,
                    step: float = 0.5) -> torch.Tensor:
    levels, _ = _log_levels(bits, step)
    table = torch.cat([torch.zeros(1, dtype=torch.float32), levels])
    root = table[codes.view(-1, BLOCK).long()] * scale[:, None]
    return (root * root).reshape(-1)[:like.numel()].reshape(like.shape)


def decode_root(codes: torch.Tensor, scale: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    root = codes.view(-1, BLOCK).to(torch.float32) * scale[:, None]
    return (root * root).reshape(-1)[:like.numel()].reshape(like.shape)


def _kind(key: str) -> str:
    if key.endswith(".exp_avg_sq"):
        return "root"
    if key.endswith(".exp_avg"):
        return "signed"
    if key.endswith(".step"):
        return "raw"
    return "delta"


def _step_key(key: str) -> str:
    """The step counter's key beside the AdamW tensor ``key`` (``<param>.exp_avg_sq`` -> ``<param>.step``)."""
    return key.rpartition(".")[0] + ".step"


def _decayed_start(key: str, like: torch.Tensor, end_step: torch.Tensor | None,
                   optimizer_start: Mapping[str, torch.Tensor] | None) -> torch.Tensor:
    """BETA2^n * the round start's exp_avg_sq ``key`` (float32; zeros without a start state), n = ``end_step``
    (the round's end step counter of that tensor) - the start's."""
    base = (optimizer_start or {}).get(key)
    if base is None:
        return torch.zeros(like.shape, dtype=torch.float32)
    step_key = _step_key(key)
    start_step = optimizer_start.get(step_key)
    if end_step is None or start_step is None:
        raise CodecError(f"{step_key}: missing; the steps of a round are needed to code its second moment")
    if not all(torch.isfinite(t).all() and t.numel() == 1 for t in (end_step, start_step)):
        raise CodecError(f"{step_key}: not one finite step counter")
    n = int(round(float(end_step))) - int(round(float(start_step)))
    if n < 0:
        raise CodecError(f"{step_key}: {float(end_step):g} is before the round's start {float(start_step):g}")
    decay = torch.tensor(BETA2 ** n, dtype=torch.float64).to(torch.float32)
    return base.detach().to("cpu", torch.float32) * decay


def encode(start: Mapping[str, torch.Tensor], end: Mapping[str, torch.Tensor],
           optimizer: Mapping[str, torch.Tensor], frozen: Sequence[str], codec: str = "int8",
           optimizer_start: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The payload's tensors: adapter deltas (frozen keys left out) and the AdamW state. ``optimizer_start``:
    the AdamW state the round started from (codecs in FRESH)."""
    delta_bits, signed_bits, root_bits = BITS[codec]
    log_step = LOG_ROOT_STEP.get(codec)
    out: dict[str, torch.Tensor] = {}
    skip = set(frozen)
    for key, tensor in end.items():
        if key in skip:
            continue
        if key not in start:
            raise CodecError(f"{key}: not in the round's start adapter")
        delta = tensor.detach().to("cpu", torch.float32) - start[key].detach().to("cpu", torch.float32)
        out[f"adapter/{key}.q"], out[f"adapter/{key}.scale"] = _packed(*encode_signed(delta, delta_bits), delta_bits, True)
    for key, tensor in optimizer.items():
        kind = _kind(key)
        if kind == "raw":
            out[f"optimizer/{key}"] = tensor.detach().to("cpu").contiguous()
        elif kind == "root":
            if codec in FRESH:
                base = _decayed_start(key, tensor, optimizer.get(_step_key(key)), optimizer_start)
                tensor = (tensor.detach().to("cpu", torch.float32) - base).clamp_(min=0)
            coded = encode_root(tensor, root_bits) if log_step is None else encode_root_log(tensor, root_bits, log_step)
            out[f"optimizer/{key}.q"], out[f"optimizer/{key}.scale"] = _packed(*coded, root_bits, False)
        elif kind == "signed":
            out[f"optimizer/{key}.q"], out[f"optimizer/{key}.scale"] = _packed(*encode_signed(tensor, signed_bits), signed_bits, True)
        else:
            raise CodecError(f"optimizer state {key}: not an AdamW tensor (step, exp_avg, exp_avg_sq)")
    return out


def _packed(codes: torch.Tensor, scale: torch.Tensor, bits: int, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """4-bit codes two to a byte (uint8: the first code in the low nibble; a signed code q stored as
    q + 8, so its nibble is 1..15); 8-bit codes as they are."""
    if bits == 8:
        return codes, scale
    nibbles = (codes.to(torch.int16) + (8 if signed else 0)).to(torch.uint8).view(-1, 2)
    return (nibbles[:, 0] | (nibbles[:, 1] << 4)).contiguous(), scale


def _unpacked(stored: torch.Tensor, bits: int, signed: bool, name: str) -> torch.Tensor:
    """The codes of a stored ``.q`` tensor, range-checked: CodecError naming it if one is out of range."""
    if bits == 8:
        return stored
    nibbles = torch.stack([stored & 0x0F, stored >> 4], dim=1).reshape(-1)
    if signed:
        if bool((nibbles == 0).any()):
            raise CodecError(f"{name}.q: a 4-bit signed code is out of range")
        return (nibbles.to(torch.int16) - 8).to(torch.int8)
    return nibbles


def decode(payload: Mapping[str, torch.Tensor], start: Mapping[str, torch.Tensor],
           optimizer_like: Mapping[str, torch.Tensor] | None, frozen: Sequence[str], codec: str = "int8",
           optimizer_start: Mapping[str, torch.Tensor] | None = None
           ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(adapter, optimizer state) that ``payload`` codes for, on top of the round's ``start``.

    ``optimizer_like``: a state with the expected keys and shapes (the worker's own state, or one
    the verifier builds); None: the keys are read off the payload with the adapter's shapes.
    Raises CodecError naming the first key that is missing, extra or of the wrong dtype or length.
    """
    if codec not in BITS:
        raise CodecError(f"unknown report codec {codec!r}")
    delta_bits, signed_bits, root_bits = BITS[codec]
    log_step = LOG_ROOT_STEP.get(codec)
    adapter: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    skip = set(frozen)
    for key, base in start.items():
        if key in skip:
            adapter[key] = base.detach().clone()
            continue
        codes, scale = _pair(payload, f"adapter/{key}", base, delta_bits, True, used)
        delta = decode_signed(codes, scale, base)
        adapter[key] = (base.detach().to("cpu", torch.float32) + delta).to(base.dtype)
    optimizer: dict[str, torch.Tensor] = {}
    if optimizer_like is None:
        optimizer_like = _optimizer_shapes(payload, start)
    for key, like in optimizer_like.items():
        kind = _kind(key)
        if kind == "raw":
            name = f"optimizer/{key}"
            tensor = payload.get(name)
            if tensor is None or tensor.shape != like.shape or not tensor.is_floating_point():
                raise CodecError(f"{name}: missing or not a {tuple(like.shape)} float tensor")
            used.add(name)
            optimizer[key] = tensor.clone()
            continue
        bits = root_bits if kind == "root" else signed_bits
        codes, scale = _pair(payload, f"optimizer/{key}", like, bits, kind != "root", used)
        if kind != "root":
            decoded = decode_signed(codes, scale, like)
        elif log_step is None:
            decoded = decode_root(codes, scale, like)
        else:
            decoded = decode_root_log(codes, scale, like, bits, log_step)
        if kind == "root" and codec in FRESH:
            # (the payload carries step counters as they are)
            decoded = decoded + _decayed_start(key, like, payload.get(f"optimizer/{_step_key(key)}"), optimizer_start)
        optimizer[key] = decoded.to(like.dtype)
    extra = set(payload) - used
    if extra:
        raise CodecError(f"{sorted(extra)[0]}: fits no tensor of the adapter or its optimizer state")
    return adapter, optimizer


def _pair(payload: Mapping[str, torch.Tensor], name: str, like: torch.Tensor, bits: int, signed: bool,
          used: set[str]) -> tuple[torch.Tensor, torch.Tensor]:
    codes, scale = payload.get(f"{name}.q"), payload.get(f"{name}.scale")
    blocks = (like.numel() + BLOCK - 1) // BLOCK
    if codes is None or scale is None:
        raise CodecError(f"{name}: missing from the payload")
    dtype = torch.int8 if signed and bits == 8 else torch.uint8
    length = blocks * BLOCK * bits // 8
    if codes.dtype != dtype or codes.dim() != 1 or codes.numel() != length:
        raise CodecError(f"{name}.q: expected {length} {dtype} values, got {codes.numel()} {codes.dtype}")
    if scale.dtype != torch.float32 or scale.dim() != 1 or scale.numel() != blocks:
        raise CodecError(f"{name}.scale: expected {blocks} float32 scales, got {scale.numel()} {scale.dtype}")
    if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        raise CodecError(f"{name}.scale: a scale is negative or not finite")
    codes = _unpacked(codes, bits, signed, name)
    if bits == 8 and signed and bool((codes == -128).any()):
        raise CodecError(f"{name}.q: a code is out of range (-128)")
    used.update((f"{name}.q", f"{name}.scale"))
    return codes, scale


def _optimizer_shapes(payload: Mapping[str, torch.Tensor], start: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The AdamW state's keys and shapes as the payload names them, shaped like their adapter tensor."""
    like: dict[str, torch.Tensor] = {}
    for name, tensor in payload.items():
        if not name.startswith("optimizer/"):
            continue
        key = name[len("optimizer/"):]
        if key.endswith((".q", ".scale")):
            key = key.rsplit(".", 1)[0]
        parameter, _, kind = key.rpartition(".")
        if kind == "step":
            like[key] = tensor
        elif parameter in start and kind in ("exp_avg", "exp_avg_sq"):
            like[key] = torch.empty(start[parameter].shape, dtype=torch.float32)
        else:
            raise CodecError(f"{name}: names no trainable tensor of the adapter")
    return like


def round_trip(start: Mapping[str, torch.Tensor], end: Mapping[str, torch.Tensor],
               optimizer: Mapping[str, torch.Tensor], frozen: Sequence[str], codec: str = "int8",
               optimizer_start: Mapping[str, torch.Tensor] | None = None
               ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(payload, adapter, optimizer state): what the worker sends and the state it then holds."""
    payload = encode(start, end, optimizer, frozen, codec, optimizer_start)
    adapter, state = decode(payload, start, optimizer, frozen, codec, optimizer_start)
    return payload, adapter, state


def save_payload(path: Path, payload: Mapping[str, torch.Tensor], codec: str = "int8", kind: str = "report") -> None:
    from safetensors.torch import save_file

    save_file(dict(payload), str(path), metadata={"format": payload_format(codec, kind), "block": json.dumps(BLOCK)})


def load_payload(path: Path, codec: str = "int8", kind: str = "report") -> dict[str, torch.Tensor]:
    """The payload's tensors; CodecError when the file is not one of ``codec`` (untrusted bytes)."""
    from safetensors import SafetensorError, safe_open

    expected = payload_format(codec, kind)
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            if metadata.get("format") != expected:
                raise CodecError(f"{path.name}: format {metadata.get('format')!r}, expected {expected!r}")
            return {key: handle.get_tensor(key) for key in handle.keys()}
    except (OSError, SafetensorError) as error:
        raise CodecError(f"{path.name}: does not load: {error}") from None


def payload_bytes(payload: Mapping[str, torch.Tensor]) -> int:
    """Bytes of the payload's tensors as stored (4-bit codes are packed two to a byte)."""
    return sum(t.numel() * t.element_size() for t in payload.values())
