"""The dispatch rule and the optional triton import."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

import kvtier.kernels as kernels
from kvtier.kernels import reference
from tests.kernels.kernel_cases import Case, assert_bitwise_equal, make_cache, make_slots


def test_cpu_tensors_take_the_torch_path() -> None:
    case = Case(2, 4, 16, 3, 64, 20, torch.bfloat16, "padded", skip=3)
    cache, _ = make_cache(case, 0, "cpu")
    slots = make_slots(case, 0, "cpu")
    assert kernels.backend_for(cache) == "torch"
    chunk = kernels.gather_kv(cache, slots)
    assert_bitwise_equal(chunk, reference.gather_kv(cache, slots), "gather")
    q = kernels.gather_kv_quantized(cache, slots, "int8")
    q_ref = reference.gather_kv_quantized(cache, slots, "int8")
    assert_bitwise_equal(q.data, q_ref.data, "int8")
    target, _ = make_cache(case, 1, "cpu")
    expected, _ = make_cache(case, 1, "cpu")
    kernels.scatter_kv_dequantized(q.data, q.scales, target, slots)
    reference.scatter_kv_dequantized(q.data, q.scales, expected, slots)
    assert_bitwise_equal(target, expected, "dequant-scatter")
    kernels.scatter_kv(chunk, target, slots)
    reference.scatter_kv(chunk, expected, slots)
    assert_bitwise_equal(target, expected, "scatter")


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_package_works_without_triton() -> None:
    proc = _run(
        """
        import sys
        sys.modules["triton"] = None  # makes `import triton` raise ImportError
        import torch
        import kvtier.kernels as k
        from kvtier.kernels import triton_kv
        cache = torch.randn(2, 2, 3, 4, 2, 8)
        slots = torch.tensor([0, 5, -1])
        chunk = k.gather_kv(cache, slots)
        assert torch.equal(chunk[:, :, 1], cache[:, :, 1, 1])
        assert not triton_kv.triton_available()
        try:
            triton_kv.gather_kv(cache, slots)
        except k.KernelUnavailableError as exc:
            print("unavailable:", exc)
        print("ok")
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert "unavailable: triton is not installed" in proc.stdout and "ok" in proc.stdout


def test_package_import_is_lazy_and_cpu_triton_needs_the_interpreter() -> None:
    proc = _run(
        """
        import os, sys
        os.environ.pop("TRITON_INTERPRET", None)
        import torch
        import kvtier.kernels
        from kvtier.kernels import KernelUnavailableError, triton_kv
        print("triton imported:", "triton" in sys.modules)
        try:
            triton_kv.gather_kv(torch.randn(1, 2, 1, 4, 1, 8), torch.tensor([1]))
        except KernelUnavailableError as exc:
            print("refused:", exc)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert "triton imported: False" in proc.stdout
    assert "refused: the Triton kernels need CUDA tensors" in proc.stdout
