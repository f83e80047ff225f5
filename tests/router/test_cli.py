"""``kvtier router`` and ``kvtier engine serve --role``: bad options fail before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtier.cli import main
from kvtier.router.config import EngineSpec, RouterConfig, RouterConfigError


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "at least one engine"),
        (["--prefill", "http://127.0.0.1:1"], "P/D needs at least one prefill and one decode"),
        (["--engine", "127.0.0.1:1"], "must start with http://"),
        (["--engine", "http://a:1", "--engine", "http://a:1/v1"], "listed twice"),
    ],
)
def test_router_refuses_bad_engine_lists(args: list[str], message: str) -> None:
    result = CliRunner().invoke(main, ["router", "--model", "none", *args])
    assert result.exit_code == 2 and message in result.output


def test_engine_role_needs_a_connector(tiny_model: Path) -> None:
    args = ["engine", "serve", "--role", "decode", "--model", str(tiny_model)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0 and "needs a KV connector" in result.output


def test_router_config_checks_its_knobs() -> None:
    engines = (EngineSpec("http://a:1"),)
    with pytest.raises(RouterConfigError, match="shared_hit_weight"):
        RouterConfig(engines=engines, shared_hit_weight=1.5)
    with pytest.raises(RouterConfigError, match="policy"):
        RouterConfig(engines=engines, policy="random")  # type: ignore[arg-type]
    with pytest.raises(RouterConfigError, match="role"):
        EngineSpec("http://a:1", "both-ish")  # type: ignore[arg-type]
    assert RouterConfig(
        engines=(EngineSpec("http://a:1", "prefill"), EngineSpec("http://b:2", "decode"))
    ).disaggregated
