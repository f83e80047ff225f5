"""The engine's tokenizer: a ``tokenizers.Tokenizer`` plus special tokens and a chat template.

Built either from a Hugging Face directory (``tokenizer.json`` and
``tokenizer_config.json``) or from GGUF metadata (``tokenizer.ggml.*``), where a
byte-level BPE is assembled from the stored vocabulary and merges.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from kvtier.engine.chat_template import ChatTemplate
from kvtier.engine.errors import EngineConfigError, InvalidRequestError, ModelLoadError

# Pre-tokenizer split patterns by GGUF ``tokenizer.ggml.pre`` (the same
# patterns the models' own tokenizer.json files use).
_GPT2_PAT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_PAT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PAT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GGUF_TOKEN_NORMAL = 1
_GGUF_TOKEN_CONTROL = 3
_GGUF_TOKEN_USER_DEFINED = 4
_BYTE_TOKEN_RE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable character table."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table: dict[int, str] = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return {c: b for b, c in table.items()}


class Tokenizer:
    """Text <-> token ids, special tokens and chat rendering for one model.

    Thread-safety: ``encode``/``decode`` may be called from several threads
    (the underlying Rust tokenizer is immutable after construction).
    """

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: tuple[int, ...],
        add_bos_token: bool,
        chat_template: str | None,
    ) -> None:
        self._tok = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.add_bos_token = add_bos_token
        self._chat_template = ChatTemplate(chat_template) if chat_template else None
        self._byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        """The primary end-of-sequence token."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def bos_token(self) -> str:
        """The BOS token text ('' when the model has none)."""
        return self._id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str:
        """The EOS token text ('' when the model has none)."""
        return self._id_to_token(self.eos_token_id)

    @property
    def chat_template(self) -> str | None:
        """The raw chat template source, if the model ships one."""
        return self._chat_template.source if self._chat_template else None

    def _id_to_token(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self._tok.id_to_token(token_id) or ""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenizes ``text``.

        With ``add_special_tokens`` the model's BOS is prepended when the model
        wants one, but never twice (a prompt rendered from a chat template
        often starts with the BOS text already).
        """
        if not isinstance(text, str):
            raise InvalidRequestError("prompt text must be a string", "prompt")
        ids: list[int] = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id
        if add_special_tokens and bos is not None:
            if self.add_bos_token and (not ids or ids[0] != bos):
                ids.insert(0, bos)
            while len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
                ids.pop(0)
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Turns token ids back into text."""
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        """The raw vocabulary string of one token."""
        return self._id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token stands for."""
        piece = self._id_to_token(token_id)
        if self._byte_level:
            table = _byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return piece.encode("utf-8")
        m = _BYTE_TOKEN_RE.match(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Renders chat ``messages`` into prompt text with the model's template.

        Raises:
            InvalidRequestError: if the model has no chat template or the
                messages are malformed.
        """
        if self._chat_template is None:
            raise InvalidRequestError("this model has no chat template", "messages")
        return self._chat_template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **kwargs,
        )


def tokenizer_from_hf_dir(
    path: Path, eos_token_ids: tuple[int, ...], bos_token_id: int | None
) -> Tokenizer:
    """Loads ``tokenizer.json`` (+ ``tokenizer_config.json``) from a model directory.

    Raises:
        ModelLoadError: if ``tokenizer.json`` is missing or unreadable.
    """
    tj = path / "tokenizer.json"
    if not tj.is_file():
        raise ModelLoadError(f"{path} has no tokenizer.json")
    try:
        tok = HFTokenizer.from_file(str(tj))
    except Exception as e:  # the Rust library raises plain Exception subclasses
        raise ModelLoadError(f"cannot read {tj}: {e}") from e
    cfg: dict[str, Any] = {}
    tc = path / "tokenizer_config.json"
    if tc.is_file():
        try:
            cfg = json.loads(tc.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"cannot read {tc}: {e}") from e
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    jinja = path / "chat_template.jinja"
    if template is None and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")

    def token_id(entry: Any) -> int | None:
        if isinstance(entry, dict):
            entry = entry.get("content")
        if isinstance(entry, str):
            return tok.token_to_id(entry)
        return None

    bos = token_id(cfg.get("bos_token"))
    if bos is None:
        bos = bos_token_id
    eos_ids = eos_token_ids
    eos_from_cfg = token_id(cfg.get("eos_token"))
    if not eos_ids and eos_from_cfg is not None:
        eos_ids = (eos_from_cfg,)
    # NOTE: when tokenizer.json's post-processor adds BOS, add_bos_token stays
    # False here so it is not added twice; the flag covers tokenizers whose
    # post-processor does not (tokenizer_config.json "add_bos_token": true).
    encoded = tok.encode("a", add_special_tokens=True).ids
    post_adds_bos = bos is not None and bool(encoded) and encoded[0] == bos
    add_bos = bool(cfg.get("add_bos_token", False)) and not post_adds_bos
    return Tokenizer(
        tok,
        bos_token_id=bos,
        eos_token_ids=eos_ids,
        add_bos_token=add_bos,
        chat_template=template if isinstance(template, str) else None,
    )


