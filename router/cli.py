"""``kvtier router``: the command line of the router (loaded lazily by ``kvtier/cli.py``)."""

from __future__ import annotations

from typing import Any

import click

from kvtier.router.config import (
    POLICIES,
    EngineSpec,
    RouterConfig,
    RouterConfigError,
    VllmEventSource,
)

_CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


@click.command("router", context_settings=_CONTEXT)
@click.option("--engine", "engines", multiple=True, metavar="URL",
              help="An engine serving both prefill and decode (repeatable).")  # fmt: skip
@click.option("--prefill", "prefills", multiple=True, metavar="URL",
              help="A prefill engine (`kvtier engine serve --role prefill`; repeatable).")  # fmt: skip
@click.option("--decode", "decodes", multiple=True, metavar="URL",
              help="A decode engine (`kvtier engine serve --role decode`; repeatable).")  # fmt: skip
@click.option("--policy", type=click.Choice(POLICIES), default="cache_aware", show_default=True)
@click.option(
    "--model",
    "-m",
    default="smollm2",
    show_default=True,
    help="Tokenizer of the served model (known name, .gguf or HF directory); 'none' routes "
    "without prompt keys.",
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8100, show_default=True)
@click.option("--health-interval", type=click.FloatRange(min=0.05), default=1.0, show_default=True,
              help="Seconds between health checks of an engine.")  # fmt: skip
@click.option("--max-attempts", type=click.IntRange(min=1), default=3, show_default=True,
              help="Engines tried for one request before its first byte is sent.")  # fmt: skip
@click.option("--decode-cost-tokens", type=click.IntRange(min=0), default=256, show_default=True,
              help="cache_aware: a request in flight costs as much as this many prompt tokens.")  # fmt: skip
@click.option("--max-imbalance", type=click.IntRange(min=0), default=4, show_default=True,
              help="cache_aware: never pick an engine this many requests busier than the idlest.")  # fmt: skip
@click.option("--memory-wait-tokens", type=click.IntRange(min=0), default=16, show_default=True,
              help="cache_aware: an answer token a request waits for (G1 full) costs this many "
              "prompt tokens (0: G1 memory not weighed).")  # fmt: skip
@click.option("--no-kv-events", is_flag=True, help="Do not follow the engines' /kv_events.")
@click.option("--vllm-kv-events", "vllm_kv_events", multiple=True,
              metavar="URL=ENDPOINT[,replay=ENDPOINT][,topic=T][,namespace=FILE]",
              help="Follow a vLLM engine's KV events (its --kv-events-config ZMQ publisher) "
              "instead of /kv_events; repeatable (docs/router.md).")  # fmt: skip
@click.option("--tier-events", default=None, metavar="URL",
              help="Follow the cache server's /tier_events (its HTTP side): the shared tier's "
              "stores and evictions.")  # fmt: skip
@click.option("--tier-events-token", envvar="KVTIER_TIER_EVENTS_TOKEN", show_envvar=True,
              default=None, help="Bearer token for --tier-events.")  # fmt: skip
@click.option("--ttft-target", type=click.FloatRange(min=0, min_open=True), default=2.0,
              show_default=True, help="Scaling: the TTFT p99 (s) the recommended replica count "
              "aims for (GET /scaling, docs/fleet.md).")  # fmt: skip
@click.option("--min-replicas", type=click.IntRange(min=0), default=1, show_default=True)
@click.option("--max-replicas", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--target-utilization", type=click.FloatRange(0, 1, min_open=True), default=0.4,
              show_default=True, help="Scaling: share of measured prefill capacity to plan for.")  # fmt: skip
@click.option("--signals-window", type=click.FloatRange(min=0, min_open=True), default=30.0,
              show_default=True, help="Scaling: seconds of the signals' sliding window.")  # fmt: skip
@click.option("--no-failover", is_flag=True,
              help="Do not continue a stream whose engine is lost on another engine.")  # fmt: skip
@click.option("--stall-timeout", type=click.FloatRange(min=0, min_open=True), default=30.0,
              show_default=True, help="Failover: seconds of silence after which an engine "
              "streaming an answer is lost.")  # fmt: skip
@click.option("--max-failovers", type=click.IntRange(min=1), default=3, show_default=True,
              help="Failover: engines one stream may be continued on.")  # fmt: skip
@click.option("--warm-max-prefixes", type=click.IntRange(min=0), default=32, show_default=True,
              help="Warm-up: hottest prefixes an engine joining (POST /engines) loads first; "
              "0 turns warm-up off.")  # fmt: skip
