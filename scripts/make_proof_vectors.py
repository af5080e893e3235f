"""Generate ipips/vectors/proof-*.json with an encoder written independently of protocol/proof.py,
then check protocol/proof.py agrees."""
import hashlib, json, math, struct
from fractions import Fraction

def sha(b): return hashlib.sha256(b).digest()

def indep_tensor_set(recs):
    out = b"infernet/proof/tensor-set/v1\x00" + len(recs).to_bytes(8, "little")
    for r in sorted(recs, key=lambda r: r["name"].encode()):
        n = r["name"].encode(); d = r["dtype"].encode()
        out += len(n).to_bytes(4,"little") + n + len(d).to_bytes(4,"little") + d + len(r["shape"]).to_bytes(4,"little")
        out += b"".join(x.to_bytes(8,"little") for x in r["shape"])
        data = bytes.fromhex(r["data"])
        out += len(data).to_bytes(8,"little") + data
    return sha(out).hex()

def f32(*xs): return struct.pack("<%df" % len(xs), *xs).hex()

tensor_cases = [
    {"description": "empty set (optimizer state before step 1)", "records": []},
    {"description": "one F32 matrix", "records": [{"name": "layer.lora_A.weight", "dtype": "F32", "shape": [2, 3], "data": f32(1, 2, 3, 4, 5, 6)}]},
    {"description": "two tensors given out of order; hash sorts by name",
     "records": [{"name": "b.lora_B.weight", "dtype": "F32", "shape": [3, 1], "data": f32(0.5, -0.25, 0)},
                 {"name": "a.lora_A.weight", "dtype": "F32", "shape": [1, 2], "data": f32(1, -1)}]},
    {"description": "same two tensors in sorted order: same hash",
     "records": [{"name": "a.lora_A.weight", "dtype": "F32", "shape": [1, 2], "data": f32(1, -1)},
                 {"name": "b.lora_B.weight", "dtype": "F32", "shape": [3, 1], "data": f32(0.5, -0.25, 0)}]},
    {"description": "scalar F32 (AdamW step) and a BF16 vector", "records": [
        {"name": "x.step", "dtype": "F32", "shape": [], "data": f32(10)},
        {"name": "y", "dtype": "BF16", "shape": [2], "data": "803f0040"}]},
    {"description": "same bytes, other dtype: different hash", "records": [
        {"name": "x.step", "dtype": "I32", "shape": [], "data": f32(10)},
        {"name": "y", "dtype": "BF16", "shape": [2], "data": "803f0040"}]},
    {"description": "same bytes, other shape: different hash", "records": [{"name": "layer.lora_A.weight", "dtype": "F32", "shape": [3, 2], "data": f32(1, 2, 3, 4, 5, 6)}]},
    {"description": "non-ASCII name (UTF-8 bytes)", "records": [{"name": "é.w", "dtype": "U8", "shape": [0], "data": ""}]},
]
for c in tensor_cases: c["hash"] = indep_tensor_set(c["records"])
tensor_errors = [
    {"description": "byte count does not fit shape and dtype", "records": [{"name": "w", "dtype": "F32", "shape": [2], "data": f32(1)}], "error": "needs 8"},
    {"description": "unknown dtype", "records": [{"name": "w", "dtype": "F31", "shape": [1], "data": f32(1)}], "error": "unknown dtype"},
    {"description": "duplicate name", "records": [{"name": "w", "dtype": "F32", "shape": [1], "data": f32(1)}, {"name": "w", "dtype": "F32", "shape": [1], "data": f32(2)}], "error": "appears twice"},
    {"description": "empty name", "records": [{"name": "", "dtype": "F32", "shape": [1], "data": f32(1)}], "error": "empty"},
]

def indep_batches(steps):
    out = b"infernet/proof/batches/v1\x00" + len(steps).to_bytes(8, "little")
    for s in steps:
        out += len(s).to_bytes(8, "little") + b"".join(i.to_bytes(8, "little") for i in s)
    return sha(out).hex()
batch_cases = [{"steps": s} for s in ([], [[]], [[0, 1, 2, 3]], [[3, 1], [0, 2]], [[1, 3], [0, 2]], [[7], [7], [7]])]
for c in batch_cases: c["digest"] = indep_batches(c["steps"])

header = {"job_id": sha(b"job").hex(), "round": 1, "shard": 3, "attempt": 0, "worker": "12D3KooWExampleWorker",
          "base_model_sha256": sha(b"base").hex(), "seed": 1234, "checkpoint_every": 10,
          "initial_adapter_hash": indep_tensor_set(tensor_cases[1]["records"]),
          "environment": {"torch": "2.13.0+cpu", "peft": "0.21.2", "transformers": "5.23.0", "device": "cpu",
                          "dtype": "float32", "threads": 2, "cpu_capability": "AVX2", "mkl_cbwr": "AVX2,STRICT",
                          "aten_cpu_capability": "avx2", "backend": "peft"}}
