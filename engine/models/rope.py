"""Rotary position embeddings (NeoX/HF "rotate half" layout), with Llama 3 and linear scaling."""

from __future__ import annotations

import math

import torch

from kvtier.engine.models.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies of the model's RoPE, scaling applied.

    Returns:
        ``[head_dim // 2]`` float32, matching Hugging Face's computation.
    """
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    scaling = config.rope_scaling
    if scaling is not None and scaling.kind == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling is not None and scaling.kind == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    if config.rope_freq_factors:
        # GGUF files of Llama 3.1+ carry the scaling as per-frequency divisors.
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    return inv_freq


class RotaryEmbedding(torch.nn.Module):
    """Applies RoPE to Q and K from a precomputed cos/sin table.

    The table is built once for ``max_positions`` positions on the model's
    device; lookups are one ``index_select`` per step.
    """

    cos: torch.Tensor  # [max_positions, head_dim // 2]
    sin: torch.Tensor

    def __init__(self, config: ModelConfig, max_positions: int, dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config)
        pos = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(pos, inv_freq)  # [max_positions, head_dim // 2] float32
        # NOTE: like HF, the table is computed in float32 and then cast to the
        # activation dtype; the rotation itself runs in the activation dtype.
        self.register_buffer("cos", freqs.cos().to(dtype), persistent=False)
        self.register_buffer("sin", freqs.sin().to(dtype), persistent=False)
        self.max_positions = max_positions

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathers the table rows for ``positions`` ``[T]``; returns ``[T, 1, head_dim // 2]`` twice."""
        cos = self.cos.index_select(0, positions).unsqueeze(1)
        sin = self.sin.index_select(0, positions).unsqueeze(1)
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates ``x`` ``[T, heads, head_dim]`` with ``cos``/``sin`` ``[T, 1, head_dim // 2]``.

    Returns a new contiguous tensor: ``[x1*cos - x2*sin, x2*cos + x1*sin]``
    written straight into the two halves of the output (no ``cat``).
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-1.0)
    torch.mul(x2, cos, out=o2)
    o2.addcmul_(x1, sin)
    return out
