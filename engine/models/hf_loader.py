"""Reads a Hugging Face-style model directory (``config.json`` + ``*.safetensors``)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from kvtier.engine.errors import ModelLoadError
from kvtier.engine.models.config import ModelConfig, model_config_from_hf
from kvtier.engine.models.fingerprint import (
    Fingerprint,
    FingerprintJob,
    RawTensor,
    weights_fingerprint,
)

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_LAYER_MAP: dict[str, tuple[str, str | None]] = {
    "input_layernorm.weight": ("input_norm.weight", None),
    "post_attention_layernorm.weight": ("post_norm.weight", None),
    "self_attn.q_proj.weight": ("attn.qkv_proj.weight", "q"),
    "self_attn.k_proj.weight": ("attn.qkv_proj.weight", "k"),
    "self_attn.v_proj.weight": ("attn.qkv_proj.weight", "v"),
    "self_attn.q_proj.bias": ("attn.qkv_proj.bias", "q"),
    "self_attn.k_proj.bias": ("attn.qkv_proj.bias", "k"),
    "self_attn.v_proj.bias": ("attn.qkv_proj.bias", "v"),
    "self_attn.o_proj.weight": ("attn.o_proj.weight", None),
    "self_attn.o_proj.bias": ("attn.o_proj.bias", None),
    "self_attn.q_norm.weight": ("attn.q_norm.weight", None),
    "self_attn.k_norm.weight": ("attn.k_norm.weight", None),
    "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", "gate"),
    "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", "up"),
    "mlp.down_proj.weight": ("mlp.down_proj.weight", None),
}
_GLOBAL_MAP = {
    "model.embed_tokens.weight": "embed_tokens.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}


def map_hf_name(name: str) -> tuple[str, str | None] | None:
    """HF tensor name -> (engine parameter name, fused part), or None if unknown."""
    if name in _GLOBAL_MAP:
        return _GLOBAL_MAP[name], None
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER_MAP:
        suffix, part = _LAYER_MAP[m.group(2)]
        return f"layers.{m.group(1)}.{suffix}", part
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return data


class HFModelDir:
    """A model directory with ``config.json`` and one or more safetensors files.

    Raises:
        ModelLoadError: if the directory, its config or its weights are missing.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        cfg = self.path / "config.json"
        if not cfg.is_file():
            raise ModelLoadError(f"{self.path} has no config.json")
        self.config_dict = _read_json(cfg)
        gen = self.path / "generation_config.json"
        self.generation_config = _read_json(gen) if gen.is_file() else None
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ModelLoadError(f"{index} has no weight_map")
            self.files = sorted({self.path / f for f in weight_map.values()})
        else:
            self.files = sorted(self.path.glob("*.safetensors"))
        if not self.files:
            raise ModelLoadError(f"{self.path} has no *.safetensors weights")
        for f in self.files:
            if not f.is_file():
                raise ModelLoadError(f"weight shard missing: {f}")
        self.fingerprint_info: Fingerprint | None = None
        """How the fingerprint was obtained (bytes, seconds, cached), once computed."""

    def model_config(self) -> ModelConfig:
        """The model's ``ModelConfig``."""
        return model_config_from_hf(self.config_dict, self.generation_config)

    def _iter_raw(self) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import SafetensorError, safe_open

        for f in self.files:
            try:
                with safe_open(str(f), framework="pt") as sf:
                    for name in sf.keys():  # noqa: SIM118 - safe_open is not a dict
                        yield name, sf.get_tensor(name)
            except (SafetensorError, OSError) as e:
                raise ModelLoadError(f"cannot read {f}: {e}") from e

    def iter_weights(self, config: ModelConfig) -> Iterator[tuple[str, str | None, torch.Tensor]]:
        """Yields ``(engine name, fused part, tensor)`` for every weight.

        The fingerprint is computed on the way (one read of the files) unless
        the fingerprint cache knows these files; it is available from
        ``fingerprint()`` once the iterator is exhausted.

        Raises:
            ModelLoadError: for a tensor this engine does not know.
        """
        job = None if self.fingerprint_info else FingerprintJob(self.files, label=self.path.name)
        for name, t in self._iter_raw():
            if job is not None and job.needed:
                job.add(*_raw(name, t))
            if name.endswith("rotary_emb.inv_freq"):
                continue  # recomputed from the config
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue
            mapped = map_hf_name(name)
            if mapped is None:
                raise ModelLoadError(f"{self.path}: unexpected tensor {name}")
            yield mapped[0], mapped[1], t
        if job is not None:
            self.fingerprint_info = job.finish()

    def fingerprint(self) -> str:
        """Fingerprint over every byte of the stored tensors (``fingerprint.py``); reads them
        unless ``iter_weights`` ran or the fingerprint cache knows these files."""
        if self.fingerprint_info is None:
            self.fingerprint_info = weights_fingerprint(
                self.files,
                lambda: (_raw(n, t) for n, t in self._iter_raw()),
                label=self.path.name,
            )
        return self.fingerprint_info.digest


def _raw(name: str, t: torch.Tensor) -> RawTensor:
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    return name, str(t.dtype).removeprefix("torch."), tuple(t.shape), raw
