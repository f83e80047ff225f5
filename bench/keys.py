"""What computing chunk keys costs: SHA-256 (the default) against xxh3, on real prompts.

    python -m bench.keys --quick     # keys for 2k / 8k / 32k tokens; a cold 2k prefill (< 1 min)
    python -m bench.keys             # also a cold 8k prefill, more samples

Per prompt length and hash, the time the connector spends on a request's keys:
``PrefixKeys`` over the prompt, then the key of every 16-token block boundary
and of the prompt's exact end (``lookup_ends``) — exactly what one lookup
hashes. The best of many runs (the host may be busy: the fastest run is the
cost without interference), each on a fresh ``PrefixKeys``.

Prompts are real text — the demo document and this repository's docs,
concatenated until long enough — tokenized by SmolLM2's tokenizer (random
token ids, said so in the output, when the model file is absent: the cost
does not depend on which ids they are).

``share of cold prefill``: key time over the time SmolLM2-135M takes to
prefill the same prompt on this machine, cold (an engine with no cache, one
generated token; the prompt is one token shorter, to leave that token room). 32k tokens is beyond SmolLM2's context (8,192): the
prefill, and so the share, is only measured up to 8k; prefill grows at least
linearly with length and keys exactly linearly, so the share at 32k is no
larger than at 8k.

``hash candidates``: the operation a key costs inside ``PrefixKeys`` — feed
one 16-token block (64 bytes) to a chunk's running hash, copy it, take the
digest — for SHA-256, BLAKE2b (16-byte digest) and xxh3_128, best of many
rounds of 2,000 (the hashes take turns), and each one's throughput on a
16 MiB buffer (the weights fingerprint's case). This is what picked SHA-256
over BLAKE2b.

``weights fingerprint``: what naming the model's namespace costs — SHA-256
over every byte of the model file's tensors (``engine/models/fingerprint.py``),
with an empty cache, then again answered by the cache.

Two tables, then one JSON line last.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash

from kvtier.bench.lib.common import emit, load_average, machine, table, tune_allocator
from kvtier.connectors.demo import default_model_path, document
from kvtier.keys import CacheNamespace, KeyHash, PrefixKeys

LENGTHS = (2048, 8192, 32768)
BLOCK_TOKENS = 16
REPO = Path(__file__).resolve().parent.parent


def namespace(key_hash: KeyHash) -> CacheNamespace:
    """SmolLM2-135M's KV layout (the fingerprint's value does not change the cost)."""
    return CacheNamespace(
        "SmolLM2-135M-Instruct", "0" * 64, 30, 3, 64, "bfloat16", 256, key_hash=key_hash
    )


def real_text() -> str:
    """The demo document, then every doc of the repository: a few tens of thousands of tokens."""
    parts = [document()]
    parts += [p.read_text() for p in sorted((REPO / "docs").glob("*.md"))]
    parts.append((REPO / "README.md").read_text())
    return "\n\n".join(parts)


def prompts(encode: object | None, longest: int) -> tuple[list[int], str]:
    """``longest`` tokens of real text (repeated if the text is shorter), and where they came from."""
    if encode is None:
        import random

        rng = random.Random(0)
        return [rng.randrange(49152) for _ in range(longest)], "random ids (no model file)"
    ids: list[int] = encode(real_text())  # type: ignore[operator]
    tokens = list(ids)
    while len(tokens) < longest:
        tokens += ids
    return tokens[:longest], f"real text ({len(ids)} tokens, repeated to length)"


def key_seconds(tokens: list[int], repeat: int) -> dict[KeyHash, float]:
    """Best-of-``repeat`` seconds to compute one request's lookup keys for ``tokens``, per hash.

    The hashes take turns within each round, so a busy spell of the host hits them alike.
    """
    best = dict.fromkeys(KeyHash, float("inf"))
    for _ in range(repeat):
        for key_hash in KeyHash:
            start = time.perf_counter()
            keys = PrefixKeys(namespace(key_hash), BLOCK_TOKENS)
            keys.extend(tokens)
            got = keys.keys_at(keys.lookup_ends(len(tokens)))
            best[key_hash] = min(best[key_hash], time.perf_counter() - start)
            assert len(got) == len(tokens) // BLOCK_TOKENS + (len(tokens) % BLOCK_TOKENS > 0)
    return best


CANDIDATES: dict[str, Callable[[bytes], Any]] = {
    "sha256": hashlib.sha256,
    "blake2b-128": lambda seed: hashlib.blake2b(seed, digest_size=16),
    "xxh3_128": xxhash.xxh3_128,
}


def candidate_ns(repeat: int, ops: int = 2_000) -> dict[str, float]:
    """Best-of-``repeat`` nanoseconds per block key (update 64 bytes, copy, digest), per hash;
    the hashes take turns within each round."""
    block = bytes(range(64))
    best = dict.fromkeys(CANDIDATES, float("inf"))
    for _ in range(repeat):
        for name, make in CANDIDATES.items():
            running = make(bytes(16))
            start = time.perf_counter()
            for _ in range(ops):
                running.update(block)
                running.copy().digest()
            best[name] = min(best[name], (time.perf_counter() - start) / ops)
    return {name: s * 1e9 for name, s in best.items()}


def candidate_gbps(repeat: int, nbytes: int = 16 << 20) -> dict[str, float]:
    """Best-of-``repeat`` GB/s hashing one ``nbytes`` buffer (what the weights fingerprint
    does per tensor), per hash; the hashes take turns within each round."""
    data = bytes(nbytes)
    best = dict.fromkeys(CANDIDATES, float("inf"))
    for _ in range(repeat):
        for name, make in CANDIDATES.items():
            start = time.perf_counter()
            make(data).digest()
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: nbytes / s / 1e9 for name, s in best.items()}


def fingerprint_cost(model: str) -> dict[str, float]:
    """Seconds to fingerprint ``model`` with an empty cache and from the cache, and MB hashed."""
    import os
    import tempfile

    from kvtier.engine.models.gguf_loader import GGUFFile
    from kvtier.engine.models.hf_loader import HFModelDir

    def source() -> GGUFFile | HFModelDir:
        return HFModelDir(model) if Path(model).is_dir() else GGUFFile(model)

    home = os.environ.get("HOME")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["HOME"] = tmp  # the fingerprint cache lives under $HOME: an empty one
        try:
            cold = source()
            start = time.perf_counter()
            cold.fingerprint()
            cold_s = time.perf_counter() - start
            warm = source()
            start = time.perf_counter()
            warm.fingerprint()
            warm_s = time.perf_counter() - start
        finally:
            if home is None:
                del os.environ["HOME"]
            else:
                os.environ["HOME"] = home
    info = cold.fingerprint_info
    assert info is not None and warm.fingerprint_info is not None
    assert warm.fingerprint_info.cached
    return {
        "mb": info.nbytes / 1e6,
        "hash_s": info.hash_seconds,
        "cold_s": cold_s,
        "cached_s": warm_s,
    }


def prefill_seconds(llm: object, tokens: list[int], repeat: int) -> float:
    """Median seconds of a cold prefill of ``tokens`` (no cache: G1 off, no connector)."""
    from kvtier.engine import SamplingParams

    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        llm.generate([tokens], first)  # type: ignore[attr-defined]
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples, prefill at 2k only")
    parser.add_argument("--model", default=str(default_model_path()), help="GGUF or HF directory")
    parser.add_argument("--threads", type=int, default=None, help="engine threads (default: auto)")
    args = parser.parse_args()
    tune_allocator()
    repeat = 20 if args.quick else 100
    prefill_lengths = (2048,) if args.quick else (2048, 8192)

    llm = None
    if Path(args.model).exists():
        from kvtier.engine import LLM

        llm = LLM(args.model, enable_prefix_caching=False, num_threads=args.threads)
        encode = llm.engine.tokenizer.encode
    else:
        encode = None
    tokens, source = prompts(encode, max(LENGTHS))

    prefill: dict[int, float] = {}
    if llm is not None:
        prefill_seconds(llm, tokens[-256:], 1)  # warm-up: first-call set-up not timed
        for n in prefill_lengths:
            # n - 1 tokens: SmolLM2's 8,192 positions must leave one for the generated token
            prefill[n] = prefill_seconds(llm, tokens[: n - 1], 1 if args.quick or n > 4096 else 2)

    rows, results = [], []
    for n in LENGTHS:
        timed = key_seconds(tokens[:n], repeat)
        for key_hash in KeyHash:
            s = timed[key_hash]
            share = s / prefill[n] if n in prefill else None
            rows.append(
                [
                    n,
                    key_hash.value,
                    s * 1e3,
                    n / s / 1e6,
                    f"{prefill[n]:.2f}" if n in prefill else "-",
                    f"{share * 100:.3f}%" if share is not None else "-",
                ]
            )
            results.append(
                {
                    "tokens": n,
                    "hash": key_hash.value,
                    "key_ms": round(s * 1e3, 4),
                    "mtokens_per_s": round(n / s / 1e6, 3),
                    "prefill_s": round(prefill[n], 4) if n in prefill else None,
                    "share_of_prefill": round(share, 6) if share is not None else None,
                }
            )
    print(f"prompts: {source}; keys every {BLOCK_TOKENS} tokens + the prompt's end")
    print(
        table(
            ["tokens", "hash", "keys ms", "M tok/s", "cold prefill s", "share of prefill"],
            rows,
        )
    )
    candidates = candidate_ns(repeat * 5)
    throughput = candidate_gbps(5 if args.quick else 15)
    print()
    print(
        table(
            ["hash", "ns per block key", "x xxh3_128", "GB/s, 16 MiB"],
            [[n, ns, ns / candidates["xxh3_128"], throughput[n]] for n, ns in candidates.items()],
        )
    )
    fingerprint = fingerprint_cost(args.model) if llm is not None else None
    if fingerprint is not None:
        print(
            f"\nweights fingerprint of {Path(args.model).name}: {fingerprint['mb']:.1f} MB hashed "
            f"in {fingerprint['hash_s']:.3f} s ({fingerprint['mb'] / 1e3 / fingerprint['hash_s']:.2f} "
            f"GB/s; {fingerprint['cold_s']:.3f} s in all), from the cache "
            f"{fingerprint['cached_s'] * 1e3:.2f} ms"
        )
    by = {(r["tokens"], r["hash"]): r for r in results}
    slow = {n: by[(n, "sha256")]["key_ms"] / by[(n, "xxh3")]["key_ms"] for n in LENGTHS}
    print("sha256 / xxh3 key time: " + ", ".join(f"{n}: {x:.1f}x" for n, x in slow.items()))
    emit(
        {
            "bench": "keys",
            "quick": args.quick,
            "prompts": source,
            "results": results,
            "sha256_over_xxh3": {str(n): round(x, 2) for n, x in slow.items()},
            "hash_candidates_ns_per_block_key": {n: round(v, 1) for n, v in candidates.items()},
            "hash_candidates_gbps_16mib": {n: round(v, 3) for n, v in throughput.items()},
            "weights_fingerprint": fingerprint,
            "machine": machine(),
            "load_average": load_average(),
        }
    )


if __name__ == "__main__":
    main()
