"""``kvtier demo``: KV computed by one engine process is loaded by another.

1. Engine process A (cold) reads a ~2,200-token document and answers a
   question; the kvtier connector saves the prompt's chunks to the disk tier.
2. Engine process B starts fresh (empty G1 cache) on the same directory and
   is asked a different question about the same document: the shared prefix
   is loaded from kvtier instead of being recomputed.

The orchestrator prints TTFT cold vs. warm, tokens loaded, bytes moved, hit
rates and both answers. Each engine runs in its own process, as two
replicas of a fleet would. Both processes are warmed alike before anything
is timed (a prompt of the same length that shares no prefix with the real
one, run twice), so the TTFT ratio is the cache's, not one process's
first-call set-up; the figures count the timed request alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Any

import click

from kvtier.units import format_bytes

QUESTIONS = (
    "How tall is the lighthouse tower, and when was it built?",
    "How many steps does the keeper climb every morning, and what does he check?",
)
SYSTEM = (
    "You answer questions about the document the user gives you. Answer in one or two sentences."
)

_DEMO_CONFIG = """\
chunk_size: {chunk_size}
tiers:
  - {{type: cpu, capacity: 512MiB}}
  - {{type: disk, path: {path}, capacity: 4GiB}}
connector:
  min_load_tokens: {chunk_size}
"""


def document(path: str | None = None) -> str:
    """The demo's document: the one shipped with the package unless ``path`` is given."""
    if path is not None:
        return Path(path).read_text()
    return resources.files("kvtier.connectors").joinpath("data/demo_document.md").read_text()


def messages(question: str, doc: str) -> list[dict[str, str]]:
    """Document first, question last: every question shares the document's prefix."""
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"{doc}\n\nQuestion: {question}"},
    ]


def default_model_path() -> Path:
    root = os.environ.get("KVTIER_MODEL_DIR")
    return (
        Path(root) if root else Path("~/.cache/kvtier/models").expanduser()
    ) / "SmolLM2-135M-Instruct.Q4_1.gguf"


# NOTE: counters that the demo reports for the timed request alone (the warm-up's are subtracted).
_CONN_STATS = (
    "lookup_tokens",
    "hit_tokens",
    "loaded_tokens",
    "bytes_loaded",
    "load_seconds",
    "load_failures",
)
_SAVE_STATS = ("chunks_saved", "bytes_saved")


def _counters(conn: Any) -> dict[str, float]:
    out = {name: getattr(conn.stats, name) for name in _CONN_STATS}
    out.update({name: getattr(conn.save_stats, name) for name in _SAVE_STATS})
    for tier in ("cpu", "disk"):
        out[f"{tier}_hits"] = conn.metrics.value(
            "kvtier_tier_ops_total", {"tier": tier, "op": "get", "outcome": "hit"}
        )
    return out


def warmup_prompt(prompt: list[int], first_token: int) -> list[int]:
    """A prompt of the same length (so the same shapes) that shares no prefix with ``prompt``."""
    return [first_token, *prompt[1:]]


def run_worker(
    model: str,
    config_path: str,
    question: str,
    max_tokens: int,
    document_path: str | None = None,
    warmup_token: int = 3,
) -> dict[str, Any]:
    """One engine process: answer ``question`` with the kvtier connector, report what happened.

    Before anything is timed the engine runs a warm-up prompt of the same
    length twice (cold, then a hit in its own cache; two tokens each), so the
    timed request pays no first-call set-up in either process. Each process
    gets its own ``warmup_token``, so a warm-up never loads another's.
    """
    from kvtier.engine import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, kv_connector="kvtier", kv_connector_config=config_path)
    load_s = time.perf_counter() - t0
    tok = llm.engine.tokenizer
    text = tok.apply_chat_template(
        messages(question, document(document_path)), add_generation_prompt=True
    )
    prompt = tok.encode(text, add_special_tokens=False)
    conn = llm.engine.connector
    warm = warmup_prompt(prompt, warmup_token)
    t0 = time.perf_counter()
    for _ in range(2):
        llm.generate([warm], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    conn.flush()
    warmup_s = time.perf_counter() - t0
    before = _counters(conn)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]
    conn.flush()
    after = _counters(conn)
    report: dict[str, Any] = {
        "question": question,
        "answer": out.text.strip(),
        "prompt_tokens": out.num_prompt_tokens,
        "external_tokens": out.num_external_tokens,
        "cached_tokens": out.num_cached_tokens,
        "ttft_s": out.ttft_s,
        "model_load_s": load_s,
        "warmup_s": warmup_s,
    }
    report.update({name: after[name] - before[name] for name in after})
    llm.engine.shutdown()
    return report


def _spawn(
    model: str,
    config_path: str,
    question: str,
    max_tokens: int,
    document_path: str | None,
    label: str,
    warmup_token: int,
) -> dict[str, Any]:
    click.echo(f"[{label}] starting a fresh engine process ...", err=True)
    cmd = [
        sys.executable,
        "-m",
        "kvtier.connectors.demo",
        "--model",
        model,
        "--config",
        config_path,
    ]
    cmd += ["--question", question, "--max-tokens", str(max_tokens)]
    cmd += ["--warmup-token", str(warmup_token)]
    if document_path is not None:
        cmd += ["--document", document_path]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if proc.returncode != 0 or not lines:
        raise click.ClickException(f"engine process {label} failed (exit {proc.returncode})")
    return json.loads(lines[-1])


def _gbps(r: dict[str, Any]) -> str:
    return f"{r['bytes_loaded'] / r['load_seconds'] / 1e9:.2f} GB/s" if r["load_seconds"] else "-"


