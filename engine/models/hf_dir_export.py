"""Writes a Hugging Face model directory from a model the engine loads (a GGUF file).

So that other engines (vLLM, transformers) serve exactly the weights this
engine runs: the GGUF tensors are dequantized as the engine does, the fused
Q/K/V and gate/up tensors split back (``hf_export.hf_state_dict``), and the
engine's tokenizer (a ``tokenizers`` BPE rebuilt from the GGUF vocabulary) is
saved as ``tokenizer.json``. The directory holds:

* ``config.json``: ``*ForCausalLM`` for the engine's ``ModelConfig``;
* ``model.safetensors``: the weights, bfloat16 or float32; tied embeddings stay
  tied (no ``lm_head.weight``);
* ``tokenizer.json`` and ``tokenizer_config.json`` (BOS/EOS, chat template);
* ``generation_config.json`` (BOS/EOS ids only: no sampling defaults);
* ``kvtier_export.json``: what it was exported from, so that exporting the
  same source again is a no-op, and an export made before the source, the
  exporter or the fingerprint scheme changed is replaced (without ``force``).

The directory is written next to its destination and renamed into place, so
a half-written export is never visible under the final name.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier.engine.errors import EngineConfigError, EngineError
from kvtier.engine.models.config import ModelConfig
from kvtier.engine.models.hf_export import hf_attention_biases, hf_state_dict
from kvtier.engine.tokenizer import Tokenizer

MARKER = "kvtier_export.json"
# Bumped when the exporter writes something different for the same source.
EXPORT_FORMAT = 1
EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


class ModelExportError(EngineError):
    """A model could not be exported (destination in the way, unwritable, unmappable model)."""


@dataclass(frozen=True)
class ExportResult:
    """What ``export_hf_dir`` did.

    Attributes:
        path: The model directory.
        written: False when the directory already held this export.
        dtype: Weights dtype in ``model.safetensors``.
        num_tensors: Tensors in ``model.safetensors``.
        weights_bytes: Size of ``model.safetensors``.
        fingerprint: Fingerprint of the source model (see ``fingerprint.py``).
    """

    path: Path
    written: bool
    dtype: str
    num_tensors: int
    weights_bytes: int
    fingerprint: str


def _json_float(x: float) -> float:
    """``x``, written as the shortest decimal of its float32 value when it is one.

    GGUF stores hyper-parameters as float32 (an RMSNorm epsilon of 1e-5 reads
    back as 9.99999974738e-06); the shortest decimal that is the same float32
    is what the model's own ``config.json`` said.
    """
    f32 = np.float32(x)
    return float(str(f32)) if float(f32) == x else x


def _token_ids(ids: tuple[int, ...]) -> int | list[int] | None:
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else list(ids)


def hf_config_dict(cfg: ModelConfig, dtype: str) -> dict[str, Any]:
    """``config.json`` for ``cfg`` (transformers 5 layout plus top-level ``rope_theta``).

    Raises:
        EngineConfigError: for per-frequency RoPE factors (GGUF ``rope_freqs``),
            which no ``rope_scaling`` entry expresses exactly.
    """
    if cfg.rope_freq_factors:
        raise EngineConfigError(
            "cannot export per-frequency RoPE factors (GGUF rope_freqs) to config.json"
        )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": _json_float(cfg.rope_theta)}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope.update(rope_type=s.kind, factor=_json_float(s.factor))
        if s.kind == "llama3":
            rope.update(
                low_freq_factor=_json_float(s.low_freq_factor),
                high_freq_factor=_json_float(s.high_freq_factor),
                original_max_position_embeddings=s.original_max_position_embeddings,
            )
    out: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[cfg.arch]],
        "model_type": cfg.arch,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": _json_float(cfg.rms_norm_eps),
        # NOTE: transformers 5 reads rope_parameters; rope_theta (and rope_scaling)
        # at the top level are for readers that predate it.
        "rope_theta": rope["rope_theta"],
        "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": _token_ids(cfg.eos_token_ids),
        "dtype": dtype,
        "use_cache": True,
    }
    if cfg.rope_scaling is not None:
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if cfg.arch in ("llama", "qwen3"):
        out["attention_bias"] = hf_attention_biases(cfg)[1]
    if cfg.arch == "llama":
        out["mlp_bias"] = False
    else:
        out["use_sliding_window"] = False
    return out


def hf_tokenizer_files(tokenizer: Tokenizer, cfg: ModelConfig) -> tuple[str, dict[str, Any]]:
    """``tokenizer.json`` text and the ``tokenizer_config.json`` dict for the engine's tokenizer.

    When the engine adds BOS itself (``add_bos_token``), ``tokenizer.json`` gets
    a post-processor that prepends it, so every reader of the file adds it too.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors

    # NOTE: the engine keeps its ``tokenizers`` object private (``_tok``); it is
    # copied through JSON here, so the engine's own tokenizer stays untouched.
    raw = HFTokenizer.from_str(tokenizer._tok.to_str())
    bos = tokenizer.bos_token if tokenizer.bos_token_id is not None else None
    if tokenizer.add_bos_token and bos:
        raw.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, int(tokenizer.bos_token_id or 0))],
        )
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": tokenizer.eos_token or None,
        "add_bos_token": tokenizer.add_bos_token,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg.max_position_embeddings,
    }
    if tokenizer.chat_template is not None:
        config["chat_template"] = tokenizer.chat_template
    return raw.to_str(pretty=True), config


def _marker(fingerprint: str, dtype: str) -> dict[str, Any]:
    return {"format": EXPORT_FORMAT, "source_fingerprint": fingerprint, "dtype": dtype}


