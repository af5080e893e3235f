"""Fuzz the decoders of untrusted input: envelopes, message bodies, canonical msgpack, dag-pb nodes, job specs.

Usage::

    python scripts/fuzz_decoders.py              # 100,000 cases (the full run)
    python scripts/fuzz_decoders.py --short      # 5,000 cases, what CI runs (tests/harness/test_fuzz.py)
    python scripts/fuzz_decoders.py --cases N --seed S

Rules of this file:
- A seeded mutator (``random.Random(seed)``), so every run is reproducible and a finding can be
  replayed from its seed, case number and the printed reproducer.
- Seeds are real: a sealed envelope of every message type (protocol/messages.py), the dag-pb
  blocks of real UnixFS imports and the IPIP-0003 decode vectors, the IPIP-0007 job specs.
- Mutations: byte flips, truncations, insertions, deletions, splices of two inputs, random bytes;
  msgpack-level structural mutations of envelope bodies (drop, add or retype a field, oversize
  strings and lists, nesting, another type's tag) that are re-encoded canonically and *re-signed*,
  so they pass the signature and reach the body validation; token and line mutations of YAML.
- What counts as a finding (exit status 1, the reproducer printed in hex with the exception):
    * any exception but the decoder's own (CodecError; CIDError for dag-pb; SpecError for specs);
    * a SpecError whose message is not one line;
    * an envelope mutated *without* re-signing that opens (a forgery accepted);
    * a re-signed envelope, or a body, that decodes to a message whose canonical re-encoding is
      not the body it came from (two encodings of one message, or a lossy decode);
    * a decode_canonical result that does not re-encode to its input.
This script is a checker, not a benchmark: the JSON lines it prints are throughput figures.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from protocol import messages as m  # noqa: E402
from protocol.codec import canonical_encode, decode_canonical  # noqa: E402
from protocol.envelope import Envelope, open_envelope, seal, signed_bytes  # noqa: E402
from protocol.errors import CIDError, CodecError, SpecError  # noqa: E402
from protocol.identity import Identity  # noqa: E402
from protocol.jobspec import parse_spec  # noqa: E402
from protocol.unixfs import decode_node, import_bytes  # noqa: E402
from scripts.make_envelope_vectors import sample_capability, sample_terms  # noqa: E402

NOW = 1_790_000_000.0
ALICE = Identity(bytes([1]) * 32)
BOB = Identity(bytes([2]) * 32)
MALLORY = Identity(bytes([3]) * 32)  # signs the structural mutants: a peer with a valid key and bad bodies
CID_V1 = "bafkreifjjcie6lypi6ny7amxnfftagclbuxndqonfipmb64f2km2devei4"
VECTORS = REPO / "ipips" / "vectors"

FULL_CASES = 100_000
SHORT_CASES = 5_000
MAX_FINDINGS_SHOWN = 5

# How the cases are shared out: (target name, weight).
TARGETS = (
    ("envelope-bytes", 25),  # byte-level mutants of sealed envelopes, never re-signed: must not open
    ("envelope-resigned", 25),  # structural body/header mutants, re-signed: must validate or be refused
    ("body", 15),  # decode_body on mutated bodies directly (no envelope)
    ("canonical", 10),  # decode_canonical on mutated msgpack
    ("dag-pb", 12),  # decode_node on mutated dag-pb blocks
    ("jobspec", 10),  # parse_spec on mutated YAML
    ("random-bytes", 3),  # random bytes into every byte decoder
)


class Finding(Exception):
    """A decoder broke one of the rules in the module docstring."""

    def __init__(self, what: str, reproducer: bytes) -> None:
        super().__init__(what)
        self.reproducer = reproducer


# --- seeds -------------------------------------------------------------------------------------


def sample_messages() -> list[Any]:
    """One message of every registered type, with realistic field values."""
    terms = sample_terms(ALICE)
    job = terms.job_id()
    msgs = [
        m.JobAnnouncement.for_terms(terms),
        sample_capability(),
        m.ShardClaim(job, 1, 1),
        m.ShardLease(job, 1, 1, 1, BOB.peer_id, 1, NOW + 120, CID_V1),
        m.ShardRelease(job, 1, 1, 1, "dataset hash mismatch"),
        m.ShardRevoke(job, 1, 1, 1, BOB.peer_id, 1, 16.5),
        m.CheckpointCommit(job, 1, 1, 1, 10, 1, bytes(32), bytes([7]) * 32, 2.5, CID_V1),
        m.ShardReport(job, 1, 1, 1, CID_V1, CID_V1, bytes(32), 3, 30, 100, 1.25, {"val_loss": 1.5}),
        m.Verdict(job, 1, 1, 1, BOB.peer_id, 1, True, "replayed 2 segments exactly", (0, 2)),
        m.AggregatePublished(job, 1, 1, CID_V1, "exact", (0, 1), 200, False),
        m.EarlyStart(job, 2, 1, CID_V1, (1, 0), (BOB.peer_id, ALICE.peer_id)),
        m.JobCancel(job, "submitter cancelled"),
        m.Heartbeat(3, 1, (m.CoordinatorTerm(job, 1),)),
    ]
    assert {type(x).TYPE for x in msgs} == set(m.MESSAGE_TYPES), "a message type has no fuzz seed"
    return msgs


def dag_pb_seeds() -> list[bytes]:
    """Real dag-pb blocks (CIDv0 leaves and inner nodes) and the IPIP-0003 decode vectors."""
    blocks: list[bytes] = []
    for size, chunk in ((0, 256), (5, 256), (700, 256), (3000, 64)):
        data = bytes((i * 31 + 7) & 0xFF for i in range(size))
        _root, dag = import_bytes(data, cid_version=0, chunk_size=chunk)
        blocks.extend(block.data for block in dag[:4])
    vectors = json.loads((VECTORS / "unixfs-decode.json").read_text())
    blocks.extend(bytes.fromhex(case["hex"]) for case in vectors["reject"] + vectors["accept"])
    return blocks


def spec_seeds() -> list[str]:
    texts = []
    for name in ("jobspec-valid.json", "jobspec-invalid.json"):
        texts.extend(case["yaml"] for case in json.loads((VECTORS / name).read_text())["cases"])
    return texts


# --- mutators ----------------------------------------------------------------------------------

INTERESTING_INTS = (0, 1, -1, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32, 2**53, 2**53 + 1,
                    2**63 - 1, -(2**63), 2**64 - 1, 1000, 1001, 1024, 1025, 4096, 4097)
INTERESTING_STRS = ("", "x", "x" * 256, "x" * 257, "x" * 4097, "\x00", "é" * 200, "12D3KooW", CID_V1,
                    "Qm" + "1" * 44, "job", "heartbeat", "exact", "lora", "nan", "\ufffd")


def random_value(rng: random.Random, depth: int = 0) -> Any:
    """A random msgpack-encodable value, biased to boundaries and the schema's own kinds."""
    kind = rng.randrange(11 if depth < 4 else 8)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice(INTERESTING_INTS)
    if kind == 3:
        return rng.randint(-(2**63), 2**64 - 1)
    if kind == 4:
        return rng.choice((0.0, -0.0, 1.5, 1e308, -1e308, 5e-324, 1.0, rng.uniform(-1e6, 1e6)))
    if kind == 5:
        return rng.choice(INTERESTING_STRS)
    if kind == 6:
        return rng.randbytes(rng.choice((0, 1, 16, 31, 32, 33, 64, 257)))
    if kind == 7:
        return "".join(chr(rng.randrange(0x20, 0x2FF)) for _ in range(rng.randrange(12)))
    if kind == 8:
        return [random_value(rng, depth + 1) for _ in range(rng.choice((0, 1, 2, 3)))]
    if kind == 9:
        return [0] * rng.choice((1025, 4096))  # over every list limit of the schema
    return {rng.choice(("a", "job_id", "round", "shard", "x" * 300)): random_value(rng, depth + 1)
            for _ in range(rng.randrange(4))}


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a node of a decoded msgpack value (map keys and list indices)."""
    out = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            out.extend(_paths(item, prefix + (key,)))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            out.extend(_paths(item, prefix + (index,)))
    return out


def _get(value: Any, path: tuple) -> Any:
    for key in path:
        value = value[key]
    return value


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def _retype(rng: random.Random, value: Any) -> Any:
    """The same value in a neighbouring type: the confusions a strict decoder must refuse."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return rng.choice((float(value), value != 0, str(value), value + 1, value - 1, -value))
    if isinstance(value, float):
        return rng.choice((int(value) if abs(value) < 2**63 else 0, str(value), value * 2**60))
    if isinstance(value, str):
        return rng.choice((value.encode("utf-8"), value[:-1], value + "x", value * 2, value.upper()))
    if isinstance(value, bytes):
        return rng.choice((value.hex(), value[:-1], value + b"\0", list(value[:4])))
    if isinstance(value, list):
        return rng.choice(({str(i): v for i, v in enumerate(value)}, value * 2, value[1:], []))
    if isinstance(value, dict):
        return rng.choice((list(value.values()), {}))
    return random_value(rng)


