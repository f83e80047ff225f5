"""The CPU layout against vLLM's own kernel: what ``cpu_attn_reshape_and_cache`` writes, kvtier reads.

Runs a short script in ``.venv-vllm`` (vLLM's ops, no server): for block
sizes and dtypes that pick the ``vec`` and ``vec16`` ISAs, vLLM's kernel
writes known K/V into a multi-layer cache laid out as vLLM allocates it;
``PackedCpuKV.gather`` must return exactly those K/V, and what
``PackedCpuKV.scatter`` writes must read back through vLLM's own
``[B, H, 2·BS, D]`` K/V split the way the kernel wrote it.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from kvtier.bench.lib.vllm_peer import find_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

SCRIPT = textwrap.dedent(
    """
    import torch
    import vllm._custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvtier.connectors.layouts import layout_for

    torch.manual_seed(0)
    L, NB, H = 3, 6, 3
    for bs, d, dtype in [(128, 64, torch.bfloat16), (32, 64, torch.float32), (16, 80, torch.bfloat16)]:
        isa = _get_attn_isa(dtype, bs, d)
        buf = torch.zeros(L, NB, H, bs, 2 * d, dtype=dtype)
        layers = [buf[i] for i in range(L)]
        block_ids, start, n = [4, 1, 5, 2], 3, 2 * bs + 5
        k = torch.randn(L, n, H, d).to(dtype)
        v = torch.randn(L, n, H, d).to(dtype)
        pos = torch.arange(start, start + n)
        slots = torch.tensor(block_ids)[pos // bs] * bs + pos % bs
        for i, layer in enumerate(layers):
            kc, vc = layer.view(NB, H, 2 * bs, d).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(k[i], v[i], kc, vc, slots, isa)
        layout = layout_for("CPU_ATTN", layers, d, isa)
        got = layout.gather(block_ids, start, n)
        assert torch.equal(got[:, 0], k) and torch.equal(got[:, 1], v), (bs, d, dtype, isa)
        # scatter new K/V, then have vLLM's kernel rewrite the same tokens: nothing may change
        k2 = torch.randn(L, n, H, d).to(dtype)
        v2 = torch.randn(L, n, H, d).to(dtype)
        layout.scatter(torch.stack([k2, v2], dim=1), block_ids, start)
        ours = buf.clone()
        for i, layer in enumerate(layers):
            kc, vc = layer.view(NB, H, 2 * bs, d).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(k2[i], v2[i], kc, vc, slots, isa)
        assert torch.equal(ours, buf), (bs, d, dtype, isa)
        print("ok", bs, d, dtype, isa)
    """
)


def test_vllms_cpu_kernel_and_the_packed_layout_agree(tmp_path: Path) -> None:
    python = find_vllm()
    if python is None:
        pytest.skip("no vLLM venv: run scripts/setup_vllm.sh (builds .venv-vllm)")
    venv = python.parent.parent
    iomp = sorted(venv.glob("lib/libiomp5.so"))
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    if iomp:
        env["LD_PRELOAD"] = str(iomp[0])
    env.pop("VIRTUAL_ENV", None)
    out = subprocess.run(
        [str(python), str(script)], env=env, capture_output=True, text=True, timeout=500
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    isas = [line.split()[-1] for line in out.stdout.splitlines() if line.startswith("ok ")]
    assert len(isas) == 3 and {"vec", "vec16"} <= set(isas)
