"""docker-compose.yml is secure by default: loopback ports, secrets from .env, no open admin.

The machine this runs on has no Docker engine, so compose itself never runs
here; these tests read the files as compose would (YAML, ``${VAR:?message}``
interpolation from ``.env``), and start the cache server with the exact
configuration compose gives it to check that its tokens work as documented.
"""

from __future__ import annotations

import hashlib
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtier.errors import AuthError, ConfigError

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker-compose.yml"
DEPLOY = REPO / "deploy"
ENV_EXAMPLE = DEPLOY / "env.example"
MAKE_ENV = DEPLOY / "make_env.py"

_REF = re.compile(r"\$\{([^}]*)\}")
_REQUIRED = re.compile(r"^([A-Z][A-Z0-9_]*):\?(.+)$")
_SECRET_NAME = re.compile(r"PASSWORD|TOKEN|SECRET|API_KEY|SHA256", re.I)


def _compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def _walk(node: Any, path: str = "") -> list[tuple[str, Any]]:
    """(dotted path, leaf value) of every scalar in ``node``."""
    if isinstance(node, dict):
        return [leaf for k, v in node.items() for leaf in _walk(v, f"{path}.{k}" if path else k)]
    if isinstance(node, list):
        return [leaf for i, v in enumerate(node) for leaf in _walk(v, f"{path}[{i}]")]
    return [(path, node)]


def _references() -> dict[str, list[str]]:
    """Every ``${...}`` of the compose file: variable -> paths where it is used."""
    refs: dict[str, list[str]] = {}
    for path, value in _walk(_compose()):
        for inner in _REF.findall(str(value)):
            m = _REQUIRED.match(inner)
            assert m, f"{path}: ${{{inner}}} must be ${{NAME:?message}} (required, no default)"
            refs.setdefault(m.group(1), []).append(path)
    return refs


