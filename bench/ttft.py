"""Time to first token: cold, G1 hit, and loaded from kvtier (in-process and across processes).

    python -m bench.ttft --quick       # random lengths, quiet then with one core busy (1-2 min)
    python -m bench.ttft               # also k prompts of 1,024 / 2,048 / 4,096 tokens, int8,
                                       # the cost of saving, int8 fidelity
    python -m bench.ttft --contend     # the whole run with one core kept busy
    python -m bench.ttft --policies    # engine thread policies, quiet and with one core busy
    python -m bench.ttft --policies all-cores,auto --hosts quiet --rounds 4   # an A/B

Paths, per prompt, on SmolLM2-135M (or --model):

* ``cold``           a fresh prompt, nothing cached anywhere (an engine without a connector);
* ``g1``             the same prompt again in that engine (its own prefix cache);
* ``kvtier_cpu``     an engine whose G1 cache is off, so every cached token comes from
                     kvtier's in-process CPU tier (raw; int8 too in the full run);
* ``disk``           a new engine *process*, disk tier only, loading what the first
                     process wrote (what a second replica sees), block files in the page cache;
* ``disk_dropped``   the same, each block file dropped from the page cache just before
                     (``fdatasync`` + ``posix_fadvise(DONTNEED)``), so the load reads the device.

Samples: every path is measured once on each of the same k prompts and reported
as the median (p50) of the k, with min and max. Random lengths are drawn between
1,000 and 4,000 tokens, never a multiple of 16; the full run adds k prompts of
each fixed size. Before timing, every engine and process runs an unrelated
prompt of each length it will time, twice (the cold shapes, then the hit's), so
no path pays a first-call set-up. ``computed`` is the engine's own count of
prompt tokens it computed for the timed request (``prompt_tokens_computed``
before and after), not derived from what was loaded.

One core busy (``contended``; ``--contend``): a subprocess spinning on one core,
bounded in time and killed by PID when the phase ends, runs beside every
engine and process of the phase.

``--policies``: per torch thread policy (all cores, 1 thread, ``auto`` of
kvtier.engine.threads, all cores with OMP_WAIT_POLICY=PASSIVE), a fresh
process (one engine, G1 off, disk tier only) measures a cold 2,048-token TTFT
(the run that saves), the same prompt's TTFT loaded from the disk tier, and a
batch-1 decode step; quiet, then with one core busy, policy after policy
(reversed every other round), for --rounds rounds, each figure the median of
all its samples.

A table, then one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvtier.bench.lib.common import (
    busy_core,
    drop_page_cache,
    emit,
    load_average,
    machine,
    table,
    tune_allocator,
)
from kvtier.config import KvtierConfig
from kvtier.connectors.demo import default_model_path, document
from kvtier.connectors.fidelity import kv_relative_error, top1_agreement
from kvtier.connectors.kvtier_connector import KvtierConnector
from kvtier.engine import LLM, SamplingParams

FIRST = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
ENCODINGS = ("raw", "int8")
FIXED_SIZES = (1024, 2048, 4096)
RANDOM_MIN, RANDOM_MAX = 1000, 4000
HOG_MAX_S = 1800.0  # the spinner's own bound, should this script die without killing it
DECODE_STEPS = 32
POLICY_PROMPT = 2048
# Bars from issue 10, checked on every run.
DISK_OVER_G1_MAX = 1.3
COLD_OVER_DISK_MIN = 8.0
RECOMPUTED_MAX = 17
CONTENDED_COLD_OVER_DISK_MIN = 4.0


def make_config(root: Path, encoding: str, *, cpu: bool = True) -> KvtierConfig:
    tiers: list[dict[str, Any]] = [{"type": "cpu", "capacity": "1GiB"}] if cpu else []
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


@dataclass(frozen=True)
class Case:
    """One timed prompt (``salt``) and the unrelated warm-up prompt of its length."""

    group: str  # "random" or a fixed size
    n: int
    salt: int
    warm_salt: int


@dataclass(frozen=True)
class Sample:
    ttft_s: float
    computed: int  # prompt tokens the engine computed for this request (its counter)
    loaded: int  # prompt tokens loaded from kvtier


def random_lengths(k: int, seed: int) -> list[int]:
    """``k`` lengths in [1000, 4000], none a multiple of 16 (so never of 256 either)."""
    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < k:
        n = rng.randint(RANDOM_MIN, RANDOM_MAX)
        if n % 16:
            out.append(n)
    return out


def make_cases(groups: dict[str, list[int]], first_salt: int) -> list[Case]:
    cases = []
    salt = first_salt
    for group, lengths in groups.items():
        for n in lengths:
            cases.append(Case(group, n, salt, salt + 1))
            salt += 2
    return cases


def timed(llm: LLM, prompt: list[int]) -> Sample:
    """TTFT (wall clock, ``max_tokens=1``) and the engine's own count of computed prompt tokens."""
    before = llm.engine.stats().prompt_tokens_computed
    t = time.perf_counter()
    out = llm.generate([prompt], FIRST)[0]
    ttft = time.perf_counter() - t
    computed = llm.engine.stats().prompt_tokens_computed - before
    return Sample(ttft, computed, out.num_external_tokens)