canon = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
genesis = sha(b"infernet/proof/genesis/v1\x00" + canon.encode()).hex()
links = []
for i, (step, loss) in enumerate([(10, 2.5), (20, 1.875), (25, 1.0e-3)]):
    links.append({"step": step, "adapter_hash": sha(b"adapter%d" % i).hex(), "optimizer_hash": sha(b"opt%d" % i).hex(),
                  "batches_digest": indep_batches([[i, i + 1]]), "loss": loss})
heads = []
head = bytes.fromhex(genesis)
for l in links:
    head = sha(b"infernet/proof/link/v1\x00" + head + l["step"].to_bytes(8, "little") + bytes.fromhex(l["adapter_hash"])
               + bytes.fromhex(l["optimizer_hash"]) + bytes.fromhex(l["batches_digest"]) + struct.pack("<d", l["loss"]))
    heads.append(head.hex())
chain = {"header": header, "canonical_header_json": canon, "genesis": genesis, "links": links, "heads": heads,
         "bad_chains": [
             {"description": "steps off the checkpoint grid", "steps": [10, 15, 25], "error": "off the checkpoint grid"},
             {"description": "a checkpoint skipped", "steps": [10, 30], "error": "skips a checkpoint"},
             {"description": "steps not rising", "steps": [10, 10], "error": "does not follow"}]}

def indep_select(seed, n, k):
    pool = list(range(n)); ctr = 0
    for j in range(min(k, n)):
        m = n - j; limit = 2**64 - 2**64 % m
        while True:
            x = int.from_bytes(sha(seed + ctr.to_bytes(8, "little"))[:8], "little"); ctr += 1
            if x < limit: break
        r = j + x % m
        pool[j], pool[r] = pool[r], pool[j]
    return sorted(pool[:min(k, n)])
segs = []
for head_hex, nonce, n, k in [(heads[-1], b"", 3, 1), (heads[-1], b"verdict-nonce-1", 3, 2), (sha(b"x").hex(), b"round-beacon-7", 50, 5),
                              (sha(b"x").hex(), b"round-beacon-8", 50, 5), (sha(b"y").hex(), b"n", 10, 10), (sha(b"y").hex(), b"n", 4, 9), (sha(b"z").hex(), b"n", 0, 3)]:
    seed = sha(b"infernet/proof/segments/v1\x00" + bytes.fromhex(head_hex) + len(nonce).to_bytes(4, "little") + nonce)
    segs.append({"final_head": head_hex, "nonce": nonce.hex(), "seed": seed.hex(), "n_segments": n, "k": k, "indices": indep_select(seed, n, k)})

def catch(n, k, m): return 1 - math.comb(n - m, min(k, n)) / math.comb(n, min(k, n))
table = []
for n in (10, 50, 100):
    for f in (0.01, 0.05, 0.1, 0.2, 0.5):
        m = math.ceil(Fraction(repr(f)) * n)
        for k in (1, 2, 5, 10):
            table.append({"n": n, "f": f, "m": m, "k": k, "p": catch(n, k, m)})
select = {"selections": segs, "catch_probability": table}

root = "/work/main/ipips/vectors/"
json.dump({"description": "protocol.proof.tensor_set_hash: records (data as hex of the raw little-endian bytes) -> hash", "cases": tensor_cases, "errors": tensor_errors, "batches_digest": batch_cases}, open(root + "proof-tensors.json", "w"), indent=1, ensure_ascii=False)
json.dump({"description": "protocol.proof chain: header -> genesis, links -> heads after each link", **chain}, open(root + "proof-chain.json", "w"), indent=1)
json.dump({"description": "protocol.proof segment selection seed -> indices, and catch probabilities 1 - C(n-m,k)/C(n,k) with m = ceil(f n)", **select}, open(root + "proof-segments.json", "w"), indent=1)

# cross-check with the module
import sys; sys.path.insert(0, "/work/main")
from protocol import proof as P
for c in tensor_cases:
    assert P.tensor_set_hash([P.TensorRecord(r["name"], r["dtype"], tuple(r["shape"]), bytes.fromhex(r["data"])) for r in c["records"]]).hex() == c["hash"], c
for c in batch_cases: assert P.batches_digest(c["steps"]).hex() == c["digest"]
h = P.CommitmentHeader.from_json(header); assert h.genesis().hex() == genesis
assert [x.hex() for x in P.chain_heads(h.genesis(), [P.ChainLink.from_json(l) for l in links])] == heads
for s in segs:
    assert P.segment_selection_seed(bytes.fromhex(s["final_head"]), bytes.fromhex(s["nonce"])).hex() == s["seed"]
    assert list(P.select_segments(bytes.fromhex(s["seed"]), s["n_segments"], s["k"])) == s["indices"], s
for t in table: assert P.faked_segments(t["n"], t["f"]) == t["m"] and abs(P.catch_probability(t["n"], t["k"], t["m"]) - t["p"]) < 1e-15
print("ok", [s["indices"] for s in segs])