def mutate_structure(rng: random.Random, value: Any) -> Any:
    """A copy of a decoded msgpack value with one to three structural mutations."""
    value = _copy(value)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        paths = _paths(value)
        path = rng.choice(paths)
        if not path:  # the root: wrap it or replace it
            value = rng.choice(([value], {"b": value}, random_value(rng)))
            continue
        parent, key = _get(value, path[:-1]), path[-1]
        op = rng.randrange(6)
        if op == 0 and isinstance(parent, dict):
            del parent[key]
        elif op == 1 and isinstance(parent, dict):
            parent[rng.choice(("extra", "v", "t", key + "_", "b"))] = random_value(rng)
        elif op == 2:
            parent[key] = _retype(rng, parent[key])
        elif op == 3:
            parent[key] = random_value(rng)
        elif op == 4:
            nested = parent[key]
            for _ in range(rng.choice((1, 8, 20))):
                nested = [nested]
            parent[key] = nested
        elif isinstance(parent, list) and parent:
            parent.insert(rng.randrange(len(parent) + 1), _copy(rng.choice(parent)))
        else:
            parent[key] = _retype(rng, parent[key])
    return value


def mutate_bytes(rng: random.Random, data: bytes, others: list[bytes]) -> bytes:
    """One to four byte-level mutations: flips, truncation, insertion, deletion, splices."""
    buf = bytearray(data)
    for _ in range(rng.choice((1, 1, 2, 4))):
        op = rng.randrange(8)
        pos = rng.randrange(len(buf) + 1)
        if op == 0 and buf:
            buf[min(pos, len(buf) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1 and buf:
            buf[min(pos, len(buf) - 1)] = rng.choice((0x00, 0x7F, 0x80, 0xC0, 0xC1, 0xC2, 0xC3, 0xCF, 0xD3,
                                                      0xD9, 0xDA, 0xDB, 0xDC, 0xDD, 0xDE, 0xDF, 0xFF))
        elif op == 2:
            del buf[pos:]
        elif op == 3:
            buf[pos:pos] = rng.randbytes(rng.choice((1, 2, 4, 9)))
        elif op == 4:
            del buf[pos:pos + rng.choice((1, 2, 8))]
        elif op == 5 and others:
            other = rng.choice(others)
            cut = rng.randrange(len(other) + 1)
            buf = buf[:pos] + bytearray(other[cut:])
        elif op == 6 and buf:
            start = rng.randrange(len(buf))
            chunk = buf[start:start + rng.choice((1, 4, 16))]
            buf[pos:pos] = chunk * rng.choice((1, 2, 50))
        else:
            buf += rng.randbytes(rng.choice((1, 3)))
    return bytes(buf)


YAML_TOKENS = (": ", ":", "- ", "-", "[", "]", "{", "}", ",", "&a ", "*a", "!!python/object:os.system ", "!!str ",
               "!!binary ", "\t", '"', "'", "%YAML 1.1\n", "---\n", "...\n", "null", "~", "1e309", "-.inf", ".nan",
               "0x1F", "0o17", "1_000", "<<: *a", "? ", "|\n  ", ">\n  ", "#", "\n", "\n  ", "  ", "\x00", "\x85",
               "\ufeff", "é", "9" * 400, "true", "no", "on", "2e-4", "1.0", "-1", "[" * 40, "{a: " * 30)
YAML_KEYS = ("name", "base_model", "shards", "rounds", "lease_seconds", "proof", "verify_segments", "training",
             "learning_rate", "lora", "rank", "target_modules", "input", "dataset", "budget", "aggregation")


def mutate_yaml(rng: random.Random, text: str, others: list[str]) -> str:
    """One to three mutations of a YAML text: tokens, characters, lines, keys, splices."""
    for _ in range(rng.choice((1, 1, 2, 3))):
        op = rng.randrange(7)
        pos = rng.randrange(len(text) + 1)
        if op == 0:
            text = text[:pos] + rng.choice(YAML_TOKENS) + text[pos:]
        elif op == 1 and text:
            text = text[:pos] + chr(rng.choice((rng.randrange(0x20, 0x7F), rng.randrange(0x110000)))) + text[pos + 1:]
        elif op == 2:
            text = text[:pos]
        elif op == 3:
            lines = text.split("\n")
            i = rng.randrange(len(lines))
            choice = rng.randrange(3)
            if choice == 0:
                del lines[i]
            elif choice == 1:
                lines.insert(i, lines[i])
            else:
                lines[i] = " " * rng.choice((1, 2, 4)) + lines[i]
            text = "\n".join(lines)
        elif op == 4:
            line = f"{rng.choice(YAML_KEYS)}: {rng.choice(YAML_TOKENS + ('1', 'x', '[a, b]', '{}'))}\n"
            text = text[:pos] + line + text[pos:] if rng.random() < 0.3 else text + line
        elif op == 5 and others:
            other = rng.choice(others)
            text = text[:pos] + other[rng.randrange(len(other) + 1):]
        else:
            text = text * rng.choice((2, 3))
    return text


# --- targets -----------------------------------------------------------------------------------


def resign(raw: dict, identity: Identity) -> bytes:
    """Envelope bytes for a (possibly mutated) header and body, signed with ``identity``'s key."""
    t = raw["t"]
    body = raw["b"]
    ts, nonce = raw["ts"], raw["n"]
    sig = identity.sign(signed_bytes(raw["v"], t, identity.public_key, ts, nonce, body))
    return Envelope(raw["v"], t, identity.public_key, ts, nonce, body, sig).to_bytes()


def check_opened(opened: Any, data: bytes) -> None:
    """A message that opened must re-encode to exactly the body that was signed."""
    if canonical_encode(opened.message.to_wire()) != canonical_encode(opened.envelope.body):
        raise Finding("opened message does not re-encode to its signed body", data)


class Fuzzer:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.envelopes = [seal(BOB, msg, now=NOW, nonce=bytes([i]) * 16) for i, msg in enumerate(sample_messages())]
        self.sealed = frozenset(self.envelopes)
        self.raw_envelopes = [decode_canonical(e) for e in self.envelopes]
        self.bodies = [(raw["t"], raw["b"]) for raw in self.raw_envelopes]
        self.msgpack_seeds = self.envelopes + [canonical_encode(b) for _, b in self.bodies]
        self.dag_pb = dag_pb_seeds()
        self.specs = spec_seeds()
        self.counts: Counter = Counter()  # (target, outcome) -> cases
        self.reasons: Counter = Counter()  # (target, CodecError reason) -> cases: how deep mutants get
        self.last = b""  # the input of the current case, printed as the reproducer of a crash

    # Each case returns its outcome ("accepted" / "rejected") or raises Finding.

    def envelope_bytes(self) -> str:
        original = self.rng.choice(self.envelopes)
        data = self.last = mutate_bytes(self.rng, original, self.envelopes)
        if data in self.sealed:  # a splice can rebuild a seed envelope whole: that one is genuine
            return "unchanged"
        try:
            open_envelope(data, now=NOW)
        except CodecError as exc:
            self.reasons[("envelope-bytes", exc.reason)] += 1
            return "rejected"
        raise Finding("an envelope changed without re-signing opened (forgery accepted)", data)

    def envelope_resigned(self) -> str:
        raw = _copy(self.rng.choice(self.raw_envelopes))
        what = self.rng.randrange(10)
        if what < 7:
            raw["b"] = mutate_structure(self.rng, raw["b"])
        elif what == 7:
            raw["t"] = self.rng.choice(list(m.MESSAGE_TYPES) + ["", "x" * 33, "unknown"])
        elif what == 8:
            raw["ts"] = self.rng.choice((0, int(NOW * 1000) + 31_000, int(NOW * 1000) - 301_000, 2**64 - 1))
        else:
            raw["n"] = self.rng.randbytes(self.rng.choice((0, 15, 16, 17)))
        try:
            data = self.last = resign(raw, MALLORY)
        except CodecError:
            return "unencodable"  # e.g. a retyped header field that no signer could frame
        except (TypeError, AttributeError):
            return "unencodable"  # a header field of the wrong type for signed_bytes (t not a str)
        try:
            opened = open_envelope(data, now=NOW)
        except CodecError as exc:
            self.reasons[("envelope-resigned", exc.reason)] += 1
            return "rejected"
        check_opened(opened, data)
        return "accepted"

    def body(self) -> str:
        type_tag, body = self.rng.choice(self.bodies)
        if self.rng.random() < 0.1:
            type_tag = self.rng.choice(list(m.MESSAGE_TYPES))  # another type's body
        mutated = mutate_structure(self.rng, body)
        try:
            encoded = self.last = canonical_encode(mutated)
        except CodecError:
            return "unencodable"
        try:
            decoded = decode_canonical(encoded)
            msg = m.decode_body(type_tag, decoded)
        except CodecError:
            return "rejected"
        if canonical_encode(msg.to_wire()) != encoded:
            raise Finding(f"{type_tag} body decodes to a message that re-encodes differently", encoded)
        return "accepted"

    def canonical(self) -> str:
        data = mutate_bytes(self.rng, self.rng.choice(self.msgpack_seeds), self.msgpack_seeds)
        return self._decode_canonical(data)

    def _decode_canonical(self, data: bytes) -> str:
        self.last = data
        try:
            value = decode_canonical(data)
        except CodecError:
            return "rejected"
        if canonical_encode(value) != data:
            raise Finding("decode_canonical accepted a non-canonical encoding", data)
        return "accepted"

    def dag_pb_node(self) -> str:
        return self._decode_node(mutate_bytes(self.rng, self.rng.choice(self.dag_pb), self.dag_pb))

    def _decode_node(self, data: bytes) -> str:
        self.last = data
        try:
            decode_node(data)
        except CIDError:
            return "rejected"
        return "accepted"

    def jobspec(self) -> str:
        text = mutate_yaml(self.rng, self.rng.choice(self.specs), self.specs)
        self.last = text.encode("utf-8", "surrogatepass")
        try:
            parse_spec(text, "infernet.train.yml")
        except SpecError as exc:
            if "\n" in str(exc):
                raise Finding(f"SpecError message is not one line: {str(exc)[:200]!r}",
                              text.encode("utf-8", "surrogatepass")) from None
            return "rejected"
        return "accepted"

    def random_bytes(self) -> str:
        data = self.rng.randbytes(self.rng.choice((0, 1, 2, 8, 33, 100, 300)))
        outcomes = [self._decode_canonical(data), self._decode_node(data)]
        self.last = data
        try:
            open_envelope(data, now=NOW)
            raise Finding("random bytes opened as an envelope", data)
        except CodecError:
            pass
        return "accepted" if "accepted" in outcomes else "rejected"

    def case(self, target: str) -> str:
        return {
            "envelope-bytes": self.envelope_bytes,
            "envelope-resigned": self.envelope_resigned,
            "body": self.body,
            "canonical": self.canonical,
            "dag-pb": self.dag_pb_node,
            "jobspec": self.jobspec,
            "random-bytes": self.random_bytes,
        }[target]()


def run(cases: int, seed: int, out: Callable[[str], None] = print) -> int:
    """Run ``cases`` cases; print counts, throughput and any findings; return the number of findings."""
    fuzzer = Fuzzer(seed)
    names = [name for name, _ in TARGETS]
    weights = [weight for _, weight in TARGETS]
    findings: list[tuple[int, str, str, bytes, str]] = []
    per_target_time: Counter = Counter()
    started = time.perf_counter()
    for number in range(cases):
        target = fuzzer.rng.choices(names, weights)[0]
        t0 = time.perf_counter()
        try:
            outcome = fuzzer.case(target)
        except Finding as finding:
            outcome = "FINDING"
            findings.append((number, target, str(finding), finding.reproducer, ""))
        except Exception as exc:  # noqa: BLE001 - exactly what the fuzzer looks for
            outcome = "FINDING"
            findings.append((number, target, f"{type(exc).__name__}: {exc}"[:300], fuzzer.last,
                             traceback.format_exc(limit=6)))
        per_target_time[target] += time.perf_counter() - t0
        fuzzer.counts[(target, outcome)] += 1
    elapsed = time.perf_counter() - started

    out(f"fuzz_decoders: {cases} cases, seed {seed}, {elapsed:.1f} s ({cases / elapsed:,.0f} cases/s)")
    out(f"{'target':<20}{'cases':>8}{'accepted':>10}{'rejected':>10}{'other':>8}{'findings':>10}{'cases/s':>10}")
    for name in names:
        total = sum(n for (t, _), n in fuzzer.counts.items() if t == name)
        acc, rej, bad = (fuzzer.counts[(name, o)] for o in ("accepted", "rejected", "FINDING"))
        rate = total / per_target_time[name] if per_target_time[name] else 0.0
        out(f"{name:<20}{total:>8}{acc:>10}{rej:>10}{total - acc - rej - bad:>8}{bad:>10}{rate:>10,.0f}")
    for name in ("envelope-bytes", "envelope-resigned"):
        reasons = sorted(((n, r) for (t, r), n in fuzzer.reasons.items() if t == name), reverse=True)
        out(f"{name} rejected by: " + ", ".join(f"{r} {n}" for n, r in reasons))
    for number, target, what, reproducer, trace in findings[:MAX_FINDINGS_SHOWN]:
        out(f"FINDING case {number} ({target}): {what}")
        out(f"  reproducer (hex): {reproducer.hex() if reproducer else '(see the seed and case number)'}")
        if trace:
            out("  " + trace.strip().replace("\n", "\n  "))
    if len(findings) > MAX_FINDINGS_SHOWN:
        out(f"... and {len(findings) - MAX_FINDINGS_SHOWN} more findings")
    out(json.dumps({"bench": "fuzz_cases_per_s", "value": round(cases / elapsed), "unit": "cases/s",
                    "reference": None, "ratio": None, "goal": None}))
    out(json.dumps({"bench": "fuzz_findings", "value": len(findings), "unit": "findings",
                    "reference": None, "ratio": None, "goal": 0}))
    return len(findings)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=None, help=f"number of cases (default {FULL_CASES})")
    parser.add_argument("--short", action="store_true", help=f"{SHORT_CASES} cases, for CI")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    cases = args.cases if args.cases is not None else (SHORT_CASES if args.short else FULL_CASES)
    return 1 if run(cases, args.seed) else 0


if __name__ == "__main__":
    sys.exit(main())
