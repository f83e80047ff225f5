"""Time to first token: cold, G1 hit, and loaded from kvtier (in-process and across processes).

    python bench/ttft.py --quick          # 2,048 tokens (under two minutes on an idle 2-core CPU)
    python bench/ttft.py                  # 1,024 / 2,048 / 4,096 tokens
    python bench/ttft.py --quick --threads 1 --clock cpu   # on a shared host

Per prompt length, on SmolLM2-135M (or --model):

* ``cold``          a fresh prompt, nothing cached anywhere;
* ``g1``            the same prompt again in the same engine (its own prefix cache);
* ``kvtier cpu``    an engine whose G1 cache is off, so every cached token comes from
                    kvtier's in-process CPU tier (raw and int8 encodings);
* ``kvtier disk``   a new engine *process*, disk tier only, loading what the first
                    engine wrote (raw and int8) — what a second replica sees.

Also: load bandwidth (bytes of KV placed in the paged cache per second of load
time) against a memcpy of as many bytes; the cost of saving at a 0% hit rate
(prefill throughput with the connector saving vs. without, alternating runs
on distinct prompts); and the fidelity of int8 (mean relative error of
dequantized KV, top-1 agreement of greedy next tokens against the cold run).

Warm figures are the best of three runs; cold ones a single fresh prompt.
``--clock cpu`` times with the process's CPU time (all threads, so the I/O
thread of a load counts) instead of the wall clock: with ``--threads 1`` it
measures the work, not the other jobs sharing the host. A table, then one
JSON line last.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import emit, machine, memcpy_gbps, table, tune_allocator

from kvtier.config import KvtierConfig
from kvtier.connectors.demo import default_model_path, document
from kvtier.connectors.fidelity import kv_relative_error, top1_agreement
from kvtier.connectors.kvtier_connector import KvtierConnector
from kvtier.engine import LLM, SamplingParams

FIRST = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
WARM_RUNS = 3
ENCODINGS = ("raw", "int8")


def make_config(root: Path, encoding: str, *, cpu: bool = True) -> KvtierConfig:
    tiers: list[dict[str, Any]] = [{"type": "cpu", "capacity": "2GiB"}] if cpu else []
    tiers.append({"type": "disk", "path": str(root / f"blocks-{encoding}"), "capacity": "8GiB"})
    return KvtierConfig.model_validate(
        {
            "chunk_size": 256,
            "block": {"encoding": encoding},
            "tiers": tiers,
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


class Timer:
    """TTFT of one prompt (``max_tokens=1``) by the chosen clock."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock

    def once(self, llm: LLM, prompt: list[int]) -> tuple[float, Any]:
        t = self.clock()
        out = llm.generate([prompt], FIRST)[0]
        return self.clock() - t, out

    def best(self, llm: LLM, prompt: list[int]) -> tuple[float, Any]:
        return min((self.once(llm, prompt) for _ in range(WARM_RUNS)), key=lambda r: r[0])


def load_stats(conn: KvtierConnector) -> tuple[int, float]:
    return conn.stats.bytes_loaded, conn.stats.load_seconds


def child(args: argparse.Namespace, timer: Timer, sizes: list[int]) -> None:
    """A new process over the disk tier the parent wrote: disk only, so every run reads it."""
    salts = json.loads(args.salts)
    out: dict[str, Any] = {}
    for encoding in ENCODINGS:
        conn = KvtierConnector(config=make_config(Path(args.root), encoding, cpu=False))
        llm = LLM(args.model, connector=conn, enable_prefix_caching=False, num_threads=args.threads)
        prompts = Prompts(llm)
        timer.once(llm, prompts.make(64, salt=999_999))  # warm-up, nothing to load
        for n in sizes:
            t, o = timer.best(llm, prompts.make(n, salts[str(n)]))
            out[f"{encoding}:{n}"] = {"ttft_s": t, "loaded_tokens": o.num_external_tokens}
        llm.engine.shutdown()
    print(json.dumps(out))


