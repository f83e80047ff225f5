"""The ``kvtier`` command line.

Core commands live here; the engine's and the server's commands are loaded
lazily from their packages (``kvtier.engine.cli``, ``kvtier.server.cli``), so
``kvtier --help`` stays fast and the core never imports engine code.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

import click

from kvtier.errors import ConfigError

# name -> (module, attribute, one-line help shown before the module is imported)
_LAZY_COMMANDS: dict[str, tuple[str, str, str]] = {
    "demo": (
        "kvtier.connectors.demo",
        "demo",
        "Prefix reuse across engines: engine A saves KV, a fresh engine B loads it.",
    ),
    "model": (
        "kvtier.engine.cli",
        "model",
        "Fetch and inspect model files (e.g. the default SmolLM2).",
    ),
    "generate": (
        "kvtier.engine.cli",
        "generate",
        "Generate text from a prompt with the bundled engine.",
    ),
    "chat": ("kvtier.engine.cli", "chat", "Chat with a model in the terminal."),
    "engine": ("kvtier.engine.cli", "engine", "Run the bundled engine (OpenAI-compatible server)."),
    "serve": (
        "kvtier.server.cli",
        "serve",
        "Run the standalone kvtier cache server (gRPC + dashboard).",
    ),
    "stats": ("kvtier.server.cli", "stats", "Print a cache server's hit rates and usage."),
    "router": (
        "kvtier.router.cli",
        "router",
        "Route OpenAI requests to engines by cached prefix and load; P/D disaggregation.",
    ),
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *_LAZY_COMMANDS])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        cmd = super().get_command(ctx, cmd_name)
        if cmd is not None or cmd_name not in _LAZY_COMMANDS:
            return cmd
        module, attr, _ = _LAZY_COMMANDS[cmd_name]
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            raise click.ClickException(
                f"`kvtier {cmd_name}` needs {e.name!r}: install the project with its extras "
                "(pip install -e '.[all]')"
            ) from None
        command = getattr(mod, attr, None)
        return command if isinstance(command, click.Command) else None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            if name in _LAZY_COMMANDS and name not in self.commands:
                rows.append((name, _LAZY_COMMANDS[name][2]))
            else:
                cmd = self.commands.get(name)
                if cmd is not None and not cmd.hidden:
                    rows.append((name, cmd.get_short_help_str(limit=80)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--log-level",
    default=lambda: os.environ.get("KVTIER_LOG_LEVEL", "WARNING"),
    show_default="WARNING",
)
@click.version_option(package_name="kvtier")
def main(log_level: str) -> None:
    """kvtier: shared, tiered KV cache for LLM inference.

    KV computed for a prompt prefix by one engine is stored once, addressed by
    its content, and loaded by any other engine instead of being recomputed.
    """
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    _tune_allocator(os.environ.get("KVTIER_MALLOC_RETAIN", "1GiB"))


def _tune_allocator(setting: str) -> None:
    """Keep freed memory for reuse: every KV block is a fresh multi-MB buffer (kvtier/allocator.py)."""
    from kvtier.allocator import retain_freed_memory
    from kvtier.units import parse_bytes

    try:
        limit = parse_bytes(setting)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="KVTIER_MALLOC_RETAIN") from None
    if limit:
        retain_freed_memory(limit)


@main.group("config")
def config_group() -> None:
    """Show or validate the kvtier configuration."""


@config_group.command("show")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    help="YAML file (default: $KVTIER_CONFIG or built-in defaults).",
)
def config_show(config_path: str | None) -> None:
    """Print the effective configuration (defaults + file + KVTIER_* overrides)."""
    from kvtier.config import dump_config, load_config

    try:
        click.echo(dump_config(load_config(config_path)), nl=False)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None


@config_group.command("validate")
@click.argument("path", type=click.Path(dir_okay=False))
def config_validate(path: str) -> None:
    """Check a configuration file; exit status 1 and every problem if it is invalid."""
    from kvtier.config import load_config

    try:
        cfg = load_config(path)
    except ConfigError as e:
        click.echo(str(e), err=True)
        sys.exit(1)
    tiers = ", ".join(f"{t.name} ({t.type})" for t in cfg.tiers)
    click.echo(f"{path}: valid — chunk_size {cfg.chunk_size}, tiers: {tiers}")


@main.command("store-demo")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    help="Store configuration (default: CPU + disk in a temporary directory).",
)
@click.option(
    "--requests", "num_requests", default=48, show_default=True, help="Requests in the workload."
)
@click.option("--seed", default=0, show_default=True)
def store_demo(config_path: str | None, num_requests: int, seed: int) -> None:
    """Store and reload a realistic KV workload through the CPU and disk tiers.

    Simulates requests that share long document prefixes (SmolLM2's KV
    shape), saves every computed chunk, loads every hit, then restarts the
    store to show that the disk tier keeps its blocks. Prints chunks, bytes,
    hit rates and throughput.
    """
    from kvtier.demo import run_store_demo

    try:
        run_store_demo(
            config_path=config_path, num_requests=num_requests, seed=seed, echo=click.echo
        )
    except ConfigError as e:
        raise click.ClickException(str(e)) from None


if __name__ == "__main__":  # pragma: no cover
    main()
