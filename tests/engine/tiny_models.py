"""Tiny random-weight Llama / Qwen2 / Qwen3 checkpoints and a Hugging Face greedy reference.

The checkpoints are written with transformers' own config classes and
``save_pretrained`` (safetensors), with a small byte-level BPE tokenizer, so the
engine loads them exactly as it would load a real model directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Héllo wörld, naïve café, 日本語のテキスト, emoji 🤖🚀 and numbers 12345.",
    "def forward(self, x):\n    return self.linear(x) + 1\n",
] * 4


def build_tokenizer(out_dir: Path, vocab_size: int = 384) -> int:
    """Trains a tiny byte-level BPE, writes tokenizer files; returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "chat_template": CHATML,
                "add_bos_token": False,
            }
        )
    )
    return tok.get_vocab_size(with_added_tokens=True)


def hf_config(arch: str, vocab_size: int, **overrides: Any) -> Any:
    """A tiny transformers config for ``arch`` (llama, qwen2, qwen3)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        common.setdefault("head_dim", 24)
        return Qwen3Config(**common)
    raise ValueError(arch)


def random_model(config: Any, seed: int) -> Any:
    """A transformers causal LM with random, deliberately non-trivial weights (fp32)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                # NOTE: norms start at exactly 1; perturb them so a missing
                # or misplaced norm (e.g. Qwen3's QK-norm) changes the output.
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                # Larger than the default init so next-token distributions
                # are peaked and argmax is not decided by rounding noise.
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def write_tiny_model(
    out_dir: Path, arch: str, seed: int = 0, shard: bool = False, **overrides: Any
) -> tuple[Path, Any]:
    """Writes a tiny checkpoint + tokenizer into ``out_dir``; returns (dir, HF model)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out_dir)
    model = random_model(hf_config(arch, vocab, **overrides), seed)
    kwargs: dict[str, Any] = {"max_shard_size": "60KB"} if shard else {}
    model.save_pretrained(out_dir, **kwargs)
    return out_dir, model


@torch.no_grad()
def hf_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens from transformers with its own KV cache (no logits processors)."""
    ids = torch.tensor([prompt])
    out = model(input_ids=ids, use_cache=True)
    past = out.cache
    tokens: list[int] = []
    nxt = int(out.logits[0, -1].argmax())
    for _ in range(n):
        tokens.append(nxt)
        if len(tokens) == n:
            break
        out = model(input_ids=torch.tensor([[nxt]]), cache=past, use_cache=True)
        past = out.cache
        nxt = int(out.logits[0, -1].argmax())
    return tokens


@torch.no_grad()
def hf_logits(model: Any, prompt: list[int]) -> torch.Tensor:
    """``[len(prompt), vocab]`` float32 logits of every prompt position."""
    return model(input_ids=torch.tensor([prompt])).logits[0].float()