@click.option("--warm-fraction", type=click.FloatRange(0, 1, min_open=True), default=0.5,
              show_default=True, help="Warm-up: share of the joining engine's G1 it may fill.")  # fmt: skip
@click.option("--warm-deadline", type=click.FloatRange(min=0, min_open=True), default=60.0,
              show_default=True, help="Warm-up: seconds after which the engine takes traffic.")  # fmt: skip
@click.option("--engine-api-key", envvar="KVTIER_ENGINE_API_KEY", show_envvar=True, default=None,
              help="Bearer token sent to the engines (default: the client's, passed on).")  # fmt: skip
@click.option("--api-key", envvar="KVTIER_ROUTER_API_KEY", show_envvar=True, default=None,
              help="Callers must send 'Authorization: Bearer KEY' (all but /health, /metrics); "
              "without it the router forwards anyone's requests with the engines' key.")  # fmt: skip
@click.option("--log-level", default="warning", show_default=True, help="uvicorn's log level.")
def router(**kw: Any) -> None:
    """An OpenAI-compatible router in front of kvtier engines (or vLLM).

    Sends each request to the engine that holds the longest prefix of its
    prompt in G1 (learned from the engines' KV events), weighed against load;
    takes engines that fail health checks out; retries a request on another
    engine before its first byte. With --prefill and --decode engines it runs
    prefill/decode disaggregation through the shared tier (docs/router.md).

    \b
    Example:
      kvtier router --engine http://127.0.0.1:8001 --engine http://127.0.0.1:8002
      kvtier router --prefill http://127.0.0.1:8001 --decode http://127.0.0.1:8002
    """
    from kvtier.engine.errors import EngineError
    from kvtier.router.app import create_router_app, serve_router
    from kvtier.router.prompt import load_router_tokenizer

    model = None if kw["model"].lower() == "none" else kw["model"]
    try:
        specs = [EngineSpec(u, "both") for u in kw["engines"]]
        specs += [EngineSpec(u, "prefill") for u in kw["prefills"]]
        specs += [EngineSpec(u, "decode") for u in kw["decodes"]]
        config = RouterConfig(
            engines=tuple(specs),
            policy=kw["policy"],
            model=model,
            health_interval_s=kw["health_interval"],
            max_attempts=kw["max_attempts"],
            decode_cost_tokens=kw["decode_cost_tokens"],
            max_imbalance=kw["max_imbalance"],
            memory_wait_tokens=kw["memory_wait_tokens"],
            kv_events=not kw["no_kv_events"],
            vllm_events=tuple(VllmEventSource.parse(v) for v in kw["vllm_kv_events"]),
            tier_events=kw["tier_events"],
            tier_events_token=kw["tier_events_token"],
            ttft_target_s=kw["ttft_target"],
            min_replicas=kw["min_replicas"],
            max_replicas=kw["max_replicas"],
            target_utilization=kw["target_utilization"],
            signals_window_s=kw["signals_window"],
            failover=not kw["no_failover"],
            stall_timeout_s=kw["stall_timeout"],
            max_failovers=kw["max_failovers"],
            warm_max_prefixes=kw["warm_max_prefixes"],
            warm_fraction=kw["warm_fraction"],
            warm_deadline_s=kw["warm_deadline"],
            engine_api_key=kw["engine_api_key"],
            api_key=_api_key(kw["api_key"]),
        )
    except RouterConfigError as e:
        raise click.UsageError(str(e)) from None
    try:
        tokenizer = load_router_tokenizer(model) if model is not None else None
    except EngineError as e:
        raise click.ClickException(f"cannot load the tokenizer of {model!r}: {e}") from None
    app = create_router_app(config, tokenizer)
    if config.api_key is None and config.engine_api_key is not None:
        click.echo(
            "warning: --engine-api-key without --api-key: anyone who reaches the router uses "
            "the engines with their key",
            err=True,
        )
    mode = "P/D" if config.disaggregated else config.policy
    click.echo(
        f"routing ({mode}) to {len(specs)} engines on http://{kw['host']}:{kw['port']} "
        "(OpenAI API under /v1; /health, /metrics, /scaling); Ctrl-C or SIGTERM stops",
        err=True,
    )
    try:
        serve_router(app, kw["host"], kw["port"], kw["log_level"])
    except OSError as e:
        raise click.ClickException(str(e)) from None


def _api_key(value: str | None) -> str | None:
    from kvtier.engine.server.auth import check_api_key

    if value is None:
        return None
    try:
        return check_api_key(value)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--api-key / $KVTIER_ROUTER_API_KEY") from None
