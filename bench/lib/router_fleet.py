"""The processes of ``bench/serve_router.py``: engines (bundled or vLLM), a shared tier, the router.

Budgets are numbers of tokens, converted per engine from the dtype it runs
at (the same as ``bench/lib/serve_systems.py``): the bundled engine gets
``--dtype`` and the bytes of exactly that many tokens (``--kv-cache-memory``;
its blocks are 16 tokens), vLLM ``--dtype`` and ``--num-gpu-blocks-override``
(tokens / 128, rounded down). So ``--dtype float32`` on a host with native
bf16 holds the same tokens as a host without it, at twice the bytes.

Every process listens on a free 127.0.0.1 port, runs in its own session
(process group) and logs to a file in the run's directory; it is stopped
when its context exits. :meth:`EngineProcess.kill` is the failover phase's
crash: SIGKILL to the engine's process group, by its PID.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml

from kvtier.bench.lib.serve_systems import (
    REPO,
    SERVED_NAME,
    VLLM_BLOCK_TOKENS,
    KvtierEngineServer,
    ensure_hf_export,
    free_port,
    kv_bytes_per_token,
    stop_process,
    wait_healthy,
)

if TYPE_CHECKING:
    from kvtier.bench.lib.vllm_peer import VllmServer

EngineKind = Literal["kvtier", "vllm"]
KVTIER_BLOCK_TOKENS = 16


@dataclass(frozen=True)
class FleetOptions:
    """How every engine of a run is built.

    Attributes:
        engine: ``kvtier`` (``kvtier engine serve``) or ``vllm`` (vLLM-CPU).
        dtype: Weights and KV dtype of every engine (``bfloat16``, ``float32``).
        threads: Torch threads of a bundled engine / OpenMP CPUs of a vLLM worker.
        max_model_len: Longest prompt + answer.
        start_timeout_s: How long to wait for an engine's ``/health``.
        vllm_venv: vLLM's venv (default ``.venv-vllm``).
    """

    engine: EngineKind = "kvtier"
    dtype: str = "bfloat16"
    threads: int | None = 1
    max_model_len: int = 2048
    start_timeout_s: float = 300.0
    vllm_venv: Path | None = None

    def __post_init__(self) -> None:
        if self.engine not in ("kvtier", "vllm"):
            raise ValueError(f"engine must be kvtier or vllm, got {self.engine!r}")
        kv_bytes_per_token(self.dtype)  # KeyError for an unknown dtype
        if self.max_model_len < 64:
            raise ValueError("max_model_len must be at least 64")

    @property
    def block_tokens(self) -> int:
        return VLLM_BLOCK_TOKENS if self.engine == "vllm" else KVTIER_BLOCK_TOKENS

    def g1_tokens(self, kv_tokens: int) -> int:
        """The tokens an engine of this kind really gets for a budget of ``kv_tokens``."""
        n = kv_tokens // self.block_tokens * self.block_tokens
        if n < 2 * self.block_tokens:
            raise ValueError(f"a budget of {kv_tokens} tokens holds less than two blocks")
        return n


@dataclass
class EngineProcess:
    """A started engine: where it answers and how to stop or crash it."""

    name: str
    url: str
    pid: int
    log_path: Path
    info: dict[str, Any] = field(default_factory=dict)
    kv_events: str | None = None  # vLLM: the router's --vllm-kv-events value

    def kill(self) -> None:
        """SIGKILL to the engine's process group (its PID leads it): a crash, not a stop."""
        with suppress(ProcessLookupError):  # it died already
            os.killpg(self.pid, signal.SIGKILL)


