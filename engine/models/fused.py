"""The decoder's forward pass with fused element-wise ops (CPU kernels, bfloat16 or float32).

The same computation as ``DecoderModel.forward``, with each layer's
residual add + RMSNorm, RoPE and SiLU-and-multiply done by one kernel call
each (``csrc/fused_ops.c``) instead of ~25 torch ops: per layer::

    x = add_rmsnorm(h, delta, input_norm)     # h += delta (the last MLP's output), in place
    qkv = qkv_proj(x); rope(qkv[:, :q+k])     # in place
    delta = o_proj(attention(q, k, v))
    x = add_rmsnorm(h, delta, post_norm)      # h += attention output
    delta = down_proj(silu_mul(gate_up_proj(x)))

and a final ``add_rmsnorm(h, delta, norm)``. Used on the CPU (bfloat16 or
float32) when the kernels are built, for models without QK-norm (Qwen3
keeps the plain path).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvtier.engine.attention import AttentionBackend, AttentionMetadata
    from kvtier.engine.cpu_kernels import CpuKernels
    from kvtier.engine.models.llama import DecoderModel


def fused_supported(model: DecoderModel, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``fused_forward`` computes this model: CPU, bfloat16 or float32, no QK-norm."""
    return (
        device.type == "cpu"
        and dtype in (torch.bfloat16, torch.float32)
        and not model.config.qk_norm
    )


def fused_forward(
    model: DecoderModel,
    kernels: CpuKernels,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    backend: AttentionBackend,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """``DecoderModel.forward`` with fused element-wise ops; ``[T, hidden]`` final hidden states."""
    cfg = model.config
    eps = cfg.rms_norm_eps
    hq, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    rotary = model.rotary
    positions = positions.contiguous()
    h = model.embed_tokens(input_ids)  # [T, hidden], a fresh tensor: updated in place
    t = h.shape[0]
    delta: torch.Tensor | None = None
    for layer in model.layers:
        attn, mlp = layer.attn, layer.mlp
        x = kernels.add_rmsnorm(h, delta, layer.input_norm.weight, eps)
        qkv = attn.qkv_proj(x).view(t, hq + 2 * hk, d)
        kernels.rope(qkv, hq + hk, rotary.cos, rotary.sin, positions)
        o = backend.forward(
            attn.layer_idx, qkv[:, :hq], qkv[:, hq : hq + hk], qkv[:, hq + hk :], meta
        )
        delta = attn.o_proj(o.reshape(t, hq * d))
        x = kernels.add_rmsnorm(h, delta, layer.post_norm.weight, eps)
        delta = mlp.down_proj(kernels.silu_mul(mlp.gate_up_proj(x)))
    return kernels.add_rmsnorm(h, delta, model.norm.weight, eps)
