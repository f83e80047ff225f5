"""Bandwidth of the KV kernels, each as a ratio to a plain copy_ of the same bytes.

    python -m bench.kernels --quick               # CPU here: the torch reference
    python -m bench.kernels --quick --threads 1   # on a shared CPU host
    python -m bench.kernels --device cuda         # Triton kernels and torch reference

Per model shape (a 256-token chunk, bf16, block_size 16, its 16 blocks drawn
at random from a cache of 64 blocks) and op:

* ``gather``         paged cache -> chunk (into a preallocated chunk)
* ``scatter``        chunk -> paged cache
* ``gather+int8``    fused gather + int8 quantize (``gather_kv_quantized``)
* ``dequant+scatter`` fused int8 dequantize + scatter
* (full runs also: ``gather+fp8``, ``dequant+scatter fp8``)

GB/s counts the chunk's bytes in the cache dtype (L * 2 * 256 * H * D * 2)
per second of the op, whatever the op reads and writes besides. The baseline
``copy_`` copies a tensor of exactly those bytes to another on the same
device, measured in the same run; ``x copy`` is op GB/s / copy GB/s.

CPU: the torch reference with its default ``check_slots=True`` (cheap on the
CPU). CUDA: Triton and, for comparison, the torch reference on CUDA, both
with ``check_slots=False`` (the hot-path setting; ``check_slots=True`` costs
one device sync, shown in its own row), timed with CUDA events. ``host us``
is the host's time per call to enqueue it: close to ``us``, the GPU waits
for launches, and the figure is launch cost, not bandwidth.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial
from types import ModuleType
from typing import Any

import torch

from kvtier.bench.lib.common import emit, machine, table, timeit
from kvtier.kernels import reference, slots_for_tokens, triton_kv

SHAPES = {  # name: (layers, kv heads, head_dim)
    "smollm2-135m": (30, 3, 64),
    "llama3-8b": (32, 8, 128),
}
TOKENS = 256
BLOCK_SIZE = 16
NUM_BLOCKS = 64
DTYPE = torch.bfloat16


def cuda_time(fn: Callable[[], object], *, repeat: int, min_time: float) -> float:
    """Median seconds per call, from CUDA events around batches of calls."""
    fn()
    torch.cuda.synchronize()
    n = 1
    while True:  # grow the batch until it takes min_time (bounded: 2**20 calls)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        if start.elapsed_time(end) / 1e3 >= min_time or n >= 2**20:
            break
        n *= 2
    samples = []
    for _ in range(repeat):
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / n)
    return sorted(samples)[len(samples) // 2]


def host_time(fn: Callable[[], object], *, calls: int = 200) -> float:
    """Seconds of host time per call to enqueue ``fn`` (CUDA: launches are asynchronous).

    When this is close to :func:`cuda_time`, the GPU waits for the host: the
    figure is launch cost, not bandwidth.
    """
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    return seconds / calls


def ops(
    backend: ModuleType, cache: torch.Tensor, slots: torch.Tensor, check: bool, full: bool
) -> dict[str, Callable[[], object]]:
    """The timed callables of one backend; inputs are built once, outside the timing."""
    L, _, _, _, H, D = cache.shape
    out = torch.empty(L, 2, TOKENS, H, D, dtype=cache.dtype, device=cache.device)
    chunk = backend.gather_kv(cache, slots)
    result: dict[str, Callable[[], object]] = {
        "gather": lambda: backend.gather_kv(cache, slots, out, check_slots=check),
        "scatter": lambda: backend.scatter_kv(chunk, cache, slots, check_slots=check),
    }
    encodings = ["int8", "fp8_e4m3"] if full else ["int8"]
    for encoding in encodings:
        q = backend.gather_kv_quantized(cache, slots, encoding)
        name = "int8" if encoding == "int8" else "fp8"
        result[f"gather+{name}"] = partial(
            backend.gather_kv_quantized, cache, slots, encoding, check_slots=check
        )
        result[f"dequant+scatter {name}"] = partial(
            backend.scatter_kv_dequantized, q.data, q.scales, cache, slots, check_slots=check
        )
    return result


def bench_shape(
    shape_name: str, device: str, timer: Callable[[Callable[[], object]], float], quick: bool
) -> list[dict[str, Any]]:
    """All ops of every backend on one model shape, and their copy_ baseline."""
    L, H, D = SHAPES[shape_name]
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(L, 2, NUM_BLOCKS, BLOCK_SIZE, H, D, generator=gen).to(DTYPE).to(device)
    blocks = torch.randperm(NUM_BLOCKS, generator=gen)[: TOKENS // BLOCK_SIZE]
    slots = slots_for_tokens(blocks, BLOCK_SIZE, 0, TOKENS).to(device)
    nbytes = L * 2 * TOKENS * H * D * cache.element_size()

    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    copy_gbps = nbytes / timer(lambda: dst.copy_(src)) / 1e9

    on_cuda = device == "cuda"
    backends = (
        [("triton", triton_kv, False), ("torch", reference, False)]
        if on_cuda
        else [("torch", reference, True)]
    )
    rows = []
    for backend_name, backend, check in backends:
        timed = ops(backend, cache, slots, check, full=not quick)
        if on_cuda and backend_name == "triton":
            timed["gather (check_slots)"] = partial(backend.gather_kv, cache, slots)
        for op, fn in timed.items():
            seconds = timer(fn)
            gbps = nbytes / seconds / 1e9
            rows.append(
                {
                    "shape": shape_name,
                    "op": op,
                    "backend": backend_name,
                    "chunk_bytes": nbytes,
                    "us": seconds * 1e6,
                    "host_us": host_time(fn) * 1e6 if on_cuda else None,
                    "gbps": gbps,
                    "copy_gbps": copy_gbps,
                    "x_copy": gbps / copy_gbps,
                }
            )
    return rows


def run(device: str, quick: bool) -> dict[str, Any]:
    """Every shape; the summary that is printed as JSON."""
    repeat, min_time = (3, 0.02) if quick else (7, 0.1)

    def timer(fn: Callable[[], object]) -> float:
        if device == "cuda":
            return cuda_time(fn, repeat=repeat, min_time=min_time)
        return timeit(fn, repeat=repeat, min_time=min_time)

    rows = [row for name in SHAPES for row in bench_shape(name, device, timer, quick)]
    return {
        "bench": "kernels",
        "device": device,
        "quick": quick,
        "machine": machine(),
        "torch_threads": torch.get_num_threads(),
        "results": rows,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter samples (<30 s)")
    parser.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's own); 1 avoids oversubscribing a shared host",
    )
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    started = time.perf_counter()
    summary = run(device, args.quick)
    summary["seconds"] = round(time.perf_counter() - started, 1)
    headers = ["shape", "op", "backend", "MB", "us", "host us", "GB/s", "copy GB/s", "x copy"]
    body = [
        [
            r["shape"],
            r["op"],
            r["backend"],
            r["chunk_bytes"] / 1e6,
            r["us"],
            "-" if r["host_us"] is None else r["host_us"],
            r["gbps"],
            r["copy_gbps"],
            r["x_copy"],
        ]
        for r in summary["results"]
    ]
    print(
        f"KV kernels on {device}, {TOKENS}-token bf16 chunks, "
        f"{summary['torch_threads']} torch threads, {summary['machine']}:"
    )
    print(table(headers, body))
    emit(summary)


if __name__ == "__main__":
    main()
