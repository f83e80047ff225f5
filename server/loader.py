"""Load the server's configuration and its store's from one kvtier YAML file.

The file is an ordinary kvtier configuration with a ``server:`` section
(:class:`~kvtier.server.config.ServerConfig`). When the top-level
:class:`~kvtier.config.KvtierConfig` has a ``server`` field, the whole file is
loaded by :func:`kvtier.config.load_config` (``KVTIER_SERVER__*`` overrides
included). Until then the ``server:`` section is split off here and validated
on its own, and the rest goes through ``load_config``.

With no ``tiers:`` in the file, the server stores CPU + disk with the disk at
``~/.cache/kvtier/server/blocks`` — not the engines' default directory, since
two processes must not share one disk tier on a host.
"""

from __future__ import annotations

import os
import tempfile
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
from kvtier.server.config import ServerConfig

SERVER_DISK_DIR = DEFAULT_CACHE_DIR / "server" / "blocks"


def _server_default_tiers() -> list[dict[str, Any]]:
    return [
        CpuTierConfig().model_dump(mode="json"),
        DiskTierConfig(path=SERVER_DISK_DIR).model_dump(mode="json"),
    ]


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.expanduser().read_text()
    except OSError as e:
        raise ConfigError(f"cannot read configuration file {path}: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"configuration file {path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"configuration file {path} must hold a mapping at the top level")
    return data


def _format(e: ValidationError, source: str) -> str:
    lines = [f"invalid server configuration ({source}):"]
    for err in e.errors():
        loc = ".".join(["server", *(str(p) for p in err["loc"])])
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        lines.append(f"  {loc}: {msg.removeprefix('Value error, ')}")
    return "\n".join(lines)


def _load_store(data: dict[str, Any], env: Mapping[str, str], source: str) -> KvtierConfig:
    """``load_config`` of the file without its ``server:`` section (same precedence: file < env)."""
    with tempfile.TemporaryDirectory(prefix="kvtier-serve-") as tmp:
        rest = Path(tmp) / "store.yaml"
        rest.write_text(yaml.safe_dump(data))
        try:
            return load_config(rest, env=env)
        except ConfigError as e:
            raise ConfigError(str(e).replace(str(rest), source)) from None


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
    data = _read_yaml(Path(path)) if path is not None else {}
    source = str(path) if path is not None else "defaults"
    default_tiers = "tiers" not in data and not any(k.startswith("KVTIER_TIERS__") for k in env)

    if "server" in KvtierConfig.model_fields:
        # The integrated configuration: one load, one set of environment overrides.
        full = load_config(
            path, env=env, overrides={"tiers": _server_default_tiers()} if default_tiers else None
        )
        server = getattr(full, "server", None)
        section = server.model_dump() if isinstance(server, ServerConfig) else {}
        store = full
    else:
        section = data.pop("server", None) or {}
        if not isinstance(section, dict):
            raise ConfigError(f"{source}: server: must be a mapping")
        if default_tiers:
            data["tiers"] = _server_default_tiers()
        store = _load_store(data, env, source)
    try:
        server_config = ServerConfig.model_validate({**section, **(overrides or {})})
    except ValidationError as e:
        raise ConfigError(_format(e, source)) from None
    return server_config, store