def _interpolate(node: Any, env: dict[str, str]) -> Any:
    """What compose does with ``${NAME:?message}``: the value, or an error naming it."""
    if isinstance(node, dict):
        return {k: _interpolate(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [_interpolate(v, env) for v in node]
    if not isinstance(node, str):
        return node

    def value(m: re.Match[str]) -> str:
        name, message = _REQUIRED.match(m.group(1)).groups()  # type: ignore[union-attr]
        if not env.get(name):
            raise LookupError(f"required variable {name} is missing a value: {message}")
        return env[name]

    return _REF.sub(value, node)


def _example_variables() -> list[str]:
    return re.findall(r"^([A-Z][A-Z0-9_]*)=\s*$", ENV_EXAMPLE.read_text(), flags=re.M)


@pytest.fixture
def dotenv(tmp_path: Path) -> dict[str, str]:
    """A .env made the documented way (deploy/make_env.py), parsed."""
    out = tmp_path / ".env"
    done = subprocess.run(
        [sys.executable, str(MAKE_ENV), "--out", str(out)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert out.stat().st_mode & 0o777 == 0o600
    again = subprocess.run(
        [sys.executable, str(MAKE_ENV), "--out", str(out)], capture_output=True, text=True
    )
    assert again.returncode == 1 and "not overwritten" in again.stderr
    return dict(line.split("=", 1) for line in out.read_text().splitlines())


# ---- the compose file ---------------------------------------------------------------------------


def _published(port: Any) -> tuple[str | None, str]:
    """(host address or None, the port spec) of one ``ports:`` entry."""
    if isinstance(port, dict):  # long syntax
        return port.get("host_ip"), str(port.get("published", ""))
    spec = str(port)
    if spec.startswith("["):  # [::1]:8000:8000
        host, _, rest = spec[1:].partition("]:")
        return host, rest
    parts = spec.split(":")
    return (parts[0], ":".join(parts[1:])) if len(parts) == 3 else (None, spec)


def test_every_published_port_listens_on_loopback_only() -> None:
    services = _compose()["services"]
    published = 0
    for name, service in services.items():
        for port in service.get("ports", []):
            host, spec = _published(port)
            assert host == "127.0.0.1", (
                f"{name}: port {port!r} is published on every interface; write 127.0.0.1:{spec}"
            )
            published += 1
        assert service.get("network_mode") != "host", f"{name}: host networking skips the ports"
    assert published >= 7  # the opt-in Aerospike port included


def test_the_checks_catch_what_they_look_for() -> None:
    # the loopback check on forms compose accepts
    assert _published("3000:3000") == (None, "3000:3000")
    assert _published("0.0.0.0:3000:3000")[0] == "0.0.0.0"
    assert _published("3000") == (None, "3000")
    assert _published({"target": 80, "published": 8080})[0] is None
    assert _published({"target": 80, "host_ip": "127.0.0.1", "published": 8080})[0] == "127.0.0.1"
    assert _published("[::]:80:80")[0] == "::"
    with pytest.raises(LookupError, match="required variable X is missing a value: make it"):
        _interpolate({"a": ["${X:?make it}"]}, {"X": ""})


def test_every_secret_comes_from_env_and_is_required() -> None:
    refs = _references()
    for name, service in _compose()["services"].items():
        env = service.get("environment", {})
        assert isinstance(env, dict), f"{name}: environment as a mapping, please"
        for key, value in env.items():
            if _SECRET_NAME.search(key):
                assert isinstance(value, str) and _REF.fullmatch(value), (
                    f"{name}.environment.{key} is a secret: ${{VAR:?message}} from .env, "
                    f"not {value!r}"
                )
    # every variable compose reads is documented in env.example, and made by make_env.py
    example = _example_variables()
    assert sorted(set(refs) - set(example)) == []
    for secret in _compose().get("secrets", {}).values():
        assert secret["environment"] in refs, "a secret's variable must also be required"
        assert secret["environment"] in example


def test_grafana_has_no_default_password_and_no_anonymous_admin() -> None:
    env = _compose()["services"]["grafana"]["environment"]
    assert _REF.fullmatch(env["GF_SECURITY_ADMIN_PASSWORD"])
    assert "GF_SECURITY_ADMIN_PASSWORD__FILE" not in env
    assert str(env.get("GF_AUTH_ANONYMOUS_ENABLED", "false")).lower() == "false"
    assert str(env.get("GF_AUTH_ANONYMOUS_ORG_ROLE", "Viewer")) != "Admin"
    assert str(env.get("GF_USERS_ALLOW_SIGN_UP", "false")).lower() == "false"
    for path, value in _walk(_compose()):
        assert "admin/admin" not in str(value), path
    assert "admin/admin" not in COMPOSE.read_text()


def test_aerospike_is_reached_only_by_the_cache_server() -> None:
    compose = _compose()
    services = compose["services"]
    aerospike = services["aerospike"]
    assert "ports" not in aerospike, "Aerospike CE has no authentication: never published"
    assert aerospike["networks"] == ["kv-store"]
    assert compose["networks"]["kv-store"]["internal"] is True
    on_store = {n for n, s in services.items() if "kv-store" in s.get("networks", [])}
    assert on_store == {"aerospike", "kvtier-cache", "aerospike-host-port"}
    # publishing it is opt-in (a profile), on loopback
    assert services["aerospike-host-port"]["profiles"] == ["aerospike-host"]
    for name, service in services.items():  # no service joins the default network by omission
        assert service.get("networks"), f"{name}: name its networks"


def _deploy_config(name: str) -> Any:
    from kvtier.config import KvtierConfig

    return KvtierConfig.model_validate(yaml.safe_load((DEPLOY / "kvtier" / name).read_text()))


def test_the_engine_reaches_shared_kv_only_through_the_authenticated_cache_server() -> None:
    engine = _compose()["services"]["kvtier"]
    assert "./deploy/kvtier/kvtier-engine.yaml:/etc/kvtier/kvtier.yaml:ro" in engine["volumes"]
    assert engine["networks"] == ["front"]
    config = _deploy_config("kvtier-engine.yaml")
    shared = [t for t in config.tiers if t.type not in ("cpu", "disk")]
    assert [(t.type, t.address, t.token_env) for t in shared] == [  # type: ignore[union-attr]
        ("remote", "kvtier-cache:50051", "CACHE_ENGINE_TOKEN")
    ]
    assert _REF.fullmatch(engine["environment"]["CACHE_ENGINE_TOKEN"])


def test_the_image_has_what_the_cache_server_and_the_remote_tier_import() -> None:
    installs = re.findall(r'pip install "\.\[([^\]]*)\]"', (REPO / "Dockerfile").read_text())
    assert installs and {"engine", "aerospike", "server"} <= set(installs[-1].split(","))


@pytest.mark.parametrize(
    "name", ["kvtier-engine.yaml", "kvtier-server.yaml", "kvtier-aerospike.yaml"]
)
def test_every_shipped_config_verifies_a_sample_of_loads(name: str) -> None:
    path = DEPLOY / "kvtier" / name
    data = yaml.safe_load(path.read_text())
    assert 0 < data["connector"]["verify_fraction"] <= 0.05


def test_the_engine_needs_an_api_key() -> None:
    engine = _compose()["services"]["kvtier"]
    assert _REF.fullmatch(engine["environment"]["KVTIER_API_KEY"])
    assert "--api-key" not in engine["command"]  # a flag would show the key in `ps`


def test_the_cache_server_is_closed_and_prometheus_scrapes_it_with_a_token() -> None:
    compose = _compose()
    cache = compose["services"]["kvtier-cache"]
    assert "--open" not in cache["command"]
    server = yaml.safe_load((DEPLOY / "kvtier" / "kvtier-server.yaml").read_text())["server"]
    assert server["open"] is False and server["http_require_token"] is True
    prometheus = compose["services"]["prometheus"]
    assert not any("enable-admin-api" in str(a) for a in prometheus.get("command", []))
    assert not any("enable-lifecycle" in str(a) for a in prometheus.get("command", []))
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = [j for j in scrape["scrape_configs"] if j["job_name"] == "kvtier-cache-server"]
    secret_file = job["authorization"]["credentials_file"]
    (secret,) = prometheus["secrets"]
    assert secret_file == f"/run/secrets/{secret}"
    assert compose["secrets"][secret]["environment"] == "CACHE_MONITOR_TOKEN"


def test_env_files_stay_out_of_git_and_the_image() -> None:
    for ignore in (".gitignore", ".dockerignore"):
        lines = (REPO / ignore).read_text().splitlines()
        assert ".env" in lines or "/.env" in lines, ignore


# ---- .env and the configuration compose hands out -------------------------------------------------


def test_make_env_fills_every_variable_and_hashes_the_tokens(dotenv: dict[str, str]) -> None:
    assert list(dotenv) == _example_variables()
    for name, value in dotenv.items():
        if name.endswith("_SHA256"):
            token = dotenv[name.removesuffix("_SHA256")]
            assert value == hashlib.sha256(token.encode()).hexdigest()
        else:
            assert len(value) >= 40  # 32 random bytes
    assert len(set(dotenv.values())) == len(dotenv)
    resolved = _interpolate(_compose(), dotenv)  # every reference resolves
    assert (
        resolved["services"]["kvtier"]["environment"]["KVTIER_API_KEY"] == dotenv["KVTIER_API_KEY"]
    )


def test_compose_stops_naming_a_missing_variable(dotenv: dict[str, str]) -> None:
    for name in _references():
        with pytest.raises(LookupError, match=f"required variable {name} is missing.*make_env.py"):
            _interpolate(_compose(), {**dotenv, name: ""})


def _cache_server_env(dotenv: dict[str, str], tmp: Path) -> dict[str, str]:
    """The kvtier-cache container's environment, its secret file under ``tmp`` and its
    Aerospike tier pointed at a port nobody listens on (no cluster here: the tier is a
    miss, counted, and the CPU tier serves)."""
    env = _interpolate(_compose()["services"]["kvtier-cache"]["environment"], dotenv)
    secret = tmp / "cache_provenance_key"
    secret.write_text(dotenv["CACHE_PROVENANCE_KEY"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody = s.getsockname()[1]
    return {
        **env,
        "KVTIER_SERVER__PROVENANCE_KEY_FILE": str(secret),
        "KVTIER_TIERS__1__HOSTS": f'["127.0.0.1:{nobody}"]',
    }


def test_the_cache_server_config_needs_the_token_hashes(tmp_path: Path) -> None:
    from kvtier.server.loader import load_server_config

    path = DEPLOY / "kvtier" / "kvtier-server.yaml"
    with pytest.raises(ConfigError, match=r"server\.tenants\.0\.token_sha256"):
        load_server_config(path, env={})


def test_the_cache_server_as_compose_runs_it(dotenv: dict[str, str], tmp_path: Path) -> None:
    from kvtier.server.app import CacheServer
    from kvtier.server.loader import load_server_config
    from kvtier.tiers.remote import RemoteTier
    from kvtier.tiers.remote_config import RemoteTierConfig
    from tests.kvtier.helpers import block, key

    path = DEPLOY / "kvtier" / "kvtier-server.yaml"
    ports = {"host": "127.0.0.1", "port": 0, "data_port": 0, "http_port": 0}
    server_config, store_config = load_server_config(
        path, env=_cache_server_env(dotenv, tmp_path), overrides=ports
    )
    assert not server_config.is_open  # on loopback too: no anonymous admin anywhere
    assert {t.name: t.role for t in server_config.tenants} == {
        "ops": "admin",
        "engine-1": "writer",
        "monitor": "reader",
    }
    assert [(n.name, n.trusted_writers) for n in server_config.namespaces] == [
        ("fleet", ["engine-1"])
    ]
    assert [t.type for t in store_config.tiers] == ["cpu", "aerospike"]
    server = CacheServer(server_config, store_config).start()
    try:
        metrics = f"http://127.0.0.1:{server.http_port}/metrics"
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(metrics, timeout=10)
        assert e.value.code == 401
        scrape = urllib.request.Request(
            metrics, headers={"Authorization": f"Bearer {dotenv['CACHE_MONITOR_TOKEN']}"}
        )
        with urllib.request.urlopen(scrape, timeout=10) as r:  # what Prometheus sends
            assert r.status == 200 and b"kvtier_server_" in r.read()

        def tier(token: str | None) -> RemoteTier:
            return RemoteTier(RemoteTierConfig(address=server.address, token=token, retries=0))

        anonymous = tier(None)
        try:
            with pytest.raises(AuthError):
                anonymous.prefix_length([key(1)])
        finally:
            anonymous.close()
        engine = tier(dotenv["CACHE_ENGINE_TOKEN"])
        try:
            engine.put([(key(1), block(1))])
            assert engine.prefix_length([key(1)]) == 1
            assert engine.get([key(1)]) == [block(1)]
        finally:
            engine.close()
        monitor = tier(dotenv["CACHE_MONITOR_TOKEN"])
        try:  # the monitor token sees figures, not the fleet's blocks
            assert monitor.get([key(1)]) == [None]
        finally:
            monitor.close()
    finally:
        server.stop(grace=2.0)
