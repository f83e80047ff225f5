"""The CPU kernels (``csrc/``): built at first use, called through ctypes.

* ``paged_decode.c`` — decode attention. In torch a decode step must first
  gather every sequence's whole context out of the paged cache
  (``index_select``) and then run SDPA on the copy; with a 2,048-token
  context and 6 sequences that was about half of a SmolLM2 decode step
  here. The kernel reads K/V where they lie, once.
* ``paged_prefill.c`` — prefill attention for bfloat16 on AVX512-BF16
  CPUs: flash attention over the paged cache with dot-product instructions,
  2.5-3.5x torch's CPU flash kernel on the prefill shapes of SmolLM2
  (docs/engine.md, "Serving" has the measurements).
* ``paged_prefill_f32.c`` — the same in float32, in portable vector C, for
  hosts without native bf16 (where the engine runs in float32). Used where
  its 16-float vectors are one register (AVX-512): on an AVX2-only host a
  cold 2,048-token prefill took 2.9x as long as with torch's flash kernel
  (``bench/engine.py``), which prefills there.
* ``fused_ops.c`` — a decoder layer's element-wise ops (residual add +
  RMSNorm, SiLU-and-multiply, RoPE) in bfloat16 and float32, one call each
  instead of ~25 torch ops per layer: a decode step of a small model is
  mostly op dispatch once its matmuls are fast.

The sources are compiled with the system C compiler (``$CC`` or ``cc``,
``-O3 -march=native -fopenmp``) into ``$KVTIER_KERNEL_DIR`` (default
``~/.cache/kvtier/kernels``), keyed by a digest of the source, the flags,
the compiler's version and the CPU's feature flags, written atomically so
that processes building at once do not trip over each other. With no
compiler, or a build that fails, the engine keeps the torch path and logs
why once.

``KVTIER_CPU_ATTENTION`` chooses: ``auto`` (default: the kernels when they
build), ``torch`` (never the kernels), ``kernel`` (the kernels or an error).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from kvtier.engine.errors import EngineConfigError

logger = logging.getLogger(__name__)

MODE_ENV = "KVTIER_CPU_ATTENTION"
DIR_ENV = "KVTIER_KERNEL_DIR"
_FLAGS = ("-O3", "-ffast-math", "-fopenmp", "-shared", "-fPIC")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_SOURCES = ("paged_decode.c", "paged_prefill.c", "paged_prefill_f32.c", "fused_ops.c")
_ERRORS = {
    1: "unsupported dtype",
    2: "unsupported shape (heads, head_dim or group size)",
    3: "a context length outside the block table",
    4: "out of memory",
}


class KernelError(RuntimeError):
    """The kernel refused its inputs (a bug in the caller: shapes are checked first)."""


@dataclass(frozen=True)
class CpuKernels:
    """The loaded library: attention over the paged cache, and fused layer ops.

    The fused ops and the prefill kernel come in a bfloat16 and a float32
    flavour (``fused_dtypes``); each call picks the one of its tensors' dtype.

    Attributes:
        path: The shared object.
        specialised: True when the decode kernel was built with the AVX-512
            items specialised on head_dim 64/128 and group sizes 1-8.
        has_prefill: True when the bf16 prefill kernel was built (AVX512-BF16);
            the float32 one is always built.
        f32_prefill: True when the float32 prefill kernel is the engine's
            (built for AVX-512); elsewhere it is callable but slower than torch.
    """

    path: Path
    specialised: bool
    has_prefill: bool
    f32_prefill: bool
    _decode: Callable[..., int]
    _prefill: Callable[..., int]
    _prefill_f32: Callable[..., int]
    _add_rmsnorm: dict[torch.dtype, Callable[..., None]]
    _silu_mul: dict[torch.dtype, Callable[..., None]]
    _rope: dict[torch.dtype, Callable[..., None]]

    @property
    def fused_dtypes(self) -> tuple[torch.dtype, ...]:
        """Dtypes the fused layer ops compute."""
        return tuple(self._add_rmsnorm)

    # ---- fused layer ops (bfloat16 or float32, contiguous rows) -------------------------

    def add_rmsnorm(
        self,
        h: torch.Tensor,
        delta: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        """``h += delta`` in place (when given), then RMSNorm of ``h`` scaled by ``weight``.

        Args:
            h: ``[T, dim]`` bfloat16 or float32, contiguous (the residual stream).
            delta: ``[T, dim]`` of the same dtype, contiguous, or None.
            weight: ``[dim]`` of the same dtype.
            eps: Epsilon.
        """
        rows, dim = h.shape
        out = torch.empty_like(h)
        self._add_rmsnorm[h.dtype](
            h.data_ptr(),
            None if delta is None else delta.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            dim,
            eps,
        )
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``gate_up`` ``[T, 2I]`` (gate first) -> ``[T, I]``."""
        rows, two_i = gate_up.shape
        out = torch.empty((rows, two_i // 2), dtype=gate_up.dtype)
        self._silu_mul[gate_up.dtype](gate_up.data_ptr(), out.data_ptr(), rows, two_i // 2)
        return out

    def rope(
        self,
        x: torch.Tensor,
        heads: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        """Rotates the first ``heads`` heads of ``x`` ``[T, H, d]`` in place ("rotate half").

        Args:
            x: bfloat16 or float32 with contiguous heads (a row stride of its own).
            heads: Leading heads to rotate (the query and key heads).
            cos, sin: ``[max_positions, d // 2]`` tables of ``x``'s dtype, contiguous.
            positions: ``[T]`` int64.
        """
        rows, _, d = x.shape
        self._rope[x.dtype](
            x.data_ptr(), x.stride(0), rows, heads, d, cos.data_ptr(), sin.data_ptr(),
            positions.data_ptr(),
        )  # fmt: skip

    def supports_prefill(self, kv_cache: torch.Tensor) -> bool:
        """True when prefill spans of this cache can use a prefill kernel."""
        if not self.supports(kv_cache):
            return False
        d = kv_cache.shape[-1]
        if kv_cache.dtype == torch.float32:
            return self.f32_prefill and d % 16 == 0
        return self.has_prefill and kv_cache.dtype == torch.bfloat16 and d in (64, 128)

    def supports(self, kv_cache: torch.Tensor) -> bool:
        """True for a contiguous CPU cache of a dtype and head size the kernel handles."""
        return (
            kv_cache.device.type == "cpu"
            and kv_cache.dtype in _DTYPE_CODES
            and kv_cache.is_contiguous()
            and kv_cache.shape[-1] <= 256
        )

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Decode attention of one layer.

        Args:
            q: ``[B, hq, d]``, last two dims contiguous.
            k_cache, v_cache: ``[N, bs, hk, d]`` contiguous (one layer).
            block_table: ``[B, max_blocks]`` int64 contiguous.
            lens: ``[B]`` int64, context length of each sequence (``>= 1``).
            scale: Softmax scale.

        Returns:
            ``[B, hq, d]`` in ``q``'s dtype.
        """
        b, hq, d = q.shape
        _, bs, hk, _ = k_cache.shape
        if q.stride(2) != 1 or q.stride(1) != d or q.dtype != k_cache.dtype:
            raise KernelError(f"q must be [B, hq, d] with contiguous heads, got {q.stride()}")
        out = torch.empty((b, hq, d), dtype=q.dtype)
        rc = self._decode(
            _DTYPE_CODES[q.dtype],
            q.data_ptr(),
            q.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            out.data_ptr(),
            block_table.data_ptr(),
            lens.data_ptr(),
            b,
            block_table.shape[1],
            hq,
            hk,
            d,
            bs,
            scale,
        )
        if rc:
            raise KernelError(f"paged decode kernel: {_ERRORS.get(rc, f'error {rc}')}")
        return out

    def prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_ids: torch.Tensor,
        prefix_len: int,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of one prefill span after ``prefix_len`` cached tokens.

        Args:
            q: ``[q_len, hq, d]``, last two dims contiguous; query ``i`` sits at
                position ``prefix_len + i``.
            k_cache, v_cache: ``[N, bs, hk, d]`` contiguous (one layer), holding
                the span's own K/V already.
            block_ids: ``[>= ceil((prefix_len + q_len) / bs)]`` int64 contiguous.
            prefix_len: Tokens before the span.
            scale: Softmax scale.

        Returns:
            ``[q_len, hq, d]`` in ``q``'s dtype (bfloat16 or float32, the cache's).
        """
        n, hq, d = q.shape
        _, bs, hk, _ = k_cache.shape
        if q.stride(2) != 1 or q.stride(1) != d or q.dtype != k_cache.dtype:
            raise KernelError(f"q must be [T, hq, d] with contiguous heads, got {q.stride()}")
        if q.dtype not in (torch.bfloat16, torch.float32):
            raise KernelError(f"no prefill kernel for {q.dtype}")
        if block_ids.numel() * bs < prefix_len + n:
            raise KernelError("the block table is shorter than the span")
        out = torch.empty((n, hq, d), dtype=q.dtype)
        kernel = self._prefill if q.dtype == torch.bfloat16 else self._prefill_f32
        rc = kernel(
            q.data_ptr(),
            q.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            out.data_ptr(),
            block_ids.data_ptr(),
            prefix_len,
            n,
            hq,
            hk,
            d,
            bs,
            scale,
        )
        if rc:
            raise KernelError(f"paged prefill kernel: {_ERRORS.get(rc, f'error {rc}')}")
        return out


def _kernel_dir() -> Path:
    root = os.environ.get(DIR_ENV)
    return Path(root).expanduser() if root else Path("~/.cache/kvtier/kernels").expanduser()


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.strip()
    except OSError:
        pass
    return ""


def _build(sources: dict[str, bytes], compiler: str) -> Path:
    """Compiles ``sources`` (name -> C text) into one shared object (cached); returns its path.

    Raises:
        OSError, subprocess.SubprocessError: when the compiler is missing or fails.
    """
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
    ).stdout.splitlines()[0]
    flags = [*_FLAGS, "-march=native"]
    parts = [name.encode() + b"\0" + text for name, text in sorted(sources.items())]
    key = hashlib.sha256(
        b"\0".join([*parts, " ".join(flags).encode(), version.encode(), _cpu_flags().encode()])
    ).hexdigest()[:24]
    out_dir = _kernel_dir()
    target = out_dir / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        srcs = []
        for name, text in sorted(sources.items()):
            src = Path(tmp) / name
            src.write_bytes(text)
            srcs.append(str(src))
        obj = Path(tmp) / "cpu_kernels.so"
        cmd = [compiler, *flags, *srcs, "-o", str(obj), "-lm"]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise subprocess.SubprocessError(
                f"{' '.join(cmd)} failed: {result.stderr.strip()[-2000:]}"
            )
        os.replace(obj, target)  # atomic: a concurrent builder wrote the same bytes
    return target


def _load(path: Path) -> CpuKernels:
    lib = ctypes.CDLL(str(path))
    if lib.kvt_abi_version() != 1:
        raise OSError(f"{path}: unexpected ABI version")
    prefill, prefill_f32 = lib.kvt_paged_prefill, lib.kvt_paged_prefill_f32
    for f in (prefill, prefill_f32):
        f.restype = ctypes.c_int
        f.argtypes = [
            ctypes.c_void_p,  # q
            ctypes.c_int64,  # q row stride
            *([ctypes.c_void_p] * 4),  # k cache, v cache, out, block ids
            *([ctypes.c_int64] * 6),  # prefix_len, q_len, hq, hk, d, bs
            ctypes.c_float,  # scale
        ]
    fn = lib.kvt_paged_decode
    fn.restype = ctypes.c_int
    fn.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        *([ctypes.c_int64] * 6),
        ctypes.c_float,
    ]
    fused: dict[str, dict[torch.dtype, Callable[..., None]]] = {}
    for name, argtypes in (
        ("add_rmsnorm", [*([ctypes.c_void_p] * 4), ctypes.c_int64, ctypes.c_int64, ctypes.c_float]),
        ("silu_mul", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]),
        ("rope", [ctypes.c_void_p, *([ctypes.c_int64] * 4), *([ctypes.c_void_p] * 3)]),
    ):
        fused[name] = {}
        for dtype, suffix in ((torch.bfloat16, ""), (torch.float32, "_f32")):
            f = getattr(lib, f"kvt_{name}{suffix}")
            f.restype = None
            f.argtypes = argtypes
            fused[name][dtype] = f
    return CpuKernels(
        path,
        bool(lib.kvt_has_avx512_items()),
        bool(lib.kvt_has_prefill()),
        bool(lib.kvt_prefill_f32_native()),
        fn,
        prefill,
        prefill_f32,
        fused["add_rmsnorm"],
        fused["silu_mul"],
        fused["rope"],
    )


_lock = threading.Lock()
_loaded: dict[str, CpuKernels | None] = {}


def cpu_kernels() -> CpuKernels | None:
    """The kernels, built and loaded once per process; None when the torch path must serve.

    Raises:
        EngineConfigError: for a bad ``KVTIER_CPU_ATTENTION``, or when it is
            ``kernel`` and the kernel cannot be built.
    """
    mode = os.environ.get(MODE_ENV, "auto").strip().lower()
    if mode not in ("auto", "torch", "kernel"):
        raise EngineConfigError(f"{MODE_ENV} must be 'auto', 'torch' or 'kernel', got {mode!r}")
    if mode == "torch":
        return None
    with _lock:
        if "kernel" not in _loaded:
            _loaded["kernel"] = _try_build()
        kernel = _loaded["kernel"]
    if kernel is None and mode == "kernel":
        raise EngineConfigError(f"{MODE_ENV}=kernel but the CPU attention kernels did not build")
    return kernel


def _try_build() -> CpuKernels | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler (cc, gcc or $CC): CPU decode attention uses the torch path")
        return None
    csrc = resources.files("kvtier.engine").joinpath("csrc")
    sources = {name: csrc.joinpath(name).read_bytes() for name in _SOURCES}
    try:
        return _load(_build(sources, compiler))
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("the CPU attention kernels did not build (%s): using the torch path", e)
        return None
