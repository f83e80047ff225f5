"""Device, dtype and thread selection (read once, when an engine starts)."""

from __future__ import annotations

import os
from functools import lru_cache

import torch

from kvtier.engine.errors import EngineConfigError

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@lru_cache(maxsize=1)
def cpu_has_fast_bf16() -> bool:
    """True when the CPU multiplies bf16 natively (AMX-BF16 or AVX512-BF16).

    On such CPUs oneDNN runs bf16 matmuls several times faster than fp32
    (see docs/engine.md for measurements); elsewhere bf16 is emulated and slower.
    """
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool({"amx_bf16", "avx512_bf16"} & flags)
    except OSError:
        return False
    return False


def resolve_device(name: str) -> torch.device:
    """``auto``/``cpu``/``cuda`` -> a torch device.

    Raises:
        EngineConfigError: if CUDA is requested but not available.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise EngineConfigError("device 'cuda' requested but CUDA is not available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``/``bfloat16``/``float32`` -> a torch dtype for ``device``."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def default_num_threads() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
