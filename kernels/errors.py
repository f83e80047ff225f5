"""Typed errors raised by the KV kernels."""

from __future__ import annotations

__all__ = ["KernelInputError", "KernelUnavailableError"]


class KernelInputError(ValueError):
    """An argument to a KV kernel has the wrong shape, dtype, device or layout.

    Raised before anything is launched, so the cache and the outputs are left
    untouched. The message names the argument and what was expected.
    """


class KernelUnavailableError(RuntimeError):
    """A kernel backend cannot run here.

    For example Triton is not installed, or a Triton kernel was given CPU
    tensors without ``TRITON_INTERPRET=1``.
    """
