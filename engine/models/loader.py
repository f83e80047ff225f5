"""Loads a model (weights, config, tokenizer, identity) from a GGUF file or an HF directory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvtier.engine.errors import ModelLoadError
from kvtier.engine.models.config import ModelConfig
from kvtier.engine.models.gguf_loader import GGUFFile
from kvtier.engine.models.hf_loader import HFModelDir
from kvtier.engine.models.llama import DecoderModel
from kvtier.engine.models.rope import RotaryEmbedding
from kvtier.engine.models.weights import WeightAssembler, check_state_dict
from kvtier.engine.tokenizer import Tokenizer, tokenizer_from_gguf, tokenizer_from_hf_dir


@dataclass
class LoadedModel:
    """A ready-to-run model and what identifies it.

    Attributes:
        model: The decoder, in eval mode, on its device.
        config: Its hyper-parameters.
        tokenizer: Tokenizer and chat template from the same source.
        model_id: A readable name (file stem or directory name).
        fingerprint: Hex digest of the source weights (see ``fingerprint.py``).
    """

    model: DecoderModel
    config: ModelConfig
    tokenizer: Tokenizer
    model_id: str
    fingerprint: str


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Loads only the tokenizer (and chat template) of a model, without its weights.

    Raises:
        ModelLoadError: if the files are missing or unreadable.
        EngineConfigError: if the tokenizer kind is unsupported.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        source = HFModelDir(p)
        config = source.model_config()
        return tokenizer_from_hf_dir(p, config.eos_token_ids, config.bos_token_id)
    if p.is_file() and p.suffix.lower() == ".gguf":
        gguf_file = GGUFFile(p)
        return tokenizer_from_gguf(gguf_file.meta, gguf_file.model_config().eos_token_ids)
    if p.exists():
        raise ModelLoadError(f"{p} is neither a .gguf file nor a model directory")
    raise ModelLoadError(f"model not found: {p}")


def load_model(
    path: str | Path, dtype: torch.dtype, device: torch.device, max_positions: int | None = None
) -> LoadedModel:
    """Loads a Llama-family model.

    Args:
        path: A ``.gguf`` file or a directory with ``config.json`` + safetensors.
        dtype: Parameter dtype (``torch.bfloat16`` or ``torch.float32``).
        device: Where the parameters live.
        max_positions: Size of the RoPE table; default the model's context length.

    Raises:
        ModelLoadError: if the files are missing or unreadable.
        EngineConfigError: if the model uses an unsupported feature.
    """
    p = Path(path).expanduser()
    source: GGUFFile | HFModelDir
    if p.is_dir():
        source = HFModelDir(p)
        config = source.model_config()
        tokenizer = tokenizer_from_hf_dir(p, config.eos_token_ids, config.bos_token_id)
        model_id = p.name
    elif p.is_file() and p.suffix.lower() == ".gguf":
        source = GGUFFile(p)
        config = source.model_config()
        tokenizer = tokenizer_from_gguf(source.meta, config.eos_token_ids)
        model_id = p.stem
    elif p.exists():
        raise ModelLoadError(f"{p} is neither a .gguf file nor a model directory")
    else:
        # Not a path: a known model name ("smollm2") resolves to its fetched file.
        from kvtier.engine.fetch import ModelNotFoundError, lookup_known, resolve_model

        if lookup_known(str(path)) is None:
            raise ModelLoadError(f"model not found: {p}")
        try:
            resolved = resolve_model(str(path))
        except ModelNotFoundError as e:
            raise ModelLoadError(str(e)) from None
        return load_model(resolved, dtype, device, max_positions)
    if not config.eos_token_ids and tokenizer.eos_token_ids:
        from dataclasses import replace

        config = replace(config, eos_token_ids=tokenizer.eos_token_ids)

    positions = max_positions or config.max_position_embeddings
    with torch.device("meta"):
        model = DecoderModel(config, positions, dtype)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    asm = WeightAssembler(config, dtype)
    for name, part, tensor in source.iter_weights(config):
        asm.add(name, tensor, part)
    state = asm.state_dict()
    check_state_dict(expected, state, str(p))
    model.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=True, assign=True)
    model.rotary = RotaryEmbedding(config, positions, dtype).to(device)
    model.eval().requires_grad_(False)
    return LoadedModel(
        model=model,
        config=config,
        tokenizer=tokenizer,
        model_id=model_id,
        fingerprint=source.fingerprint(),
    )