def _pct(a: float, b: float) -> str:
    return f"{a / b:.0%}" if b else "-"


def print_report(a: dict[str, Any], b: dict[str, Any], echo: Any = click.echo) -> None:
    rows = [
        ("prompt tokens", a["prompt_tokens"], b["prompt_tokens"]),
        ("loaded from kvtier", a["loaded_tokens"], b["loaded_tokens"]),
        (
            "computed (prefill)",
            a["prompt_tokens"] - a["loaded_tokens"] - a["cached_tokens"],
            b["prompt_tokens"] - b["loaded_tokens"] - b["cached_tokens"],
        ),
        ("TTFT", f"{a['ttft_s']:.2f} s", f"{b['ttft_s']:.2f} s"),
        (
            "lookup hit rate",
            _pct(a["hit_tokens"], a["lookup_tokens"]),
            _pct(b["hit_tokens"], b["lookup_tokens"]),
        ),
        (
            "load hit rate",
            _pct(a["loaded_tokens"], a["lookup_tokens"]),
            _pct(b["loaded_tokens"], b["lookup_tokens"]),
        ),
        ("KV bytes loaded", format_bytes(a["bytes_loaded"]), format_bytes(b["bytes_loaded"])),
        ("load time", f"{a['load_seconds'] * 1e3:.0f} ms", f"{b['load_seconds'] * 1e3:.0f} ms"),
        ("load throughput", _gbps(a), _gbps(b)),
        (
            "blocks hit (cpu / disk)",
            f"{a['cpu_hits']:.0f} / {a['disk_hits']:.0f}",
            f"{b['cpu_hits']:.0f} / {b['disk_hits']:.0f}",
        ),
        (
            "chunks saved",
            f"{a['chunks_saved']} ({format_bytes(a['bytes_saved'])})",
            f"{b['chunks_saved']} ({format_bytes(b['bytes_saved'])})",
        ),
    ]
    w0 = max(len(r[0]) for r in rows)
    head_a, head_b = "engine A (cold)", "engine B (fresh process, kvtier)"
    w1 = max(len(head_a), *(len(str(r[1])) for r in rows))
    echo("")
    echo(f"{'':<{w0}}  {head_a:<{w1}}  {head_b}")
    for name, va, vb in rows:
        echo(f"{name:<{w0}}  {va!s:<{w1}}  {vb}")
    if b["ttft_s"]:
        echo(
            f"\nTTFT: {a['ttft_s'] / b['ttft_s']:.1f}x faster in B, which loaded {b['loaded_tokens']} of its {b['prompt_tokens']} prompt tokens from kvtier."
        )
    echo(
        f"Both processes first ran an unrelated prompt of the same length twice "
        f"(A {a['warmup_s']:.1f} s, B {b['warmup_s']:.1f} s); the figures above are the timed request's."
    )
    for label, r in (("A", a), ("B", b)):
        echo(f"\n[{label}] Q: {r['question']}\n[{label}] A: {r['answer']}")


def run_demo(
    model: str | None,
    max_tokens: int = 48,
    keep_dir: str | None = None,
    *,
    document_path: str | None = None,
    chunk_size: int = 256,
    echo: Any = click.echo,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run engines A then B in their own processes and print the comparison."""
    path = Path(model) if model else default_model_path()
    if not path.exists():
        raise click.ClickException(
            f"model file {path} not found; run `kvtier model fetch smollm2` first"
        )
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-") as tmp:
        root = Path(keep_dir) if keep_dir else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        cfg = root / "kvtier.yaml"
        cfg.write_text(_DEMO_CONFIG.format(path=root / "blocks", chunk_size=chunk_size))
        click.echo(
            f"kvtier demo: {path.name}, kvtier CPU + disk tier at {root / 'blocks'} ({cfg})",
            err=True,
        )
        a = _spawn(str(path), str(cfg), QUESTIONS[0], max_tokens, document_path, "A", 3)
        b = _spawn(str(path), str(cfg), QUESTIONS[1], max_tokens, document_path, "B", 4)
    print_report(a, b, echo)
    return a, b


@click.command("demo")
@click.option(
    "--model", default=None, help="GGUF file or model directory (default: the fetched SmolLM2)."
)
@click.option("--max-tokens", default=48, show_default=True)
@click.option(
    "--dir",
    "keep_dir",
    default=None,
    help="Keep the kvtier tier directory here instead of a temporary one.",
)
def demo(model: str | None, max_tokens: int, keep_dir: str | None) -> None:
    """Prefix reuse across engine processes: cold engine A saves, fresh engine B loads.

    A reads a long document and answers a question; B, a new process with an
    empty cache, answers another question about the same document and loads
    the document's KV from kvtier's disk tier instead of recomputing it.
    """
    run_demo(model, max_tokens, keep_dir)


@click.command()
@click.option("--model", required=True)
@click.option("--config", "config_path", required=True)
@click.option("--question", required=True)
@click.option("--max-tokens", default=48)
@click.option("--document", "document_path", default=None)
@click.option("--warmup-token", default=3)
def _worker(
    model: str,
    config_path: str,
    question: str,
    max_tokens: int,
    document_path: str | None,
    warmup_token: int,
) -> None:
    from kvtier.allocator import retain_freed_memory

    retain_freed_memory(1 << 30)  # a process entry point, as the kvtier command line does
    report = run_worker(model, config_path, question, max_tokens, document_path, warmup_token)
    click.echo(json.dumps(report))


if __name__ == "__main__":
    _worker()
