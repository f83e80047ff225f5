"""Writes GGUF files from transformers models, the way llama.cpp's converter lays them out.

Test-only: it exists so the engine's GGUF loader (including undoing the Q/K
row permutation of Llama-architecture files) is checked against transformers
on weights whose HF form is known exactly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

_HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (HF -> GGUF)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_name(hf_name: str) -> str | None:
    """HF tensor name -> GGUF tensor name."""
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    parts = hf_name.split(".", 3)
    if parts[:2] == ["model", "layers"]:
        return f"blk.{parts[2]}.{_HF_TO_GGUF[parts[3]]}"
    return None


def write_gguf(
    model: Any,
    tokenizer_dir: Path | None,
    out: Path,
    qtypes: dict[str, Any] | None = None,
    spm_vocab: list[tuple[str, float, int]] | None = None,
) -> dict[str, torch.Tensor]:
    """Writes ``model`` (transformers, fp32) as GGUF; returns the HF state dict as stored.

    Args:
        model: A transformers Llama/Qwen2/Qwen3 causal LM.
        tokenizer_dir: Directory with the model's ``tokenizer.json`` (byte-level BPE).
        out: The ``.gguf`` path.
        qtypes: GGUF tensor-name suffix -> ``GGMLQuantizationType`` (default F32).
        spm_vocab: Instead of ``tokenizer_dir``: a SentencePiece vocabulary
            ``(piece, score, token_type)`` written as a ``llama`` tokenizer
            (unk 0, bos 1, eos 2).

    Returns:
        The HF-named state dict after quantize -> dequantize, i.e. exactly the
        weights a correct loader must reproduce.
    """
    import gguf

    cfg = model.config
    arch = cfg.model_type
    w = gguf.GGUFWriter(str(out), arch)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)

    if spm_vocab is not None:
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list([p for p, _, _ in spm_vocab])
        w.add_token_scores([s for _, s, _ in spm_vocab])
        w.add_token_types([t for _, _, t in spm_vocab])
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
    else:
        assert tokenizer_dir is not None
        tj = json.loads((tokenizer_dir / "tokenizer.json").read_text())
        vocab = tj["model"]["vocab"]
        for added in tj.get("added_tokens", []):
            vocab[added["content"]] = added["id"]
        tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
        specials = {a["content"] for a in tj.get("added_tokens", []) if a.get("special")}
        merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt2")
        w.add_token_list(tokens)
        w.add_token_types([3 if t in specials else 1 for t in tokens])
        w.add_token_merges(merges)
        w.add_eos_token_id(cfg.eos_token_id)
        w.add_add_bos_token(False)
        tc = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
        w.add_chat_template(tc["chat_template"])

    stored: dict[str, torch.Tensor] = {}
    qtypes = qtypes or {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        gname = gguf_name(name)
        assert gname is not None, name
        arr = t.detach().float().numpy()
        if arch == "llama" and gname.endswith(("attn_q.weight", "attn_q.bias")):
            arr = llama_cpp_permute(arr, cfg.num_attention_heads)
        elif arch == "llama" and gname.endswith(("attn_k.weight", "attn_k.bias")):
            arr = llama_cpp_permute(arr, cfg.num_key_value_heads)
        qtype = next((q for suffix, q in qtypes.items() if gname.endswith(suffix)), None)
        if qtype is None or arr.ndim == 1:
            w.add_tensor(gname, np.ascontiguousarray(arr, dtype=np.float32))
            stored[name] = t.detach().float().clone()
            continue
        q = gguf.quants.quantize(np.ascontiguousarray(arr, dtype=np.float32), qtype)
        w.add_tensor(gname, q, raw_dtype=qtype)
        deq = gguf.quants.dequantize(q, qtype).reshape(arr.shape).astype(np.float32)
        if arch == "llama" and gname.endswith("attn_q.weight"):
            deq = _unpermute(deq, cfg.num_attention_heads)
        elif arch == "llama" and gname.endswith("attn_k.weight"):
            deq = _unpermute(deq, cfg.num_key_value_heads)
        stored[name] = torch.from_numpy(np.ascontiguousarray(deq))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # inverse of llama_cpp_permute, by brute force over the row index map
    rows = np.arange(w.shape[0])
    perm = llama_cpp_permute(rows, n_head)
    out = np.empty_like(w)
    out[perm] = w
    return out