def connector_config(path: Path, cache_address: str) -> Path:
    """A kvtier YAML whose one tier is the ``kvtier serve`` cache server at ``cache_address``."""
    from kvtier.config import KvtierConfig

    data = {"tiers": [{"type": "remote", "name": "server", "address": cache_address}]}
    KvtierConfig.model_validate(data)  # fail here, not in an engine's log
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def kvtier_server(
    opts: FleetOptions,
    workdir: Path,
    name: str,
    kv_tokens: int,
    *,
    connector: Path | None = None,
    role: str = "both",
) -> KvtierEngineServer:
    """A bundled engine (not started) with a G1 of ``kv_tokens`` tokens at ``opts.dtype``."""
    tokens = opts.g1_tokens(kv_tokens)
    server = KvtierEngineServer(
        tokens * kv_bytes_per_token(opts.dtype),
        workdir / f"{name}.log",
        kvtier_config=connector,
        threads=opts.threads,
        max_model_len=opts.max_model_len,
        start_timeout_s=opts.start_timeout_s,
        dtype=opts.dtype,
    )
    if role != "both":
        server.cmd += ["--role", role]
    return server


def vllm_server(
    opts: FleetOptions,
    workdir: Path,
    name: str,
    kv_tokens: int,
    *,
    connector: Path | None = None,
    model_dir: Path | None = None,
    cpus: list[int] | None = None,
) -> tuple[VllmServer, dict[str, Any]]:
    """A vLLM engine (not started) with a G1 of ``kv_tokens`` tokens, and its KV events config.

    Its KV events go to ipc endpoints in ``workdir`` (vLLM binds them; a
    ``tcp://host:port`` one would make its PUB connect instead, and
    ``tcp://*`` would listen beyond this host).
    """
    from kvtier.bench.lib.vllm_peer import VllmServer, default_model_dir

    tokens = opts.g1_tokens(kv_tokens)
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{workdir / (name + '-kv-events.ipc')}",
        "replay_endpoint": f"ipc://{workdir / (name + '-kv-replay.ipc')}",
    }
    extra = ["--kv-events-config", json.dumps(events)]
    if connector is not None:
        transfer = {
            "kv_connector": "KvtierConnectorV1",
            "kv_connector_module_path": "kvtier.connectors.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"config": str(connector)},
        }
        extra += ["--kv-transfer-config", json.dumps(transfer)]
    kv_bytes = tokens * kv_bytes_per_token(opts.dtype)
    server = VllmServer(
        model_dir or default_model_dir(),
        venv=opts.vllm_venv,
        served_model_name=SERVED_NAME,
        kv_cache_gib=max(1, -(-kv_bytes // (1 << 30))),  # whole GiB that hold them
        num_gpu_blocks=tokens // VLLM_BLOCK_TOKENS,
        block_size=VLLM_BLOCK_TOKENS,
        omp_threads=opts.threads,
        omp_cpus=cpus,
        max_model_len=opts.max_model_len,
        dtype=opts.dtype,
        extra_args=extra,
        log_path=workdir / f"{name}.log",
        start_timeout_s=opts.start_timeout_s,
    )
    return server, events


_CPU_SLOTS: set[int] = set()  # the slots of this process's vLLM engines that are up


@contextmanager
def cpu_slot(threads: int | None) -> Iterator[list[int] | None]:
    """The CPUs of one more vLLM engine on this host: the ``threads`` after those of the
    engines already up (wrapping round; the engines of one run have the same ``threads``).

    Two engines of one thread each get a CPU each instead of both spinning on the
    first. None when ``threads`` is None (vLLM binds all of them).
    """
    if threads is None:
        yield None
        return
    allowed = sorted(os.sched_getaffinity(0))
    slot = next(i for i in itertools.count() if i not in _CPU_SLOTS)
    _CPU_SLOTS.add(slot)
    try:
        yield [allowed[(slot * threads + j) % len(allowed)] for j in range(threads)]
    finally:
        _CPU_SLOTS.discard(slot)


@contextmanager
def engine_process(
    opts: FleetOptions,
    workdir: Path,
    name: str,
    kv_tokens: int,
    *,
    connector: Path | None = None,
    role: str = "both",
) -> Iterator[EngineProcess]:
    """Starts one engine with a G1 of ``kv_tokens`` tokens (and a connector on ``connector``).

    Raises:
        RuntimeError: it did not come up (the message names its log).
    """
    tokens = opts.g1_tokens(kv_tokens)
    log = workdir / f"{name}.log"
    info: dict[str, Any] = {
        "engine": opts.engine,
        "dtype": opts.dtype,
        "g1_tokens": tokens,
        "kv_cache_bytes": tokens * kv_bytes_per_token(opts.dtype),
        "connector": connector is not None,
        "role": role,
    }
    if opts.engine == "kvtier":
        server = kvtier_server(opts, workdir, name, kv_tokens, connector=connector, role=role)
        info["command"] = " ".join(server.cmd[1:])
        with server:
            yield EngineProcess(name, server.url, server.pid, log, info)
        return
    if role != "both":
        raise ValueError("vLLM engines serve both roles here (no P/D with vLLM)")
    from kvtier.bench.lib.vllm_peer import find_vllm

    if find_vllm(opts.vllm_venv) is None:
        raise RuntimeError(f"vLLM is not installed in {opts.vllm_venv or '.venv-vllm'}")
    from kvtier.bench.lib.vllm_peer import default_model_dir

    model_dir = ensure_hf_export(default_model_dir(), workdir / "export-hf.log")
    with cpu_slot(opts.threads) as cpus:
        vllm, events = vllm_server(
            opts, workdir, name, kv_tokens, connector=connector, model_dir=model_dir, cpus=cpus
        )
        yield from _run_vllm(vllm, events, name, log, info, tokens)


def _run_vllm(
    vllm: VllmServer,
    events: dict[str, Any],
    name: str,
    log: Path,
    info: dict[str, Any],
    tokens: int,
) -> Iterator[EngineProcess]:
    from kvtier.bench.lib.vllm_peer import VllmError

    info.update(
        num_gpu_blocks=tokens // VLLM_BLOCK_TOKENS,
        block_size=VLLM_BLOCK_TOKENS,
        omp_cpus=list(vllm.omp_cpus or []),
        kv_events_config=events,
        command=" ".join(vllm.command(Path("python"))[1:]),
    )
    try:
        vllm.start()
    except (VllmError, OSError) as e:
        raise RuntimeError(f"vLLM did not start: {e}") from e
    try:
        source = f"{vllm.url}={events['endpoint']},replay={events['replay_endpoint']}"
        yield EngineProcess(name, vllm.url, vllm.pid or 0, log, info, source)
    finally:
        vllm.stop(keep_log=True)


class RouterProcess:
    """``kvtier router`` in a subprocess on a free port.

    Args:
        engines: ``(engine, role)`` pairs (roles ``both``, ``prefill``, ``decode``).
        policy: ``--policy``.
        log_path: Where its output goes.
        extra: More ``kvtier router`` flags.
    """

    def __init__(
        self,
        engines: Sequence[tuple[EngineProcess, str]],
        policy: str,
        log_path: Path,
        extra: Sequence[str] = (),
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        flag = {"both": "--engine", "prefill": "--prefill", "decode": "--decode"}
        cmd = [sys.executable, "-m", "kvtier.cli", "router", "--port", str(self.port)]
        cmd += ["--policy", policy, "--health-interval", "0.5"]
        for e, role in engines:
            cmd += [flag[role], e.url]
            if e.kv_events is not None:
                cmd += ["--vllm-kv-events", e.kv_events]
        self.cmd = [*cmd, *extra]
        self.log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> RouterProcess:
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                self.cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            wait_healthy(self.url, self._proc, 120.0)
        except BaseException:
            stop_process(self._proc, grace_s=5)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            stop_process(self._proc, grace_s=10)


@contextmanager
def shared_tier(workdir: Path, capacity: int = 2 << 30) -> Iterator[Path]:
    """A ``kvtier serve`` cache server; yields the connector YAML that reaches it."""
    from kvtier.bench.lib.peers import ServerProcess

    with ExitStack() as stack:
        try:
            cache = stack.enter_context(ServerProcess(capacity))
        except RuntimeError as e:
            raise RuntimeError(f"the shared tier did not start: {e}") from e
        yield connector_config(workdir / "kvtier-shared.yaml", cache.address)
