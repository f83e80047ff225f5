"""Greedy output with kvtier loads is the cold run's: random lengths and multi-round chats.

Random prompt lengths (not multiples of the 16-token block or of the chunk)
are loaded from the CPU tier and from the disk tier by a fresh engine; a
conversation's round r+1 re-sends round r's prompt, its answer and new user
text, and a new engine (a fresh store on the same disk directory, as a new
process would have) loads what round r saved, prompt and answer both. Every
figure asserted is the engine's own count of what it computed or loaded.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvtier.config import CpuTierConfig, DiskTierConfig, KvtierConfig
from kvtier.connectors.demo import document
from kvtier.connectors.kvtier_connector import KvtierConnector
from kvtier.engine import LLM, SamplingParams
from tests.engine.tiny_models import write_tiny_model

CHUNK = 32
BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ANSWER = SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, _ = write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=7)
    return path


def _llm(model: Path | str, connector: KvtierConnector | None = None, **kw: object) -> LLM:
    base: dict[str, object] = dict(dtype="float32", device="cpu", block_size=BLOCK, num_threads=1)
    base.update(kw)
    return LLM(str(model), connector=connector, **base)


def _config(root: Path, tier: str, chunk: int = CHUNK) -> KvtierConfig:
    tiers = (
        [CpuTierConfig(capacity=64 << 20)]
        if tier == "cpu"
        else [DiskTierConfig(path=root / "blocks", capacity=256 << 20)]
    )
    return KvtierConfig(chunk_size=chunk, tiers=tiers, connector={"min_load_tokens": BLOCK})


def _computed(llm: LLM) -> int:
    return llm.engine.stats().prompt_tokens_computed


def _random_prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths: list[int] = []
    while len(lengths) < count:
        n = rng.randrange(17, 400)
        if n % BLOCK:  # never block- (nor chunk-) aligned
            lengths.append(n)
    return [[rng.randrange(3, 380) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("tier", ["cpu", "disk"])
@pytest.mark.parametrize("seed", [3, 4])
def test_random_lengths_loaded_match_cold(
    model_dir: Path, tmp_path: Path, tier: str, seed: int
) -> None:
    prompts = _random_prompts(seed, 4)
    cold = [o.token_ids for o in _llm(model_dir).generate(prompts, GREEDY)]
    cfg = _config(tmp_path, tier)
    writer = KvtierConnector(config=cfg)
    a = _llm(model_dir, writer, enable_prefix_caching=False)
    assert [o.token_ids for o in a.generate(prompts, GREEDY)] == cold
    writer.flush()
    # disk: a new store over the same directory (what a new process sees); cpu: the same store
    conn = (
        KvtierConnector(config=cfg)
        if tier == "disk"
        else KvtierConnector(config=cfg, store=writer.store)
    )
    b = _llm(model_dir, conn, enable_prefix_caching=False)
    for p, want in zip(prompts, cold, strict=True):
        before = _computed(b)
        out = b.generate([p], GREEDY)[0]
        assert out.token_ids == want
        assert out.num_external_tokens == len(p) - 1  # all of the prompt but its last token
        assert _computed(b) - before == 1
    assert conn.stats.load_failures == 0
    if tier == "disk":
        hits = conn.metrics.value(
            "kvtier_tier_ops_total", {"tier": "disk", "op": "get", "outcome": "hit"}
        )
        assert hits > 0
    a.engine.shutdown()
    b.engine.shutdown()


def _conversation(
    model: Path | str,
    cfg: KvtierConfig,
    first: list[int],
    turns: list[list[int]],
    params: SamplingParams,
    **engine: object,
) -> list[tuple[list[int], list[int], int, int]]:
    """Plays the rounds, a new engine and connector each; (prompt, answer, loaded, computed) per round."""
    rounds = []
    prompt = first
    for r, turn in enumerate(turns):
        if r > 0:
            prompt = prompt + rounds[-1][1] + turn  # the history, its answer, the new user text
        conn = KvtierConnector(config=cfg)  # a fresh store: only what the disk holds is found
        llm = _llm(model, conn, **engine)
        out = llm.generate([prompt], params)[0]
        rounds.append((prompt, out.token_ids, out.num_external_tokens, _computed(llm)))
        llm.engine.shutdown()  # flushes this round's saves, the answer's included
    return rounds


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_multi_round_conversation_over_the_disk_tier_matches_cold(
    model_dir: Path, tmp_path: Path, seed: int
) -> None:
    rng = random.Random(seed)
    first = [rng.randrange(3, 380) for _ in range(rng.randrange(40, 200))]
    turns = [[]] + [[rng.randrange(3, 380) for _ in range(rng.randrange(3, 40))] for _ in range(3)]
    rounds = _conversation(model_dir, _config(tmp_path, "disk"), first, turns, ANSWER)
    cold = _llm(model_dir, enable_prefix_caching=False)
    for r, (prompt, answer, loaded, computed) in enumerate(rounds):
        assert answer == cold.generate([prompt], ANSWER)[0].token_ids, r
        assert loaded + computed == len(prompt)
        if r == 0:
            assert loaded == 0
            continue
        # the previous prompt and answer were stored, all but the answer's last token (never
        # fed back): loaded up to the last full block of that, at most G1's recompute more
        prev_prompt, prev_answer = rounds[r - 1][0], rounds[r - 1][1]
        stored = len(prev_prompt) + len(prev_answer) - 1
        assert loaded == (stored // BLOCK) * BLOCK, (r, loaded, stored)
        assert computed <= len(turns[r]) + BLOCK + 1


def test_conversations_in_one_engine_with_g1_and_kvtier_match_cold(
    model_dir: Path, tmp_path: Path
) -> None:
    """Several chats batched in one long-lived engine (G1 on) whose prefix cache is too small."""
    rng = random.Random(9)
    chats = [[rng.randrange(3, 380) for _ in range(rng.randrange(60, 200))] for _ in range(3)]
    conn = KvtierConnector(config=_config(tmp_path, "cpu"))
    # 24 blocks of 16 tokens: one chat at a time, which evicts the others' prefixes from G1
    llm = _llm(model_dir, conn, num_kv_blocks=24)
    cold = _llm(model_dir, enable_prefix_caching=False)
    loaded = 0
    for _ in range(3):
        outs = llm.generate(chats, ANSWER)
        want = [o.token_ids for o in cold.generate(chats, ANSWER)]
        assert [o.token_ids for o in outs] == want
        loaded += sum(o.num_external_tokens for o in outs)
        conn.flush()
        chats = [
            c + o.token_ids + [rng.randrange(3, 380) for _ in range(rng.randrange(3, 30))]
            for c, o in zip(chats, outs, strict=True)
        ]
    assert loaded > 0 and conn.stats.load_failures == 0
    llm.engine.shutdown()


@pytest.mark.smollm2
@pytest.mark.timeout(900)  # float32 on a loaded 2-core host
def test_smollm2_three_round_chat_over_the_disk_tier_matches_cold(
    smollm2: Path, tmp_path: Path
) -> None:
    cold = _llm(smollm2, enable_prefix_caching=False)
    tok = cold.engine.tokenizer
    doc = document()[:2000]
    first = tok.encode(
        tok.apply_chat_template(
            [{"role": "user", "content": f"{doc}\n\nQuestion: How tall is the lighthouse?"}],
            add_generation_prompt=True,
        ),
        add_special_tokens=False,
    )

    def user(text: str) -> list[int]:
        # the answers are cut at max_tokens (ignore_eos), so the turn closes the assistant's
        turn = f"<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
        return tok.encode(turn, add_special_tokens=False)

    turns = [[], user("When was it built?"), user("Who climbs its steps?")]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    rounds = _conversation(smollm2, _config(tmp_path, "disk", chunk=256), first, turns, params)
    for r, (prompt, answer, loaded, computed) in enumerate(rounds):
        assert answer == cold.generate([prompt], params)[0].token_ids, r
        if r > 0:
            stored = len(rounds[r - 1][0]) + len(rounds[r - 1][1]) - 1
            assert loaded == (stored // BLOCK) * BLOCK, (r, loaded, stored)
            assert computed == len(prompt) - loaded