Paths = dict[str, dict[str, list[Sample]]]  # path -> group -> samples


def _paths() -> Paths:
    return defaultdict(lambda: defaultdict(list))


class InProcess:
    """The engines of the first process: cold and G1 (no connector), and kvtier writers."""

    def __init__(self, model: str, root: Path, encodings: tuple[str, ...], threads: Any) -> None:
        self.plain = LLM(model, num_threads=threads)
        self.conns = {e: KvtierConnector(config=make_config(root, e)) for e in encodings}
        # G1 off: every prompt token is either loaded from kvtier or computed.
        self.writers = {
            e: LLM(model, connector=c, enable_prefix_caching=False, num_threads=threads)
            for e, c in self.conns.items()
        }
        self.prompts = Prompts(self.plain)
        self.load_bytes = dict.fromkeys(encodings, 0)
        self.load_s = dict.fromkeys(encodings, 0.0)

    def measure(self, cases: list[Case]) -> Paths:
        """Every path once per case; the writers also leave each prompt on disk for the child."""
        out = _paths()
        for case in cases:
            p, w = self.prompts.make(case.n, case.salt), self.prompts.make(case.n, case.warm_salt)
            timed(self.plain, w)  # warm-up: the cold shapes ...
            timed(self.plain, w)  # ... then the G1 hit's
            out["cold"][case.group].append(timed(self.plain, p))
            out["g1"][case.group].append(timed(self.plain, p))
            for enc, llm in self.writers.items():
                conn = self.conns[enc]
                timed(llm, w)  # warm-up, and stored for the new process's warm-up
                conn.flush()
                timed(llm, w)
                timed(llm, p)  # cold, saves
                conn.flush()
                b0, s0 = conn.stats.bytes_loaded, conn.stats.load_seconds
                out[f"kvtier_cpu_{enc}"][case.group].append(timed(llm, p))
                self.load_bytes[enc] += conn.stats.bytes_loaded - b0
                self.load_s[enc] += conn.stats.load_seconds - s0
        return out

    def shutdown(self) -> None:
        for llm in self.writers.values():
            llm.engine.shutdown()


def disk_child(spec: dict[str, Any]) -> None:
    """A new process over the disk tier the parent wrote: disk only, so every load reads it."""
    root = Path(spec["root"])
    out = _paths()
    for enc in spec["encodings"]:
        conn = KvtierConnector(config=make_config(root, enc, cpu=False))
        llm = LLM(
            spec["model"], connector=conn, enable_prefix_caching=False, num_threads=spec["threads"]
        )
        prompts = Prompts(llm)
        for c in spec["cases"]:
            case = Case(**c)
            p = prompts.make(case.n, case.salt)
            timed(llm, prompts.make(case.n, case.warm_salt))  # warm-up: the hit's shapes
            conn.flush()
            if enc == "raw":
                drop_page_cache(root / f"blocks-{enc}")
                out["disk_dropped"][case.group].append(timed(llm, p))
                conn.flush()
            out["disk" if enc == "raw" else f"disk_{enc}"][case.group].append(timed(llm, p))
            conn.flush()
        threads = llm.engine.threads.threads
        llm.engine.shutdown()
    paths = {p: {g: [asdict(s) for s in v] for g, v in gs.items()} for p, gs in out.items()}
    print(json.dumps({"paths": paths, "threads": threads}))