def _existing_export(out_dir: Path, fingerprint: str, dtype: str) -> ExportResult | None:
    """The result of an identical earlier export in ``out_dir``, else None."""
    try:
        marker = json.loads((out_dir / MARKER).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(marker, dict):
        return None
    if any(marker.get(k) != v for k, v in _marker(fingerprint, dtype).items()):
        return None
    files = marker.get("files")
    if not isinstance(files, dict) or "model.safetensors" not in files:
        return None
    for name, size in files.items():
        f = out_dir / name
        if not f.is_file() or f.stat().st_size != size:
            return None
    return ExportResult(
        path=out_dir,
        written=False,
        dtype=dtype,
        num_tensors=int(marker.get("num_tensors", 0)),
        weights_bytes=int(files.get("model.safetensors", 0)),
        fingerprint=fingerprint,
    )


def _outdated_export(out_dir: Path, source: Path, dtype: str) -> bool:
    """Whether ``out_dir`` holds an earlier export of ``source`` in ``dtype`` that no longer matches.

    Such a directory is this exporter's own output for the same file, written
    before the file, the exporter format or the fingerprint scheme changed, or
    left damaged: replacing it loses nothing the user made.
    """
    try:
        marker = json.loads((out_dir / MARKER).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    return (
        isinstance(marker, dict)
        and marker.get("source") == str(source.resolve())
        and marker.get("dtype") == dtype
    )


def _source_fingerprint(source: Path) -> str:
    from kvtier.engine.models.gguf_loader import GGUFFile
    from kvtier.engine.models.hf_loader import HFModelDir

    return HFModelDir(source).fingerprint() if source.is_dir() else GGUFFile(source).fingerprint()


def export_hf_dir(
    source: str | Path, out_dir: str | Path, *, dtype: str = "bfloat16", force: bool = False
) -> ExportResult:
    """Writes a Hugging Face model directory holding the model at ``source``.

    Args:
        source: A ``.gguf`` file or a model directory the engine loads.
        out_dir: The directory to write; created, or replaced with ``force``.
        dtype: ``"bfloat16"`` or ``"float32"`` weights.
        force: Replace ``out_dir`` even when it holds something else. Without
            it, only an outdated or damaged export of the same source file in
            the same dtype is replaced.

    Returns:
        What was written; ``written`` is False when ``out_dir`` already held
        the same export (same source weights, dtype and exporter format).

    Raises:
        ModelExportError: if ``out_dir`` is a file or a non-empty directory
            holding something else (without ``force``), or cannot be written.
        ModelLoadError: if ``source`` cannot be read.
        EngineConfigError: if the model cannot be expressed as a transformers config.
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from kvtier.engine.models.loader import load_model

    if dtype not in EXPORT_DTYPES:
        raise ModelExportError(f"unsupported export dtype {dtype!r}; use bfloat16 or float32")
    source, out_dir = Path(source).expanduser(), Path(out_dir).expanduser()
    if out_dir.exists() and not out_dir.is_dir():
        raise ModelExportError(f"{out_dir} exists and is not a directory")
    fingerprint = _source_fingerprint(source)
    if out_dir.is_dir() and any(out_dir.iterdir()):
        same = _existing_export(out_dir, fingerprint, dtype)
        if same is not None:
            return same
        if not force and not _outdated_export(out_dir, source, dtype):
            raise ModelExportError(
                f"{out_dir} is not empty and holds no export of this model in {dtype}; "
                "choose another directory or pass --force to replace it"
            )
    loaded = load_model(source, EXPORT_DTYPES[dtype], torch.device("cpu"))
    cfg = loaded.config
    config = hf_config_dict(cfg, dtype)
    tokenizer_json, tokenizer_config = hf_tokenizer_files(loaded.tokenizer, cfg)
    # clone: the split Q/K/V and gate/up views share storage, which safetensors refuses
    tensors = {k: v.detach().clone().contiguous() for k, v in hf_state_dict(loaded.model).items()}
    del loaded
    generation = {"bos_token_id": cfg.bos_token_id, "eos_token_id": _token_ids(cfg.eos_token_ids)}

    tmp = out_dir.parent / f".{out_dir.name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()  # NOTE: not mkdtemp: the export gets the umask's modes, not 0700
    except OSError as e:
        raise ModelExportError(f"cannot create {out_dir.parent}: {e}") from e
    try:
        _write_json(tmp / "config.json", config)
        weights = tmp / "model.safetensors"
        save_file(tensors, str(weights), metadata={"format": "pt"})
        # safetensors creates the file 0600; give it the modes the JSON files got
        os.chmod(weights, (tmp / "config.json").stat().st_mode & 0o777)
        _write_json(tmp / "generation_config.json", generation)
        _write_json(tmp / "tokenizer_config.json", tokenizer_config)
        (tmp / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
        files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir())}
        marker = {
            **_marker(fingerprint, dtype),
            "source": str(source.resolve()),
            "num_tensors": len(tensors),
            "files": files,
        }
        _write_json(tmp / MARKER, marker)
        _replace_dir(tmp, out_dir)
    except (OSError, SafetensorError) as e:
        raise ModelExportError(f"cannot write {out_dir}: {e}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ExportResult(
        path=out_dir,
        written=True,
        dtype=dtype,
        num_tensors=len(tensors),
        weights_bytes=files["model.safetensors"],
        fingerprint=fingerprint,
    )


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _replace_dir(new: Path, target: Path) -> None:
    """Renames ``new`` to ``target``, moving an existing ``target`` aside first."""
    if not target.exists():
        new.rename(target)
        return
    old = target.parent / f".{target.name}.{uuid.uuid4().hex[:8]}.old"
    target.rename(old)
    try:
        new.rename(target)
    except OSError:
        old.rename(target)  # put the previous directory back
        raise
    shutil.rmtree(old, ignore_errors=True)
