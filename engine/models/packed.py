"""Linear layers with weights pre-packed for oneDNN (CPU, bfloat16 or float32).

NOTE: why. A decode step reads every weight once; on the 2-core host here
``F.linear`` on plain bf16 weights read them at ~25 GB/s, while oneDNN with
weights reordered once into its blocked layout read them at ~37 GB/s —
SmolLM2's linear layers went from 8.6 to 5.7 ms per batch-1 step, with
bit-identical outputs (docs/engine.md, "Serving"). Prefill matmuls are as
fast or faster. Only the packed copy is kept; ``weight`` (and the state
dict) unpack it on demand, for exports and tests.

float32 (hosts without native bf16): ``F.linear`` goes to MKL, whose GEMMs
ran at ~190 GFLOP/s on the 2-core AMD host here against ~400 for oneDNN's
packed path at prefill sizes, and 2.5x slower at decode batches of 8-16
(SmolLM2's four projections, one thread, CPU time: 749 vs 300 us per layer
at 8 rows); at one row both read the weights equally fast. The layout is
tuned for 32 rows (``batch_hint``): at 8-16 rows that is 1.5-1.7x faster in
float32 than a layout tuned for one row, and the same in bf16.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """True where oneDNN's packed linear is available and used: CPU, bfloat16 or float32,
    on a CPU whose oneDNN packs that dtype (bf16 needs avx512bw/vl/dq or avx_ne_convert:
    an AVX2-only host computes bf16 with plain ``F.linear``)."""
    return (
        device.type == "cpu"
        and dtype in (torch.bfloat16, torch.float32)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and _packs_here(dtype)
    )


@functools.cache
def _packs_here(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN packs ``dtype`` (it raises where it cannot: tried once)."""
    try:
        _pack(torch.zeros(16, 16, dtype=dtype), 1)
    except RuntimeError as e:
        logger.info("no oneDNN packed linear for %s on this CPU: %s", dtype, e)
        return False
    return True


def _pack(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_hint)


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` in oneDNN's blocked layout.

    Args:
        weight: ``[out, in]`` bfloat16 or float32.
        bias: ``[out]`` or None.
        batch_hint: The row count the layout is tuned for.
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int = 32
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = _pack(weight, batch_hint)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """The plain ``[out, in]`` weight (unpacked: a copy, for inspection and export)."""
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def _save_to_state_dict(
        self, destination: dict[str, Any], prefix: str, keep_vars: bool
    ) -> None:
        destination[prefix + "weight"] = self.weight
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        raise RuntimeError("a PackedLinear is built from a loaded nn.Linear; load before packing")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def pack_linears(model: nn.Module) -> int:
    """Replaces every ``nn.Linear`` of ``model`` by a ``PackedLinear``; returns how many.

    A model with tied embeddings also gets a packed copy of the embedding for
    its LM head (``packed_logits``, not a submodule: not in the state dict).
    """
    count = 0
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, PackedLinear(child.weight, child.bias))
                count += 1
    head = getattr(model, "lm_head", None)
    if isinstance(head, PackedLinear):
        logits: PackedLinear = head
    else:
        embedding = model.get_submodule("embed_tokens")
        assert isinstance(embedding, nn.Embedding)
        logits = PackedLinear(embedding.weight, None)
    object.__setattr__(model, "packed_logits", logits)
    return count
