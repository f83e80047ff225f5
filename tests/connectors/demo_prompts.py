"""What two demo questions about one document share, in tokens (for the cross-process tests)."""

from __future__ import annotations

from pathlib import Path

from kvtier.connectors.demo import messages
from kvtier.engine.models.loader import load_tokenizer


def shared_chunk_tokens(model: Path, doc: str, question_a: str, question_b: str, chunk: int) -> int:
    """Tokens in the full chunks the two questions' chat prompts share.

    That is what engine B can load of what engine A stored: A's tails end
    after the questions part ways, so only whole chunks before it serve B.
    """
    tok = load_tokenizer(model)
    a, b = (
        tok.encode(tok.apply_chat_template(messages(q, doc)), add_special_tokens=False)
        for q in (question_a, question_b)
    )
    shared = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    return (shared // chunk) * chunk
