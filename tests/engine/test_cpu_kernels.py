"""The CPU paged-decode kernel against gather + SDPA, its build cache and its fallbacks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvtier.engine import LLM, EngineConfigError, SamplingParams
from kvtier.engine import cpu_kernels as ca
from kvtier.engine.cpu_kernels import CpuKernels, KernelError, cpu_kernels
from tests.engine.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def kernel() -> CpuKernels:
    k = cpu_kernels()
    if k is None:
        pytest.skip("no C compiler: the kernel cannot be built here")
    return k


def _reference(q, kc, vc, table, lens, scale):
    """Gather each sequence's context and attend with SDPA in float64 (the exact answer)."""
    b, hq, d = q.shape
    hk = kc.shape[2]
    out = torch.empty(b, hq, d, dtype=torch.float64)
    for i in range(b):
        n = int(lens[i])
        k = kc.index_select(0, table[i]).reshape(-1, hk, d)[:n].double()  # [n, hk, d]
        v = vc.index_select(0, table[i]).reshape(-1, hk, d)[:n].double()
        qi = q[i].double().view(hk, hq // hk, d)
        o = F.scaled_dot_product_attention(
            qi, k.transpose(0, 1), v.transpose(0, 1), scale=scale
        )  # [hk, g, d]
        out[i] = o.reshape(hq, d)
    return out


def _case(dtype, b, hq, hk, d, bs, lens, seed=0, q_pad=0):
    g = torch.Generator().manual_seed(seed)
    n_blocks = sum(-(-n // bs) for n in lens) + 7
    kc = torch.randn(n_blocks, bs, hk, d, generator=g).to(dtype)
    vc = torch.randn(n_blocks, bs, hk, d, generator=g).to(dtype)
    max_blocks = max(-(-n // bs) for n in lens) + 2  # padded table, as the runner builds it
    perm = torch.randperm(n_blocks, generator=g)
    table = torch.zeros(b, max_blocks, dtype=torch.long)
    used = 0
    for i, n in enumerate(lens):
        k = -(-n // bs)
        table[i, :k] = perm[used : used + k]
        used += k
    # q as the model hands it over: a slice of a wider [T, heads + pad, d] tensor
    q = torch.randn(b, hq + q_pad, d, generator=g).to(dtype)[:, :hq]
    return q, kc, vc, table, torch.tensor(lens, dtype=torch.long)


@pytest.mark.parametrize(
    ("dtype", "hq", "hk", "d", "bs", "lens"),
    [
        (torch.float32, 9, 3, 64, 16, [1, 17, 300, 1000]),  # SmolLM2's heads; several partitions
        (torch.bfloat16, 9, 3, 64, 16, [2048, 1, 513]),
        (torch.float32, 32, 8, 128, 16, [700, 33]),  # Llama-3-like, g = 4
        (torch.bfloat16, 8, 8, 128, 4, [5, 260]),  # MHA, g = 1
        (torch.float32, 28, 4, 64, 8, [257]),  # g = 7
        (torch.float32, 12, 1, 48, 16, [90, 3]),  # head_dim 48, g = 12: the portable items
        (torch.bfloat16, 6, 2, 40, 32, [64, 1]),
    ],
)
def test_kernel_matches_exact_attention(kernel, dtype, hq, hk, d, bs, lens) -> None:
    q, kc, vc, table, lens_t = _case(dtype, len(lens), hq, hk, d, bs, lens, q_pad=hk)
    scale = d**-0.5
    got = kernel.decode(q, kc, vc, table, lens_t, scale).double()
    want = _reference(q, kc, vc, table, lens_t, scale)
    # fp32: summation order only; bf16: the output is rounded to bf16 (2^-8 relative)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_kernel_rejects_what_it_cannot_compute(kernel) -> None:
    q, kc, vc, table, lens = _case(torch.float32, 2, 9, 3, 64, 16, [10, 20])
    with pytest.raises(KernelError, match="context length"):
        kernel.decode(q, kc, vc, table, torch.tensor([10, 10_000]), 0.125)
    with pytest.raises(KernelError, match="context length"):
        kernel.decode(q, kc, vc, table, torch.tensor([0, 10]), 0.125)
    with pytest.raises(KernelError, match="shape"):
        kernel.decode(q[:, :8], kc, vc, table, lens, 0.125)  # 8 query heads over 3 KV heads
    with pytest.raises(KernelError, match="contiguous heads"):
        kernel.decode(q.transpose(1, 2).contiguous().transpose(1, 2), kc, vc, table, lens, 0.125)


def test_engine_output_is_the_same_with_and_without_the_kernel(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = [[5, 9, 13, 21, 8, 40, 2, 77] * 9, [77, 3, 3, 90], [11] * 37]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", block_size=4, num_threads=1)
    with_kernel = LLM(str(tiny_llama), **kw)
    assert with_kernel.engine.runner.backend.decode_kernel is not None or cpu_kernels() is None
    monkeypatch.setenv(ca.MODE_ENV, "torch")
    without = LLM(str(tiny_llama), **kw)
    assert without.engine.runner.backend.decode_kernel is None
    a = [o.token_ids for o in with_kernel.generate(prompts, params)]
    b = [o.token_ids for o in without.generate(prompts, params)]
    assert a == b


def test_modes_and_a_missing_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(ca.MODE_ENV, "sometimes")
    with pytest.raises(EngineConfigError, match=ca.MODE_ENV):
        cpu_kernels()
    monkeypatch.setenv(ca.MODE_ENV, "torch")
    assert cpu_kernels() is None
    # a fresh process state with no usable compiler: auto falls back, kernel refuses
    monkeypatch.setattr(ca, "_loaded", {})
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv(ca.DIR_ENV, str(tmp_path / "kernels"))
    monkeypatch.setenv(ca.MODE_ENV, "auto")
    assert cpu_kernels() is None
    monkeypatch.setenv(ca.MODE_ENV, "kernel")
    with pytest.raises(EngineConfigError, match="did not build"):
        cpu_kernels()


def test_a_build_is_cached_by_source_and_reused(
    kernel, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(ca.DIR_ENV, str(tmp_path))
    source = {"a.c": b"int kvt_abi_version(void) { return 1; }\n"}
    first = ca._build(source, "cc")
    mtime = first.stat().st_mtime_ns
    assert ca._build(source, "cc") == first and first.stat().st_mtime_ns == mtime
    assert ca._build({"a.c": source["a.c"] + b"\n"}, "cc") != first
    assert [p.suffix for p in tmp_path.iterdir()] == [".so", ".so"]  # no temporary leftovers


def _prefill_reference(q, kc, vc, blocks, prefix_len, scale):
    """Causal attention after ``prefix_len`` tokens, from a gathered copy, in float64."""
    n, _, d = q.shape
    hk = kc.shape[2]
    total = prefix_len + n
    k = kc.index_select(0, blocks).reshape(-1, hk, d)[:total].double().transpose(0, 1)
    v = vc.index_select(0, blocks).reshape(-1, hk, d)[:total].double().transpose(0, 1)
    mask = torch.arange(total)[None, :] <= (prefix_len + torch.arange(n))[:, None]
    o = F.scaled_dot_product_attention(
        q.double().transpose(0, 1), k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return o.transpose(0, 1)


@pytest.mark.parametrize(
    ("hq", "hk", "d", "bs", "prefix", "n"),
    [
        (9, 3, 64, 16, 0, 300),  # SmolLM2, cold, several query and key tiles
        (9, 3, 64, 16, 1008, 97),  # after a cached prefix, tiles off the block grid
        (9, 3, 64, 4, 5, 1),  # one token
        (32, 8, 128, 16, 70, 130),  # Llama-3-like
        (8, 8, 64, 32, 0, 65),  # MHA
        (16, 1, 64, 16, 33, 40),  # g = 16
    ],
)
def test_prefill_kernel_matches_exact_attention(kernel, hq, hk, d, bs, prefix, n) -> None:
    if not kernel.has_prefill:
        pytest.skip("no AVX512-BF16 on this CPU: prefill uses torch")
    g = torch.Generator().manual_seed(prefix + n)
    blocks_needed = -(-(prefix + n) // bs)
    kc = torch.randn(blocks_needed + 9, bs, hk, d, generator=g).to(torch.bfloat16)
    vc = torch.randn(blocks_needed + 9, bs, hk, d, generator=g).to(torch.bfloat16)
    blocks = torch.randperm(blocks_needed + 9, generator=g)[:blocks_needed]
    q = torch.randn(n, hq + 2, d, generator=g).to(torch.bfloat16)[:, :hq]
    got = kernel.prefill(q, kc, vc, blocks, prefix, d**-0.5).double()
    want = _prefill_reference(q, kc, vc, blocks, prefix, d**-0.5)
    # bf16 inputs, P rounded to bf16 before P.V, output rounded to bf16
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert (got - want).abs().mean() < 2e-3


@pytest.mark.parametrize(
    ("hq", "hk", "d", "bs", "prefix", "n"),
    [
        (9, 3, 64, 16, 0, 300),  # SmolLM2, cold, several query and key tiles
        (9, 3, 64, 16, 1008, 97),  # after a cached prefix, tiles off the block grid
        (9, 3, 64, 4, 5, 1),  # one token
        (32, 8, 128, 16, 70, 130),  # Llama-3-like
        (8, 8, 64, 32, 0, 65),  # MHA
        (16, 1, 64, 16, 33, 40),  # g = 16
        (12, 4, 48, 16, 20, 70),  # head_dim 48: output vectors that are not a multiple of 64
    ],
)
def test_float32_prefill_kernel_matches_exact_attention(kernel, hq, hk, d, bs, prefix, n) -> None:
    g = torch.Generator().manual_seed(prefix + n + 1)
    blocks_needed = -(-(prefix + n) // bs)
    kc = torch.randn(blocks_needed + 9, bs, hk, d, generator=g)
    vc = torch.randn(blocks_needed + 9, bs, hk, d, generator=g)
    blocks = torch.randperm(blocks_needed + 9, generator=g)[:blocks_needed]
    q = torch.randn(n, hq + 2, d, generator=g)[:, :hq]
    got = kernel.prefill(q, kc, vc, blocks, prefix, d**-0.5)
    assert got.dtype == torch.float32
    want = _prefill_reference(q, kc, vc, blocks, prefix, d**-0.5)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)


def test_float32_prefill_kernel_refuses_odd_head_sizes(kernel) -> None:
    kc = torch.zeros(4, 16, 3, 40)
    assert not kernel.supports_prefill(kc)
    # the engine's only where built for AVX-512; callable everywhere (the tests above)
    assert kernel.supports_prefill(torch.zeros(4, 16, 3, 64)) == kernel.f32_prefill
    with pytest.raises(KernelError, match="unsupported shape"):
        kernel.prefill(torch.zeros(3, 9, 40), kc, kc, torch.tensor([0]), 0, 0.1)


def test_prefill_kernel_rejects_a_short_block_table(kernel) -> None:
    if not kernel.has_prefill:
        pytest.skip("no AVX512-BF16 on this CPU: prefill uses torch")
    kc = torch.zeros(4, 16, 3, 64, dtype=torch.bfloat16)
    q = torch.zeros(40, 9, 64, dtype=torch.bfloat16)
    with pytest.raises(KernelError, match="block table"):
        kernel.prefill(q, kc, kc, torch.tensor([0, 1]), 0, 0.125)


@pytest.fixture(scope="module")
def head64_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with head_dim 64 (the prefill kernel's size) and GQA 6:2."""
    path, _ = write_tiny_model(
        tmp_path_factory.mktemp("tiny-head64"),
        "llama",
        seed=5,
        hidden_size=384,
        intermediate_size=256,
        num_attention_heads=6,
        num_key_value_heads=2,
    )
    return path


def test_bf16_engine_logits_agree_with_and_without_the_kernels(
    head64_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole model in bf16: kernels vs torch SDPA, cold and after a cached prefix."""
    kw = dict(dtype="bfloat16", device="cpu", block_size=4, num_threads=1)
    fast = LLM(str(head64_llama), **kw).engine
    kernels = cpu_kernels()
    if kernels is None or not kernels.has_prefill:
        pytest.skip("no prefill kernel on this CPU")
    assert fast.runner.backend.prefill_kernel is not None
    monkeypatch.setenv(ca.MODE_ENV, "torch")
    slow = LLM(str(head64_llama), **kw).engine
    exact = LLM(str(head64_llama), **{**kw, "dtype": "float32"}).engine
    tokens = [(7 * i + 3) % 300 + 3 for i in range(150)]
    for use_cache in (False, True):  # the second pass starts after a G1 hit
        a = fast.score(tokens, use_prefix_cache=use_cache)
        b = slow.score(tokens, use_prefix_cache=use_cache)
        assert a.start == b.start and (a.start > 0) == use_cache
        ref = exact.score(tokens, use_prefix_cache=False).logits[a.start :]  # float32
        # bf16 everywhere: the kernels' rounding error is that of torch's path
        err_kernel = (a.logits - ref).abs().mean()
        err_torch = (b.logits - ref).abs().mean()
        assert err_kernel < 1.25 * err_torch, (err_kernel, err_torch)
        assert (a.logits.argmax(-1) == b.logits.argmax(-1)).float().mean() > 0.9


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in bf16 units in the last place between two bf16 tensors."""
    ia = a.view(torch.int16).to(torch.int32)
    ib = b.view(torch.int16).to(torch.int32)
    return int((ia - ib).abs().max())


def test_fused_add_rmsnorm_matches_the_torch_layers(kernel) -> None:
    from kvtier.engine.models.llama import RMSNorm

    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(576, 1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=g))
    for rows in (1, 5, 100):  # one thread, and the threaded path
        h = (torch.randn(rows, 576, generator=g) * 3).to(torch.bfloat16)
        delta = torch.randn(rows, 576, generator=g).to(torch.bfloat16)
        ref_h = h.clone().add_(delta)
        ref = norm(ref_h)
        got_h = h.clone()
        got = kernel.add_rmsnorm(got_h, delta, norm.weight, 1e-5)
        assert torch.equal(got_h, ref_h)  # the residual add rounds exactly as torch's
        assert _ulps(got, ref) <= 1  # the mean of squares is summed in another order
        assert torch.equal(kernel.add_rmsnorm(ref_h.clone(), None, norm.weight, 1e-5), got)


def test_fused_silu_mul_and_rope_match_torch(kernel) -> None:
    from kvtier.engine.models.rope import apply_rope

    g = torch.Generator().manual_seed(1)
    gu = (torch.randn(7, 2 * 96, generator=g) * 4).to(torch.bfloat16)
    gate, up = gu.split(96, dim=-1)
    assert _ulps(kernel.silu_mul(gu), F.silu(gate) * up) <= 1
    # rope on the q and k heads of a fused qkv, in place; v untouched
    qkv = torch.randn(11, 9 + 2 * 3, 64, generator=g).to(torch.bfloat16)
    cos = torch.randn(50, 32, generator=g).to(torch.bfloat16)
    sin = torch.randn(50, 32, generator=g).to(torch.bfloat16)
    pos = torch.randint(0, 50, (11,), generator=g)
    ref = apply_rope(qkv[:, :12], cos[pos].unsqueeze(1), sin[pos].unsqueeze(1))
    got = qkv.clone()
    kernel.rope(got, 12, cos, sin, pos)
    assert torch.equal(got[:, :12], ref)
    assert torch.equal(got[:, 12:], qkv[:, 12:])


def test_fused_engine_agrees_with_the_unfused_forward(
    head64_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kw = dict(dtype="bfloat16", device="cpu", block_size=4, num_threads=1)
    fused = LLM(str(head64_llama), **kw).engine
    assert fused.runner.model.fused_kernels is not None
    plain = LLM(str(head64_llama), **kw).engine
    plain.runner.model.fused_kernels = None
    exact = LLM(str(head64_llama), **{**kw, "dtype": "float32"}).engine
    tokens = [(11 * i + 5) % 300 + 3 for i in range(90)]
    a = fused.score(tokens, use_prefix_cache=False).logits
    b = plain.score(tokens, use_prefix_cache=False).logits
    ref = exact.score(tokens, use_prefix_cache=False).logits
    assert (a - ref).abs().mean() < 1.25 * (b - ref).abs().mean()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


def test_float32_fused_ops_match_the_torch_layers(kernel) -> None:
    from kvtier.engine.models.llama import RMSNorm
    from kvtier.engine.models.rope import apply_rope

    g = torch.Generator().manual_seed(2)
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=g))
    for rows in (1, 5, 100):  # one thread, and the threaded path
        h = torch.randn(rows, 576, generator=g) * 3
        delta = torch.randn(rows, 576, generator=g)
        ref_h = h + delta
        got_h = h.clone()
        got = kernel.add_rmsnorm(got_h, delta, norm.weight, 1e-5)
        assert torch.equal(got_h, ref_h)
        torch.testing.assert_close(got, norm(ref_h), atol=1e-5, rtol=1e-5)
    gu = torch.randn(7, 2 * 96, generator=g) * 4
    gate, up = gu.split(96, dim=-1)
    torch.testing.assert_close(kernel.silu_mul(gu), F.silu(gate) * up, atol=1e-5, rtol=1e-5)
    qkv = torch.randn(11, 9 + 2 * 3, 64, generator=g)
    cos = torch.randn(50, 32, generator=g)
    sin = torch.randn(50, 32, generator=g)
    pos = torch.randint(0, 50, (11,), generator=g)
    ref = apply_rope(qkv[:, :12], cos[pos].unsqueeze(1), sin[pos].unsqueeze(1))
    got = qkv.clone()
    kernel.rope(got, 12, cos, sin, pos)
    torch.testing.assert_close(got[:, :12], ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[:, 12:], qkv[:, 12:])


def test_float32_engine_logits_agree_with_and_without_the_kernels(
    kernel: CpuKernels, head64_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole float32 model: packed matmuls, fused ops and the prefill kernel against
    plain torch, cold and after a cached prefix."""
    kw = dict(dtype="float32", device="cpu", block_size=4, num_threads=1)
    if not kernel.f32_prefill:  # torch prefills on this host: the kernel, all the same
        monkeypatch.setattr(
            ca.CpuKernels, "supports_prefill", lambda self, kv: kv.dtype == torch.float32
        )
    fast = LLM(str(head64_llama), **kw).engine
    assert fast.runner.backend.prefill_kernel is not None
    assert fast.runner.model.fused_kernels is not None
    monkeypatch.setenv(ca.MODE_ENV, "torch")
    slow = LLM(str(head64_llama), **kw).engine
    assert slow.runner.backend.prefill_kernel is None
    tokens = [(7 * i + 3) % 300 + 3 for i in range(150)]
    for use_cache in (False, True):  # the second pass starts after a G1 hit
        a = fast.score(tokens, use_prefix_cache=use_cache)
        b = slow.score(tokens, use_prefix_cache=use_cache)
        assert a.start == b.start and (a.start > 0) == use_cache
        # NOTE: an AVX2-only host (no AVX-512) accumulates in another order: one logit of
        # 57,600 was 1.1e-4 off; a wrong kernel is off by whole units
        torch.testing.assert_close(a.logits, b.logits, atol=5e-4, rtol=1e-4)
