"""Load the server's configuration and its store's from one kvtier YAML file.

The file is an ordinary kvtier configuration whose ``server:`` section is a
:class:`~kvtier.server_config.ServerConfig`; :func:`kvtier.config.load_config`
loads all of it (``KVTIER_SERVER__*`` overrides included).

With no ``tiers:`` in the file, the server stores CPU + disk with the disk at
``~/.cache/kvtier/server/blocks`` — not the engines' default directory, so the
server's blocks do not share one capacity with the engines' (a disk tier
directory may be used by several processes at once).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from kvtier.config import (
    DEFAULT_CACHE_DIR,
    CpuTierConfig,
    DiskTierConfig,
    KvtierConfig,
    load_config,
)
from kvtier.errors import ConfigError
from kvtier.server_config import ServerConfig

SERVER_DISK_DIR = DEFAULT_CACHE_DIR / "server" / "blocks"


def _server_default_tiers() -> list[dict[str, Any]]:
    return [
        CpuTierConfig().model_dump(mode="json"),
        DiskTierConfig(path=SERVER_DISK_DIR).model_dump(mode="json"),
    ]


def _has_tiers(path: Path) -> bool:
    try:
        data = yaml.safe_load(path.expanduser().read_text())
    except (OSError, yaml.YAMLError):
        return True  # load_config reports the problem
    return not isinstance(data, dict) or "tiers" in data


def _format(e: ValidationError, source: str) -> str:
    lines = [f"invalid server configuration ({source}):"]
    for err in e.errors():
        loc = ".".join(["server", *(str(p) for p in err["loc"])])
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        lines.append(f"  {loc}: {msg.removeprefix('Value error, ')}")
    return "\n".join(lines)


def load_server_config(
    path: str | os.PathLike[str] | None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> tuple[ServerConfig, KvtierConfig]:
    """The server section and the store configuration of one file.

    Args:
        path: The YAML file; ``None``: ``$KVTIER_CONFIG`` if set, else defaults.
        env: Environment for ``KVTIER_*`` overrides (``os.environ`` by default).
        overrides: ``server:`` keys applied last (command-line flags).

    Raises:
        ConfigError: naming every bad key.
    """
    env = os.environ if env is None else env
    if path is None:
        path = env.get("KVTIER_CONFIG") or None
    source = str(path) if path is not None else "defaults"
    default_tiers = (path is None or not _has_tiers(Path(path))) and not any(
        k.startswith("KVTIER_TIERS__") for k in env
    )
    store = load_config(
        path, env=env, overrides={"tiers": _server_default_tiers()} if default_tiers else None
    )
    if store.metrics.port is not None:
        raise ConfigError(
            f"metrics.port ({store.metrics.port}) is for processes that run the KV connector; "
            "kvtier serve exposes /metrics on server.http_port — remove metrics.port"
        )
    try:
        # NOTE: only the keys the file set, so defaults that follow others (data_port
        # follows port 0) follow the flags too.
        server = ServerConfig.model_validate(
            {**store.server.model_dump(exclude_unset=True), **(overrides or {})}
        )
    except ValidationError as e:
        raise ConfigError(_format(e, source)) from None
    return server, store