def cross_process(
    args: argparse.Namespace, root: Path, sizes: list[int], salts: dict[int, int]
) -> dict[str, Any]:
    """Run the fresh-process measurement in a child (this script with --child)."""
    cmd = [sys.executable, __file__, "--child", "--model", args.model, "--root", str(root)]
    cmd += [
        "--sizes",
        ",".join(map(str, sizes)),
        "--salts",
        json.dumps(salts),
        "--clock",
        args.clock,
    ]
    if args.threads is not None:
        cmd += ["--threads", str(args.threads)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def save_overhead(
    timer: Timer, plain: LLM, saving: LLM, prompts: Prompts, n: int, rounds: int
) -> dict[str, float]:
    """Prefill throughput with and without saving, alternating, each on a fresh prompt (0% hits)."""
    t_plain = t_save = 0.0
    for r in range(rounds):
        # ABBA order, so a drift in the host's speed hits both sides alike.
        order = ((plain, False), (saving, True)) if r % 2 == 0 else ((saving, True), (plain, False))
        for i, (llm, is_saving) in enumerate(order):
            t = timer.once(llm, prompts.make(n, salt=500_000 + 2 * r + i))[0]
            if is_saving:
                t_save += t
            else:
                t_plain += t
    tp_plain = rounds * n / t_plain
    tp_save = rounds * n / t_save
    return {
        "tokens": n,
        "rounds": rounds,
        "tok_s_plain": tp_plain,
        "tok_s_saving": tp_save,
        "overhead": 1 - tp_save / tp_plain,
    }


def measure_size(
    timer: Timer,
    n: int,
    plain: LLM,
    engines: dict[str, LLM],
    conns: dict[str, KvtierConnector],
    prompts: Prompts,
) -> dict[str, Any]:
    p = prompts.make(n, salt=n)
    cold, _ = timer.once(plain, p)
    g1, g1_out = timer.best(plain, p)
    r: dict[str, Any] = {"cold_s": cold, "g1_s": g1, "g1_cached_tokens": g1_out.num_cached_tokens}
    for enc, llm in engines.items():
        timer.once(llm, p)  # cold, saves
        conns[enc].flush()
        before = load_stats(conns[enc])
        t, o = timer.best(llm, p)
        after = load_stats(conns[enc])
        nbytes, load_s = (after[0] - before[0]) / WARM_RUNS, (after[1] - before[1]) / WARM_RUNS
        gbps = nbytes / load_s / 1e9 if load_s else 0.0
        r[f"kvtier_cpu_{enc}_s"] = t
        r[f"kvtier_cpu_{enc}_loaded_tokens"] = o.num_external_tokens
        r[f"load_{enc}_bytes"] = nbytes
        r[f"load_{enc}_gbps"] = gbps
        r[f"load_{enc}_x_memcpy"] = gbps / memcpy_gbps(int(nbytes)) if nbytes else 0.0
    return r


def int8_fidelity(
    plain: LLM,
    engine: LLM,
    conn: KvtierConnector,
    raw: KvtierConnector,
    prompts: Prompts,
    count: int,
) -> dict[str, Any]:
    """KV error over the raw chunks saved so far; greedy agreement of int8 loads with cold runs."""
    raw_blocks = [b for _, b in raw.store.tiers[0].drain()]
    fid_prompts = [prompts.make(288, salt=700_000 + i) for i in range(count)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ref = [o.token_ids for o in plain.generate(fid_prompts, greedy)]
    engine.generate(fid_prompts, greedy)  # cold, saves int8
    conn.flush()
    cand = engine.generate(fid_prompts, greedy)  # loads int8 chunks
    agree, compared = top1_agreement(ref, [o.token_ids for o in cand])
    return {
        "int8_kv_rel_error": kv_relative_error(raw_blocks, "int8"),
        "int8_top1_agreement": agree,
        "int8_positions_compared": compared,
        "int8_loaded_tokens": sum(o.num_external_tokens for o in cand),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", default=None)
    ap.add_argument("--sizes", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--root", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--salts", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args()
    tune_allocator()
    args.model = args.model or str(default_model_path())
    sizes = [
        int(s) for s in (args.sizes or ("2048" if args.quick else "1024,2048,4096")).split(",")
    ]
    timer = Timer(time.process_time if args.clock == "cpu" else time.perf_counter)
    if args.child:
        child(args, timer, sizes)
        return
    if not Path(args.model).exists():
        raise SystemExit(f"{args.model} not found: run `kvtier model fetch smollm2` first")

    rows: list[list[Any]] = []
    results: dict[str, Any] = {"sizes": {}}
    with tempfile.TemporaryDirectory(prefix="kvtier-ttft-") as tmp:
        root = Path(tmp)
        plain = LLM(args.model, num_threads=args.threads)
        conns = {e: KvtierConnector(config=make_config(root, e)) for e in ENCODINGS}
        # G1 off: every prompt token is either loaded from kvtier or computed.
        engines = {
            e: LLM(args.model, connector=c, enable_prefix_caching=False, num_threads=args.threads)
            for e, c in conns.items()
        }
        prompts = Prompts(plain)
        for llm in (plain, *engines.values()):
            timer.once(llm, prompts.make(64, salt=999_998))  # warm-up
        for n in sizes:
            results["sizes"][n] = measure_size(timer, n, plain, engines, conns, prompts)
        for c in conns.values():
            c.flush()
        xp = cross_process(args, root, sizes, {n: n for n in sizes})
        for n in sizes:
            r = results["sizes"][n]
            for enc in ENCODINGS:
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

        # Saving at a 0% hit rate: a plain engine vs the raw-saving engine (G1 off in both).
        plain_nog1 = LLM(args.model, enable_prefix_caching=False, num_threads=args.threads)
        timer.once(plain_nog1, prompts.make(64, salt=999_997))
        n_save = 1024 if args.quick else 2048
        results["save_overhead"] = save_overhead(
            timer, plain_nog1, engines["raw"], prompts, n_save, 4 if args.quick else 6
        )
        results.update(
            int8_fidelity(
                plain,
                engines["int8"],
                conns["int8"],
                conns["raw"],
                prompts,
                6 if args.quick else 16,
            )
        )
        for llm in engines.values():
            llm.engine.shutdown()

    print(__doc__.split("\n")[0])
    print(f"clock {args.clock}, threads {args.threads or 'default'}")
    print(table(["tokens", "path", "TTFT ms", "x faster than cold", "x G1 TTFT"], rows))
    so = results["save_overhead"]
    print(
        f"\nsaving at 0% hit rate ({so['tokens']} tokens, {so['rounds']} rounds): "
        f"{so['tok_s_plain']:.0f} tok/s without, {so['tok_s_saving']:.0f} with -> overhead {so['overhead']:.1%}"
    )
    for n, r in results["sizes"].items():
        print(
            f"load bandwidth at {n} tokens: raw {r['load_raw_gbps']:.2f} GB/s ({r['load_raw_x_memcpy']:.2f}x memcpy), "
            f"int8 {r['load_int8_gbps']:.2f} GB/s"
        )
    print(
        f"int8: mean relative KV error {results['int8_kv_rel_error']:.4f}; greedy top-1 agreement "
        f"{results['int8_top1_agreement']:.1%} over {results['int8_positions_compared']} positions"
    )
    emit(
        {
            "bench": "ttft",
            "quick": args.quick,
            "clock": args.clock,
            "threads": args.threads,
            "model": Path(args.model).name,
            "machine": machine(),
            **results,
        }
    )


if __name__ == "__main__":
    main()
