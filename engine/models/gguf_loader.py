"""Reads a GGUF file: metadata, dequantized weights, tokenizer and fingerprint."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier.engine.errors import ModelLoadError
from kvtier.engine.models.config import ModelConfig, model_config_from_gguf
from kvtier.engine.models.fingerprint import Fingerprint, RawTensor, weights_fingerprint

_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
# GGUF per-layer tensor name -> (engine parameter suffix, fused part)
_LAYER_MAP: dict[str, tuple[str, str | None]] = {
    "attn_norm.weight": ("input_norm.weight", None),
    "ffn_norm.weight": ("post_norm.weight", None),
    "attn_q.weight": ("attn.qkv_proj.weight", "q"),
    "attn_k.weight": ("attn.qkv_proj.weight", "k"),
    "attn_v.weight": ("attn.qkv_proj.weight", "v"),
    "attn_q.bias": ("attn.qkv_proj.bias", "q"),
    "attn_k.bias": ("attn.qkv_proj.bias", "k"),
    "attn_v.bias": ("attn.qkv_proj.bias", "v"),
    "attn_output.weight": ("attn.o_proj.weight", None),
    "attn_output.bias": ("attn.o_proj.bias", None),
    "attn_q_norm.weight": ("attn.q_norm.weight", None),
    "attn_k_norm.weight": ("attn.k_norm.weight", None),
    "ffn_gate.weight": ("mlp.gate_up_proj.weight", "gate"),
    "ffn_up.weight": ("mlp.gate_up_proj.weight", "up"),
    "ffn_down.weight": ("mlp.down_proj.weight", None),
}
_GLOBAL_MAP: dict[str, str] = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}


def map_gguf_name(name: str) -> tuple[str, str | None] | None:
    """GGUF tensor name -> (engine parameter name, fused part), or None if unknown."""
    if name in _GLOBAL_MAP:
        return _GLOBAL_MAP[name], None
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER_MAP:
        suffix, part = _LAYER_MAP[m.group(2)]
        return f"layers.{m.group(1)}.{suffix}", part
    return None


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row permutation for Llama-architecture GGUF files.

    llama.cpp's converter reorders each head's rows from HF's "rotate half"
    layout (first half, second half) to interleaved pairs; this restores HF's
    order so that the HF RoPE formulation applies.

    Args:
        w: ``[n_heads * head_dim, ...]`` weight (or bias) as stored in GGUF.
        n_heads: Query heads for Q, KV heads for K.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFFile:
    """An opened GGUF model file (memory-mapped).

    Raises:
        ModelLoadError: if the file is missing or not a readable GGUF file.
    """

    def __init__(self, path: str | Path) -> None:
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"model file not found: {self.path}")
        try:
            self._reader = gguf.GGUFReader(str(self.path))
        except (ValueError, OSError, KeyError) as e:
            raise ModelLoadError(f"cannot read GGUF file {self.path}: {e}") from e
        self._gguf = gguf
        self.meta: dict[str, Any] = {}
        for key, f in self._reader.fields.items():
            if key.startswith("GGUF."):
                continue
            self.meta[key] = f.contents()
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.fingerprint_info: Fingerprint | None = None
        """How the fingerprint was obtained (bytes, seconds, cached), once computed."""

    @property
    def tensor_names(self) -> list[str]:
        """Names of all tensors in the file."""
        return list(self._tensors)

    def model_config(self) -> ModelConfig:
        """The model's ``ModelConfig``."""
        emb = self._tensors.get("token_embd.weight")
        if emb is None:
            raise ModelLoadError(f"{self.path}: no token_embd.weight tensor")
        factors: tuple[float, ...] = ()
        if "rope_freqs.weight" in self._tensors:
            factors = tuple(float(x) for x in self.dequantize("rope_freqs.weight").reshape(-1))
        return model_config_from_gguf(
            self.meta,
            vocab_size=int(emb.shape[-1]),
            tie_word_embeddings="output.weight" not in self._tensors,
            qkv_bias="blk.0.attn_q.bias" in self._tensors,
            rope_freq_factors=factors,
        )

    def dequantize(self, name: str) -> np.ndarray:
        """One tensor as float32 in its logical (row-major) shape."""
        t = self._tensors[name]
        try:
            arr = self._gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ModelLoadError(
                f"{self.path}: tensor {name} uses unsupported type {t.tensor_type.name}"
            ) from e
        shape = tuple(int(d) for d in reversed(t.shape))
        return np.asarray(arr, dtype=np.float32).reshape(shape)

    def iter_weights(self, config: ModelConfig) -> Iterator[tuple[str, str | None, torch.Tensor]]:
        """Yields ``(engine name, fused part, float32 tensor)`` for every weight.

        Raises:
            ModelLoadError: for a tensor this engine does not know.
        """
        permuted = config.arch == "llama"
        for name in self._tensors:
            if name == "rope_freqs.weight":
                continue  # folded into ModelConfig.rope_freq_factors
            mapped = map_gguf_name(name)
            if mapped is None:
                raise ModelLoadError(f"{self.path}: unexpected tensor {name}")
            arr = self.dequantize(name)
            if permuted and name.endswith(("attn_q.weight", "attn_q.bias")):
                arr = unpermute_rope(arr, config.num_heads)
            elif permuted and name.endswith(("attn_k.weight", "attn_k.bias")):
                arr = unpermute_rope(arr, config.num_kv_heads)
            if not arr.flags.writeable or not arr.flags.c_contiguous:
                arr = np.array(arr, dtype=np.float32, order="C")  # own, writable copy
            yield mapped[0], mapped[1], torch.from_numpy(arr)

    def fingerprint(self) -> str:
        """Fingerprint over every byte of the stored (quantized) tensors (``fingerprint.py``)."""
        if self.fingerprint_info is None:
            self.fingerprint_info = weights_fingerprint(
                [self.path], self._raw_tensors, label=self.path.name
            )
        return self.fingerprint_info.digest

    def _raw_tensors(self) -> Iterator[RawTensor]:
        for t in self._tensors.values():
            raw = np.ascontiguousarray(t.data).reshape(-1).view(np.uint8)
            yield t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)), raw