def run_child(flag: str, spec: dict[str, Any], env: dict[str, str] | None = None) -> Any:
    """Runs this module as a child with ``flag``; its last stdout line, parsed."""
    cmd = [sys.executable, "-m", "kvtier.bench.ttft", flag, json.dumps(spec)]
    proc = subprocess.run(
        cmd,
        stdout=subprocess.PIPE,
        text=True,
        check=True,
        env={**os.environ, **(env or {})},
        cwd=Path(__file__).resolve().parents[1],  # the repository root: ``bench`` is importable
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cross_process(
    args: argparse.Namespace, root: Path, cases: list[Case], encodings: tuple[str, ...]
) -> tuple[Paths, int]:
    """The disk rows, measured in a new process; also its torch thread count at the end."""
    spec = {
        "model": args.model,
        "root": str(root),
        "encodings": list(encodings),
        "threads": args.threads,
        "cases": [asdict(c) for c in cases],
    }
    raw = run_child("--disk-child", spec)
    out = _paths()
    for path, groups in raw["paths"].items():
        for group, samples in groups.items():
            out[path][group] = [Sample(**s) for s in samples]
    return out, raw["threads"]


@contextmanager
def one_core_busy(on: bool) -> Iterator[None]:
    with busy_core(HOG_MAX_S) if on else nullcontext():
        yield


def summarize(samples: list[Sample]) -> dict[str, Any]:
    t = [s.ttft_s for s in samples]
    return {
        "k": len(t),
        "p50_s": statistics.median(t),
        "min_s": min(t),
        "max_s": max(t),
        "computed_max": max(s.computed for s in samples),
        "loaded_min": min(s.loaded for s in samples),
    }


KVTIER_PATHS = ("kvtier_cpu_raw", "kvtier_cpu_int8", "disk", "disk_dropped", "disk_int8")


def headline(paths: Paths, lengths: list[int]) -> dict[str, Any]:
    """The issue's figures for the random lengths of one phase."""
    r = {p: summarize(paths[p]["random"]) for p in paths if "random" in paths[p]}
    return {
        "lengths": lengths,
        "k": len(lengths),
        "ttft_g1_p50_s": r["g1"]["p50_s"],
        "ttft_disk_xproc_p50_s": r["disk"]["p50_s"],
        "ttft_disk_xproc_page_cache_dropped_p50_s": r["disk_dropped"]["p50_s"],
        "ttft_kvtier_cpu_p50_s": r["kvtier_cpu_raw"]["p50_s"],
        "ttft_cold_p50_s": r["cold"]["p50_s"],
        # tokens the engines computed for a kvtier hit, every kvtier path and prompt
        "recomputed_tokens_max": max(r[p]["computed_max"] for p in KVTIER_PATHS if p in r),
        "recomputed_tokens_g1_max": r["g1"]["computed_max"],
    }


def run_phase(
    args: argparse.Namespace,
    name: str,
    contended: bool,
    groups: dict[str, list[int]],
    first_salt: int,
    engines: InProcess,
    root: Path,
    encodings: tuple[str, ...],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One phase's cases through every path; its per-path summary and its random-length headline."""
    cases = make_cases(groups, first_salt)
    print(f"[{name}] {len(cases)} prompts, one core busy: {contended} ...", file=sys.stderr)
    load0 = load_average()
    with one_core_busy(contended):
        paths = engines.measure(cases)
        for c in engines.conns.values():
            c.flush()
        disk, child_threads = cross_process(args, root, cases, encodings)
        paths.update(disk)
    return {
        "contended": contended,
        # what the engines' thread policy had chosen by the end of the phase
        "threads_first_process": engines.plain.engine.threads.threads,
        "threads_new_process": child_threads,
        "load_average_start": load0,
        "load_average_end": load_average(),
        "groups": groups,
        "paths": {p: {g: summarize(v) for g, v in gs.items()} for p, gs in paths.items()},
    }, headline(paths, groups["random"])


def save_overhead(
    plain: LLM, saving: LLM, prompts: Prompts, n: int, rounds: int
) -> dict[str, float]:
    """Prefill throughput with and without saving, alternating, each on a fresh prompt (0% hits)."""
    t_plain = t_save = 0.0
    for r in range(rounds):
        # ABBA order, so a drift in the host's speed hits both sides alike.
        order = ((plain, False), (saving, True)) if r % 2 == 0 else ((saving, True), (plain, False))
        for i, (llm, is_saving) in enumerate(order):
            t = timed(llm, prompts.make(n, salt=500_000 + 2 * r + i)).ttft_s
            if is_saving:
                t_save += t
            else:
                t_plain += t
    tp_plain, tp_save = rounds * n / t_plain, rounds * n / t_save
    return {
        "tokens": n,
        "rounds": rounds,
        "tok_s_plain": tp_plain,
        "tok_s_saving": tp_save,
        "overhead": 1 - tp_save / tp_plain,
    }


def int8_fidelity(engines: InProcess, count: int) -> dict[str, Any]:
    """KV error over the raw chunks saved so far; greedy agreement of int8 loads with cold runs."""
    raw_blocks = [b for _, b in engines.conns["raw"].store.tiers[0].drain()]
    fid_prompts = [engines.prompts.make(288, salt=700_000 + i) for i in range(count)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ref = [o.token_ids for o in engines.plain.generate(fid_prompts, greedy)]
    int8 = engines.writers["int8"]
    int8.generate(fid_prompts, greedy)  # cold, saves int8
    engines.conns["int8"].flush()
    cand = int8.generate(fid_prompts, greedy)  # loads int8 chunks
    agree, compared = top1_agreement(ref, [o.token_ids for o in cand])
    return {
        "int8_kv_rel_error": kv_relative_error(raw_blocks, "int8"),
        "int8_top1_agreement": agree,
        "int8_positions_compared": compared,
        "int8_loaded_tokens": sum(o.num_external_tokens for o in cand),
    }


def bars(results: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    q = results.get("random_lengths")
    if q is not None:
        out["disk_over_g1"] = q["ttft_disk_xproc_p50_s"] / q["ttft_g1_p50_s"]
        out["cold_over_disk"] = q["ttft_cold_p50_s"] / q["ttft_disk_xproc_p50_s"]
        out["recomputed_tokens_max"] = q["recomputed_tokens_max"]
        out["disk_over_g1_ok"] = out["disk_over_g1"] <= DISK_OVER_G1_MAX
        out["cold_over_disk_ok"] = out["cold_over_disk"] >= COLD_OVER_DISK_MIN
        out["recomputed_ok"] = q["recomputed_tokens_max"] <= RECOMPUTED_MAX
    c = results.get("contended")
    if c is not None:
        out["contended_cold_over_disk"] = c["ttft_cold_p50_s"] / c["ttft_disk_xproc_p50_s"]
        out["contended_cold_over_disk_ok"] = (
            out["contended_cold_over_disk"] >= CONTENDED_COLD_OVER_DISK_MIN
        )
        out["contended_recomputed_ok"] = c["recomputed_tokens_max"] <= RECOMPUTED_MAX
    return out


def print_phases(phases: dict[str, Any]) -> None:
    rows = []
    for name, ph in phases.items():
        for path, groups in ph["paths"].items():
            for group, s in groups.items():
                cold = ph["paths"]["cold"][group]["p50_s"]
                g1 = ph["paths"]["g1"][group]["p50_s"]
                rows.append(
                    [
                        name,
                        group,
                        path,
                        s["k"],
                        s["p50_s"] * 1e3,
                        f"{s['min_s'] * 1e3:.0f}-{s['max_s'] * 1e3:.0f}",
                        cold / s["p50_s"],
                        s["p50_s"] / g1,
                        s["computed_max"],
                    ]
                )
    order = ("cold", "g1", *KVTIER_PATHS)
    rows.sort(key=lambda r: (list(phases).index(r[0]), r[1], order.index(r[2])))
    head = ["phase", "prompts", "path", "k", "p50 ms", "min-max ms", "x faster than cold", "x G1"]
    print(table([*head, "computed max"], rows))
    for name, ph in phases.items():
        lengths = ", ".join(f"{g}: {v}" for g, v in ph["groups"].items())
        la0, la1 = ph["load_average_start"][0], ph["load_average_end"][0]
        print(
            f"  {name}: lengths {lengths}; load average {la0:.2f} -> {la1:.2f}; torch threads "
            f"{ph['threads_first_process']} (first process), {ph['threads_new_process']} (new one)"
        )


def print_bars(b: dict[str, Any]) -> None:
    checks = (
        ("disk_over_g1", f"<= {DISK_OVER_G1_MAX}"),
        ("cold_over_disk", f">= {COLD_OVER_DISK_MIN}"),
        ("recomputed_tokens_max", f"<= {RECOMPUTED_MAX}"),
        ("contended_cold_over_disk", f">= {CONTENDED_COLD_OVER_DISK_MIN}"),
    )
    ok_key = {"recomputed_tokens_max": "recomputed_ok"}
    for key, bar in checks:
        if key in b:
            ok = b[ok_key.get(key, f"{key}_ok")]
            print(f"  {key} = {b[key]:.3g} (bar {bar}: {'met' if ok else 'MISSED'})")


def run_ttft(args: argparse.Namespace) -> None:
    k = args.k or (3 if args.quick else 5)
    encodings = ("raw",) if args.quick else ENCODINGS
    fixed = {} if args.quick else {str(n): [n] * k for n in FIXED_SIZES}
    plan = [("contended", True)] if args.contend else [("quiet", False), ("contended", True)]
    results: dict[str, Any] = {}
    phases: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-ttft-") as tmp:
        root = Path(tmp)
        engines = InProcess(args.model, root, encodings, args.threads)
        for i, (name, contended) in enumerate(plan):
            # the same lengths in every phase (other prompts), so the phases compare
            groups = {"random": random_lengths(k, seed=args.seed)}
            if not contended or args.contend:
                groups = {**fixed, **groups}
            phases[name], results["contended" if contended else "random_lengths"] = run_phase(
                args, name, contended, groups, 10_000 * (i + 1), engines, root, encodings
            )
        if not args.quick:
            with one_core_busy(args.contend):
                plain_nog1 = LLM(args.model, enable_prefix_caching=False, num_threads=args.threads)
                timed(plain_nog1, engines.prompts.make(2048, salt=999_997))  # warm-up
                timed(plain_nog1, engines.prompts.make(2048, salt=999_996))
                results["save_overhead"] = save_overhead(
                    plain_nog1, engines.writers["raw"], engines.prompts, 2048, 6
                )
                results.update(int8_fidelity(engines, 16))
        results["load_gbps"] = {
            e: engines.load_bytes[e] / engines.load_s[e] / 1e9 if engines.load_s[e] else 0.0
            for e in encodings
        }
        engines.shutdown()
    results["bars"] = bars(results)

    print(__doc__.split("\n")[0])
    print(f"threads {args.threads or 'engine default'}; TTFT by wall clock, p50 of k prompts")
    print_phases(phases)
    print_bars(results["bars"])
    if "save_overhead" in results:
        so = results["save_overhead"]
        print(
            f"saving at 0% hit rate ({so['tokens']} tokens, {so['rounds']} rounds): "
            f"{so['tok_s_plain']:.0f} tok/s without, {so['tok_s_saving']:.0f} with -> overhead {so['overhead']:.1%}"
        )
        print(
            f"int8: mean relative KV error {results['int8_kv_rel_error']:.4f}; greedy top-1 agreement "
            f"{results['int8_top1_agreement']:.1%} over {results['int8_positions_compared']} positions"
        )
    print(
        "load bandwidth (kvtier CPU tier): "
        + ", ".join(f"{e} {g:.2f} GB/s" for e, g in results["load_gbps"].items())
    )
    emit(
        {
            "bench": "ttft",
            "quick": args.quick,
            "contend": args.contend,
            "threads": args.threads,
            "model": Path(args.model).name,
            "machine": machine(),
            "phases": phases,
            **results,
        }
    )


# ---- thread policies --------------------------------------------------------------------------


POLICY_NAMES = ("all-cores", "1-thread", "auto", "passive")


def policies(cores: int, names: list[str]) -> dict[str, tuple[int | str, dict[str, str]]]:
    """label -> (num_threads, environment of the process), for the chosen ``POLICY_NAMES``."""
    table = {
        "all-cores": (f"{cores} threads (all cores)", cores, {}),
        "1-thread": ("1 thread", 1, {}),
        "auto": ("auto", "auto", {}),
        "passive": (
            f"{cores} threads, OMP_WAIT_POLICY=PASSIVE",
            cores,
            {"OMP_WAIT_POLICY": "PASSIVE"},
        ),
    }
    return {table[n][0]: (table[n][1], table[n][2]) for n in names}


def decode_step_s(llm: LLM, prompt: list[int]) -> float:
    """Median wall time of a batch-1 decode step (steps after the first token)."""
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS + 1, ignore_eos=True)
    rid = eng.add_request(prompt, params)
    steps: list[float] = []
    first = False
    while eng.scheduler.find(rid) is not None:
        t = time.perf_counter()
        outs = eng.step()
        if first:
            steps.append(time.perf_counter() - t)
        first = first or any(o.request_id == rid and o.token_ids for o in outs)
    return statistics.median(steps)


def policy_child(spec: dict[str, Any]) -> None:
    """One policy, one load: cold TTFT, a disk-tier hit's TTFT and a decode step, median of k.

    One engine, G1 off, the disk tier its only tier: a prompt's first run is
    the cold one (it saves), its second loads it from the disk tier.
    """
    import torch

    root = Path(spec["root"])
    conn = KvtierConnector(config=make_config(root, "raw", cpu=False))
    llm = LLM(
        spec["model"], connector=conn, enable_prefix_caching=False, num_threads=spec["threads"]
    )
    prompts = Prompts(llm)
    n, salt = POLICY_PROMPT, spec["salt"]
    w = prompts.make(n, salt)
    timed(llm, w)  # warm-up: the cold shapes ...
    conn.flush()
    timed(llm, w)  # ... the hit's
    decode_step_s(llm, prompts.make(64, salt + 1))
    cold, hit, step = [], [], []
    for i in range(spec["k"]):
        p = prompts.make(n, salt + 2 + i)
        cold.append(timed(llm, p).ttft_s)
        conn.flush()
        hit.append(timed(llm, p))
        step.append(decode_step_s(llm, prompts.make(64, salt + 100 + i)))
    policy = llm.engine.threads
    out = {
        "cold_s": cold,
        "disk_hit_s": [t.ttft_s for t in hit],
        "disk_hit_computed": [t.computed for t in hit],
        "decode_step_s": step,
        "threads_end": torch.get_num_threads(),
        "thread_changes": policy.changes,
    }
    llm.engine.shutdown()
    print(json.dumps(out))


def run_policies(args: argparse.Namespace) -> None:
    """Every policy quiet then busy, round after round, so the host's drift reaches them all."""
    cores = len(os.sched_getaffinity(0))
    k, rounds = args.k or 2, args.rounds
    runs: dict[str, dict[str, list[Any]]] = defaultdict(lambda: defaultdict(list))
    load0 = load_average()
    with tempfile.TemporaryDirectory(prefix="kvtier-threads-") as tmp:
        child = 0
        chosen = list(policies(cores, args.policies).items())
        for r in range(rounds):
            # ABBA: every other round runs the policies in reverse, so drift reaches all alike
            for name, (threads, env) in chosen if r % 2 == 0 else chosen[::-1]:
                for busy in args.hosts:
                    child += 1
                    spec = {
                        "model": args.model,
                        "root": str(Path(tmp) / f"run{child}"),
                        "threads": threads,
                        "k": k,
                        "salt": 1000 * child,
                    }
                    key = f"{name}|{'1 core busy' if busy else 'quiet'}"
                    print(f"[policies] round {r + 1}/{rounds}: {key} ...", file=sys.stderr)
                    la = load_average()[0]
                    with one_core_busy(busy):
                        out = run_child("--policy-child", spec, env)
                    for field, value in out.items():
                        runs[key][field] += value if isinstance(value, list) else [value]
                    runs[key]["load_average_1m"].append(la)
    rows, results = [], {}
    for key, v in runs.items():
        name, host = key.split("|")
        res = {
            "cold_p50_s": statistics.median(v["cold_s"]),
            "disk_hit_p50_s": statistics.median(v["disk_hit_s"]),
            "disk_hit_computed_max": max(v["disk_hit_computed"]),
            "decode_step_p50_s": statistics.median(v["decode_step_s"]),
            "samples": len(v["cold_s"]),
            "threads_end": v["threads_end"],
            "thread_changes": v["thread_changes"],
            "load_average_1m": v["load_average_1m"],
        }
        results[key] = res
        rows.append(
            [
                name,
                host,
                res["cold_p50_s"] * 1e3,
                res["disk_hit_p50_s"] * 1e3,
                res["decode_step_p50_s"] * 1e3,
                "/".join(map(str, v["threads_end"])),
                "/".join(f"{x:.1f}" for x in v["load_average_1m"]),
            ]
        )
    print(f"thread policies on {cores} cores; p50 of {k} x {rounds} samples each; wall clock")
    head = ["policy", "host", f"cold {POLICY_PROMPT} ms", "disk-tier hit ms", "decode step ms"]
    print(table([*head, "threads at end", "load 1m per run"], rows))
    emit(
        {
            "bench": "ttft_policies",
            "k": k,
            "rounds": rounds,
            "prompt_tokens": POLICY_PROMPT,
            "model": Path(args.model).name,
            "machine": machine(),
            "load_average_start": load0,
            "load_average_end": load_average(),
            "policies": results,
        }
    )


def parse_names(value: str) -> list[str]:
    names = value.split(",")
    bad = [n for n in names if n not in POLICY_NAMES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown policies {bad}; choose from {POLICY_NAMES}")
    return names


def parse_hosts(value: str) -> list[bool]:
    hosts = {"quiet": False, "busy": True}
    try:
        return [hosts[h] for h in value.split(",")]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"hosts are 'quiet' and/or 'busy', got {value!r}"
        ) from None


def parse_threads(value: str) -> int | str:
    return value if value == "auto" else int(value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="random lengths only, quiet then contended"
    )
    ap.add_argument("--contend", action="store_true", help="keep one core busy for the whole run")
    ap.add_argument(
        "--policies",
        nargs="?",
        const=",".join(POLICY_NAMES),
        type=parse_names,
        help=f"compare engine thread policies: all, or some of {','.join(POLICY_NAMES)}",
    )
    ap.add_argument(
        "--hosts",
        default="quiet,busy",
        type=parse_hosts,
        help="--policies: quiet, busy (one core kept busy) or both",
    )
    ap.add_argument("--k", type=int, default=None, help="prompts (samples) per path and group")
    ap.add_argument("--rounds", type=int, default=2, help="--policies: rounds over all policies")
    ap.add_argument("--seed", type=int, default=1, help="seed of the random lengths")
    ap.add_argument("--model", default=None)
    ap.add_argument(
        "--threads", type=parse_threads, default=None, help="torch threads: a count or 'auto'"
    )
    ap.add_argument("--disk-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--policy-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    # SIGTERM unwinds like Ctrl-C, so the CPU hog and the temporary directories are cleaned up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tune_allocator()
    if args.disk_child is not None:
        disk_child(json.loads(args.disk_child))
        return
    if args.policy_child is not None:
        policy_child(json.loads(args.policy_child))
        return
    args.model = args.model or str(default_model_path())
    if not Path(args.model).exists():
        raise SystemExit(f"{args.model} not found: run `kvtier model fetch smollm2` first")
    if args.policies is not None:
        run_policies(args)
    else:
        run_ttft(args)


if __name__ == "__main__":
    main()
