"""Time to first token: cold, G1 hit, and loaded from kvtier (in-process and across processes).

    python bench/ttft.py --quick          # 2,048 tokens (under two minutes on an idle 2-core CPU)
    python bench/ttft.py                  # 1,024 / 2,048 / 4,096 tokens

Per prompt length, on SmolLM2-135M (or --model):

* ``cold``          a fresh prompt, nothing cached anywhere;
* ``g1``            the same prompt again in the same engine (its own prefix cache);
* ``kvtier cpu``    an engine whose G1 cache is off, so every cached token comes from
                    kvtier's in-process CPU tier (raw and int8 encodings);
* ``kvtier disk``   a new engine *process* loading from the disk tier the first
                    engine wrote (raw and int8) — what a second replica sees.

Also: load bandwidth (bytes of KV placed in the paged cache per second of load
time) against a memcpy of as many bytes; the cost of saving at a 0% hit rate
(prefill throughput with the connector saving vs. without, alternating runs
on distinct prompts); and the fidelity of int8 (mean relative error of
dequantized KV, top-1 agreement of greedy next tokens against the cold run).
A table, then one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import emit, machine, memcpy_gbps, table

from kvtier.config import KvtierConfig
from kvtier.connectors.demo import default_model_path, document
from kvtier.connectors.fidelity import kv_relative_error, top1_agreement
from kvtier.connectors.kvtier_connector import KvtierConnector
from kvtier.engine import LLM, SamplingParams

FIRST = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def make_config(root: Path, encoding: str) -> KvtierConfig:
    return KvtierConfig.model_validate(
        {
            "chunk_size": 256,
            "block": {"encoding": encoding},
            "tiers": [
                {"type": "cpu", "capacity": "2GiB"},
                {"type": "disk", "path": str(root / f"blocks-{encoding}"), "capacity": "8GiB"},
            ],
            "connector": {"min_load_tokens": 256, "load_timeout_s": 30},
        }
    )


class Prompts:
    """Token prompts cut from the demo document; each salt gives a distinct prefix."""

    def __init__(self, llm: LLM) -> None:
        self.doc = llm.engine.tokenizer.encode(document())

    def make(self, n: int, salt: int) -> list[int]:
        body: list[int] = []
        while len(body) < n:
            body += self.doc
        return [1000 + salt % 20000, 2000 + salt // 20000, *body[: n - 2]]


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, Any]:
    out = llm.generate([prompt], FIRST)[0]
    return out.ttft_s, out


def load_stats(conn: KvtierConnector) -> tuple[int, float]:
    return conn.stats.bytes_loaded, conn.stats.load_seconds


def cross_process(
    model: str, root: Path, sizes: list[int], salts: dict[int, int]
) -> dict[str, Any]:
    """Run the fresh-process measurement in a child (this script with --child)."""
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--model",
        model,
        "--root",
        str(root),
        "--sizes",
        ",".join(map(str, sizes)),
    ]
    cmd += ["--salts", json.dumps(salts)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def child(model: str, root: Path, sizes: list[int], salts: dict[str, int]) -> None:
    out: dict[str, Any] = {}
    for encoding in ("raw", "int8"):
        conn = KvtierConnector(config=make_config(root, encoding))
        llm = LLM(model, connector=conn)
        prompts = Prompts(llm)
        ttft(llm, prompts.make(64, salt=999_999))  # warm-up, nothing to load
        for n in sizes:
            before = load_stats(conn)
            t, o = ttft(llm, prompts.make(n, salts[str(n)]))
            after = load_stats(conn)
            out[f"{encoding}:{n}"] = {
                "ttft_s": t,
                "loaded_tokens": o.num_external_tokens,
                "bytes": after[0] - before[0],
                "load_s": after[1] - before[1],
            }
        llm.engine.shutdown()
    print(json.dumps(out))


def save_overhead(
    plain: LLM, saving: LLM, prompts: Prompts, n: int, rounds: int
) -> dict[str, float]:
    """Prefill throughput with and without saving, alternating, each on a fresh prompt (0% hits)."""
    t_plain = t_save = 0.0
    for r in range(rounds):
        t_plain += ttft(plain, prompts.make(n, salt=500_000 + 2 * r))[0]
        t_save += ttft(saving, prompts.make(n, salt=500_001 + 2 * r))[0]
    tp_plain = rounds * n / t_plain
    tp_save = rounds * n / t_save
    return {
        "tokens": n,
        "rounds": rounds,
        "tok_s_plain": tp_plain,
        "tok_s_saving": tp_save,
        "overhead": 1 - tp_save / tp_plain,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", default=None)
    ap.add_argument("--sizes", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--root", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--salts", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args()
    model = args.model or str(default_model_path())
    sizes = [
        int(s) for s in (args.sizes or ("2048" if args.quick else "1024,2048,4096")).split(",")
    ]
    if args.child:
        child(model, Path(args.root), sizes, json.loads(args.salts))
        return
    if not Path(model).exists():
        raise SystemExit(f"{model} not found: run `kvtier model fetch smollm2` first")

    rows: list[list[Any]] = []
    results: dict[str, Any] = {"sizes": {}}
    with tempfile.TemporaryDirectory(prefix="kvtier-ttft-") as tmp:
        root = Path(tmp)
        plain = LLM(model)
        conns = {e: KvtierConnector(config=make_config(root, e)) for e in ("raw", "int8")}
        # G1 off: every prompt token is either loaded from kvtier or computed.
        engines = {
            e: LLM(model, connector=c, enable_prefix_caching=False) for e, c in conns.items()
        }
        prompts = Prompts(plain)
        for llm in (plain, *engines.values()):
            ttft(llm, prompts.make(64, salt=999_998))  # warm-up
        salts = {}
        for n in sizes:
            salt = n
            salts[n] = salt
            p = prompts.make(n, salt)
            cold, _ = ttft(plain, p)
            g1, g1_out = ttft(plain, p)
            r: dict[str, Any] = {
                "cold_s": cold,
                "g1_s": g1,
                "g1_cached_tokens": g1_out.num_cached_tokens,
            }
            for enc, llm in engines.items():
                ttft(llm, p)  # cold, saves
                conns[enc].flush()
                before = load_stats(conns[enc])
                t, o = ttft(llm, p)
                after = load_stats(conns[enc])
                nbytes, load_s = after[0] - before[0], after[1] - before[1]
                gbps = nbytes / load_s / 1e9 if load_s else 0.0
                r[f"kvtier_cpu_{enc}_s"] = t
                r[f"kvtier_cpu_{enc}_loaded_tokens"] = o.num_external_tokens
                r[f"load_{enc}_gbps"] = gbps
                r[f"load_{enc}_x_memcpy"] = (
                    gbps / memcpy_gbps(max(nbytes, 1 << 20)) if nbytes else 0.0
                )
            results["sizes"][n] = r
        for c in conns.values():
            c.flush()
        xp = cross_process(model, root, sizes, salts)
        for n in sizes:
            r = results["sizes"][n]
            for enc in ("raw", "int8"):
                r[f"kvtier_disk_xproc_{enc}_s"] = xp[f"{enc}:{n}"]["ttft_s"]
                r[f"kvtier_disk_xproc_{enc}_loaded_tokens"] = xp[f"{enc}:{n}"]["loaded_tokens"]
            r["warm_cpu_raw_over_g1"] = r["kvtier_cpu_raw_s"] / r["g1_s"]
            r["warm_disk_raw_over_g1"] = r["kvtier_disk_xproc_raw_s"] / r["g1_s"]
            r["cold_over_warm_cpu_raw"] = r["cold_s"] / r["kvtier_cpu_raw_s"]
            r["cold_over_warm_disk_raw"] = r["cold_s"] / r["kvtier_disk_xproc_raw_s"]
            for name in (
                "cold",
                "g1",
                "kvtier_cpu_raw",
                "kvtier_cpu_int8",
                "kvtier_disk_xproc_raw",
                "kvtier_disk_xproc_int8",
            ):
                t = r[f"{name}_s"]
                rows.append([n, name, t * 1e3, r["cold_s"] / t, t / r["g1_s"]])

        # Saving at a 0% hit rate: plain engine vs the raw-saving engine (G1 off in both).
        plain_nog1 = LLM(model, enable_prefix_caching=False)
        ttft(plain_nog1, prompts.make(64, salt=999_997))
        results["save_overhead"] = save_overhead(
            plain_nog1,
            engines["raw"],
            prompts,
            1024 if args.quick else 2048,
            2 if args.quick else 3,
        )

        # int8 fidelity: KV error over the raw chunks saved above, and greedy agreement.
        raw_blocks = [b for _, b in conns["raw"].store.tiers[0].drain()]
        results["int8_kv_rel_error"] = kv_relative_error(raw_blocks, "int8")
        fid_prompts = [prompts.make(288, salt=700_000 + i) for i in range(6 if args.quick else 16)]
        greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        ref = [o.token_ids for o in plain.generate(fid_prompts, greedy)]
        engines["int8"].generate(fid_prompts, greedy)  # cold, saves int8
        conns["int8"].flush()
        cand_out = engines["int8"].generate(fid_prompts, greedy)  # loads int8 chunks
        agree, compared = top1_agreement(ref, [o.token_ids for o in cand_out])
        results["int8_top1_agreement"] = agree
        results["int8_positions_compared"] = compared
        results["int8_loaded_tokens"] = sum(o.num_external_tokens for o in cand_out)
        for llm in engines.values():
            llm.engine.shutdown()

    print(__doc__.split("\n")[0])
    print(table(["tokens", "path", "TTFT ms", "x faster than cold", "x G1 TTFT"], rows))
    so = results["save_overhead"]
    print(
        f"\nsaving at 0% hit rate ({so['tokens']} tokens, {so['rounds']} rounds): {so['tok_s_plain']:.0f} tok/s without, {so['tok_s_saving']:.0f} with -> overhead {so['overhead']:.1%}"
    )
    for n, r in results["sizes"].items():
        print(
            f"load bandwidth at {n} tokens: raw {r['load_raw_gbps']:.2f} GB/s ({r['load_raw_x_memcpy']:.2f}x memcpy), int8 {r['load_int8_gbps']:.2f} GB/s"
        )
    print(
        f"int8: mean relative KV error {results['int8_kv_rel_error']:.4f}; greedy top-1 agreement {results['int8_top1_agreement']:.1%} over {results['int8_positions_compared']} positions"
    )
    emit(
        {
            "bench": "ttft",
            "quick": args.quick,
            "model": Path(model).name,
            "machine": machine(),
            **results,
        }
    )


if __name__ == "__main__":
    main()
