"""Assembles source tensors into the engine's (fused) parameter names."""

from __future__ import annotations

import torch

from kvtier.engine.errors import ModelLoadError
from kvtier.engine.models.config import ModelConfig

# Fused parameters and the order of their parts.
_FUSED_PARTS = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}


class WeightAssembler:
    """Collects tensors (``name``, optional fused ``part``) and builds a state dict.

    Each tensor is converted to the target dtype on arrival so that at most
    one float32 copy of a tensor is alive at a time.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        self.config = config
        self.dtype = dtype
        self._plain: dict[str, torch.Tensor] = {}
        self._parts: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, name: str, tensor: torch.Tensor, part: str | None = None) -> None:
        """Adds one tensor under the engine's parameter ``name`` (and fused ``part``)."""
        t = tensor.to(self.dtype)
        if part is None:
            if name in self._plain:
                raise ModelLoadError(f"tensor {name} appears twice")
            self._plain[name] = t
        else:
            self._parts.setdefault(name, {})[part] = t

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The complete state dict.

        Raises:
            ModelLoadError: if a fused parameter misses a part.
        """
        out = dict(self._plain)
        for name, parts in self._parts.items():
            kind = name.split(".")[-2]
            order = _FUSED_PARTS[kind]
            missing = [p for p in order if p not in parts]
            if missing:
                raise ModelLoadError(f"{name}: missing part(s) {', '.join(missing)}")
            out[name] = torch.cat([parts[p] for p in order], dim=0)
        self._plain.clear()
        self._parts.clear()
        return out


def check_state_dict(
    expected: dict[str, torch.Size], got: dict[str, torch.Tensor], source: str
) -> None:
    """Raises ``ModelLoadError`` naming missing, unexpected or mis-shaped tensors."""
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    if missing:
        raise ModelLoadError(f"{source}: missing tensors: {', '.join(missing[:8])}")
    if extra:
        raise ModelLoadError(f"{source}: unexpected tensors: {', '.join(extra[:8])}")
    for name, shape in expected.items():
        if tuple(got[name].shape) != tuple(shape):
            raise ModelLoadError(
                f"{source}: tensor {name} has shape {tuple(got[name].shape)}, expected {tuple(shape)}"
            )
