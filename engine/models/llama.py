"""One decoder-only model class for the Llama family (Llama 2/3, SmolLM, Qwen2, Qwen3).

Tokens of all sequences in a step are flattened into one ``[T]`` batch
(vLLM-style); attention is delegated to an ``AttentionBackend`` that reads and
writes the paged KV cache. Q/K/V and gate/up projections are fused into one
matmul each.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.engine.models.config import ModelConfig
from kvtier.engine.models.fused import fused_forward
from kvtier.engine.models.rope import RotaryEmbedding, apply_rope

if TYPE_CHECKING:
    from kvtier.engine.attention import AttentionBackend, AttentionMetadata
    from kvtier.engine.cpu_kernels import CpuKernels


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, as Hugging Face does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # NOTE: torch's fused rms_norm on bf16 CPU tensors is 2-3x slower
        # than upcasting first (measured: 4-6 ms vs 2 ms for 2048x576), and
        # this is exactly HF's "normalize in fp32, round, then scale".
        y = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)
        return self.weight * y


class Attention(nn.Module):
    """Self-attention with fused QKV, GQA, optional QKV bias and QK-norm."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # x: [T, hidden]
        t = x.shape[0]
        hq, hk = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(t, hq + 2 * hk, self.head_dim)
        v = qkv[:, hq + hk :]  # [T, kv_heads, head_dim]
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm(qkv[:, :hq]), self.k_norm(qkv[:, hq : hq + hk])), dim=1)
        else:
            qk = qkv[:, : hq + hk]
        # NOTE: one rotation over Q and K heads together halves the kernel count.
        qk = apply_rope(qk, cos, sin)  # [T, heads + kv_heads, head_dim]
        q, k = qk[:, :hq], qk[:, hq:]
        o = backend.forward(self.layer_idx, q, k, v, meta)  # [T, heads, head_dim]
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    """SwiGLU feed-forward with fused gate/up projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, layer_idx)
        self.post_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # NOTE: in-place residual adds: ``h`` is the step's own activation
        # buffer (fresh from the embedding), so nothing else aliases it.
        h.add_(self.attn(self.input_norm(h), cos, sin, backend, meta))
        return h.add_(self.mlp(self.post_norm(h)))


class DecoderModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head."""

    def __init__(self, config: ModelConfig, max_positions: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: nn.Linear | None = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.rotary = RotaryEmbedding(config, max_positions, dtype)
        # set by models.packed.pack_linears (oneDNN-packed LM head); not a submodule
        self.packed_logits: nn.Module | None = None
        # set by the engine when the fused CPU kernels compute this model (models/fused.py)
        self.fused_kernels: CpuKernels | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Runs the decoder over a flat token batch.

        Args:
            input_ids: ``[T]`` token ids of every scheduled token.
            positions: ``[T]`` their positions in their sequences.
            backend: Attention over the paged KV cache.
            meta: Per-step attention metadata (slot mapping, block tables ...).

        Returns:
            ``[T, hidden]`` final hidden states (after the last norm).
        """
        if self.fused_kernels is not None:
            return fused_forward(self, self.fused_kernels, input_ids, positions, backend, meta)
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions)
        for layer in self.layers:
            h = layer(h, cos, sin, backend, meta)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, vocab]`` float32 logits."""
        if self.packed_logits is not None:  # see models/packed.py
            return self.packed_logits(hidden).float()
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()