def _gguf_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in (None, "default", "gpt2", "gpt-2"):
        split = pre_tokenizers.Split(Regex(_GPT2_PAT), behavior="isolated")
        return pre_tokenizers.Sequence([split, byte_level])
    if pre == "smollm":
        # HF's SmolLM tokenizer: single digits, then the GPT-2 byte-level split.
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.Split(Regex(_GPT2_PAT), behavior="isolated"),
                byte_level,
            ]
        )
    if pre in ("llama-bpe", "llama3", "smaug-bpe"):
        split = pre_tokenizers.Split(Regex(_LLAMA3_PAT), behavior="isolated")
        return pre_tokenizers.Sequence([split, byte_level])
    if pre in ("qwen2", "qwen3"):
        split = pre_tokenizers.Split(Regex(_QWEN2_PAT), behavior="isolated")
        return pre_tokenizers.Sequence([split, byte_level])
    raise EngineConfigError(
        f"unsupported GGUF pre-tokenizer {pre!r} (supported: gpt2, smollm, llama-bpe, qwen2); "
        "load the model from a Hugging Face directory instead"
    )


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece-BPE vocabulary.

    SentencePiece merges the adjacent pair whose concatenation is the
    highest-scoring piece; as BPE merges that is every split ``(left, right)``
    of a normal piece into two pieces of the vocabulary, ranked by the
    piece's score (ties: longer left part first, then longer right part,
    then vocabulary order) -- the same derivation transformers uses.
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    candidates: list[tuple[float, int, int, int, int, str, str]] = []
    for piece, score, kind in zip(tokens, scores, types, strict=True):
        if kind != _GGUF_TOKEN_NORMAL or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                candidates.append(
                    (-score, -len(left), -len(right), vocab[left], vocab[right], left, right)
                )
    candidates.sort()
    return [(c[5], c[6]) for c in candidates]


def _spm_tokenizer(meta: dict[str, Any]) -> tuple[HFTokenizer, bool]:
    """A byte-fallback BPE equivalent to a GGUF SentencePiece (``llama``) vocabulary."""
    tokens = meta.get("tokenizer.ggml.tokens")
    scores = meta.get("tokenizer.ggml.scores")
    if not tokens or scores is None or len(scores) != len(tokens):
        raise ModelLoadError("GGUF SentencePiece tokenizer lacks tokenizer.ggml.tokens/scores")
    types = meta.get("tokenizer.ggml.token_type") or [_GGUF_TOKEN_NORMAL] * len(tokens)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=_spm_merges(list(tokens), [float(x) for x in scores], list(types)),
        unk_token=tokens[int(unk_id)] if unk_id is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = HFTokenizer(bpe)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    # NOTE: llama.cpp adds BOS for SentencePiece vocabularies unless told otherwise.
    return tok, bool(meta.get("tokenizer.ggml.add_bos_token", True))


def _bpe_tokenizer(meta: dict[str, Any]) -> tuple[HFTokenizer, bool]:
    """A byte-level BPE from GGUF vocabulary and merges (``gpt2`` tokenizer model)."""
    tokens = meta.get("tokenizer.ggml.tokens")
    merges_raw = meta.get("tokenizer.ggml.merges")
    if not tokens or merges_raw is None:
        raise ModelLoadError("GGUF file lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in merges_raw]
    pre = meta.get("tokenizer.ggml.pre")
    bpe = models.BPE(
        vocab=vocab,
        merges=merges,
        fuse_unk=False,
        byte_fallback=False,
        ignore_merges=pre in ("llama-bpe", "llama3"),
    )
    tok = HFTokenizer(bpe)
    tok.pre_tokenizer = _gguf_pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    return tok, bool(meta.get("tokenizer.ggml.add_bos_token", False))


def tokenizer_from_gguf(meta: dict[str, Any], eos_token_ids: tuple[int, ...]) -> Tokenizer:
    """Builds the tokenizer described by GGUF ``tokenizer.ggml.*`` metadata.

    ``gpt2`` (byte-level BPE from the stored merges) and ``llama``
    (SentencePiece-BPE with byte fallback, merges derived from the scores).

    Raises:
        EngineConfigError: for tokenizer kinds this engine cannot rebuild.
        ModelLoadError: if required keys are missing.
    """
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tok, add_bos = _bpe_tokenizer(meta)
    elif kind == "llama":
        tok, add_bos = _spm_tokenizer(meta)
    else:
        raise EngineConfigError(
            f"GGUF tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' and "
            "SentencePiece 'llama' are); load the model from a Hugging Face directory instead"
        )
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [_GGUF_TOKEN_NORMAL] * len(tokens)
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types, strict=False)
        if ty == _GGUF_TOKEN_CONTROL
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, ty in zip(tokens, types, strict=False)
        if ty == _GGUF_TOKEN_USER_DEFINED
    ]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return Tokenizer(
        tok,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos_token_ids,
        add_bos_token=add_bos,
        chat_template=meta.get("tokenizer.chat_template"),
    )
