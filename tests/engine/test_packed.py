"""oneDNN-packed linear layers: the same numbers as nn.Linear, and exports still see the weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from kvtier.engine import LLM, SamplingParams
from kvtier.engine.models import packed as packed_mod
from kvtier.engine.models.packed import PackedLinear, pack_linears, packing_supported

pytestmark = pytest.mark.skipif(
    not packing_supported(torch.device("cpu"), torch.bfloat16),
    reason="no oneDNN packed bf16 linear on this CPU",
)


@pytest.mark.parametrize("rows", [1, 3, 16, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_bit_identical_to_linear(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    lin = nn.Linear(96, 200, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(200, 96, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(200, generator=g))
    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
    p = PackedLinear(lin.weight, lin.bias)
    assert torch.equal(p(x), lin(x))
    assert torch.equal(p.weight, lin.weight)  # unpacks exactly
    sd = p.state_dict()
    assert torch.equal(sd["weight"], lin.weight) and (("bias" in sd) == bias)


def test_packed_engine_gives_the_same_tokens_and_exports(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kw = dict(dtype="bfloat16", device="cpu", block_size=4, num_threads=1)
    prompts = [[(7 * i + 3) % 300 + 3 for i in range(40)], [5, 9, 13]]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    packed = LLM(str(tiny_llama), **kw)
    model = packed.engine.runner.model
    assert any(isinstance(m, PackedLinear) for m in model.modules())
    monkeypatch.setattr(packed_mod, "packing_supported", lambda *a: False)
    import kvtier.engine.llm_engine as le

    monkeypatch.setattr(le, "packing_supported", lambda *a: False)
    plain = LLM(str(tiny_llama), **kw)
    assert not any(isinstance(m, PackedLinear) for m in plain.engine.runner.model.modules())
    a = [o.token_ids for o in packed.generate(prompts, params)]
    b = [o.token_ids for o in plain.generate(prompts, params)]
    assert a == b
    # the state dict (exports, to_transformers) holds the plain weights, unchanged
    sd_packed = model.state_dict()
    sd_plain = plain.engine.runner.model.state_dict()
    assert sd_packed.keys() == sd_plain.keys()
    assert all(torch.equal(sd_packed[k], sd_plain[k]) for k in sd_plain)


def test_pack_linears_counts_and_packs_the_lm_head() -> None:
    class Toy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(50, 16).to(torch.bfloat16)
            self.inner = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16)).to(torch.bfloat16)
            self.lm_head = None

    toy = Toy()
    assert pack_linears(toy) == 2
    assert isinstance(toy.packed_logits, PackedLinear)
    assert torch.equal(toy.packed_logits.weight, toy.embed_tokens.weight)
    assert "packed_logits.weight" not in toy.state_dict()
