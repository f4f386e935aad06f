"""Secrets never printed: `star config show`, `star status`, log lines, errors.

Each surface is given recognisable secrets (a password in redis.url,
redis.password, proxy.api_key, cluster.secret) and must show none of them.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging

import pytest
import structlog

from star.bus import Bus, BusUnavailable
from star.cli.main import main
from star.logs import configure_logging
from star.redact import redact_text, redact_url
from star.settings import LogSettings, SettingsError, load_settings, secret_values
from tests.conftest import bus_settings
from tests.reports import report
from tests.security.test_redis_tls import tls_settings
from tests.security.tls_redis import PASSWORD, TlsRedisServer

URL_PW = "Url-Pw-51ce0a"
REDIS_PW = "Redis-Pw-8b77e1"
API_KEY = "sk-Api-Key-2f90d4"
CLUSTER = "Cluster-Secret-0c1b2a3d4e5f"
SECRETS = (URL_PW, REDIS_PW, API_KEY, CLUSTER)
ENV = {
    "STAR_REDIS_URL": f"redis://star:{URL_PW}@127.0.0.1:1/0",
    "STAR_REDIS_PASSWORD": REDIS_PW,
    "STAR_PROXY_API_KEY": API_KEY,
    "STAR_CLUSTER_SECRET": CLUSTER,
    "STAR_REDIS_RECONNECT_TIMEOUT_S": "0.3",
    "STAR_REDIS_BACKOFF_BASE_S": "0.05",
}


def assert_clean(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"{secret!r} shown in:\n{text}"


@pytest.fixture
def secret_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)


# -- the rule ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("redis://star:pw@h:6379/0", "redis://star:***@h:6379/0"),
        ("rediss://:pw@h/0", "rediss://:***@h/0"),
        ("redis://h:6379/0", "redis://h:6379/0"),
        ("redis://u:p@ss@h/0", "redis://u:***@h/0"),  # an unencoded "@", as urllib reads it
        ("unix://:pw@/run/redis.sock", "unix://:***@/run/redis.sock"),
        ("at 'redis://a:b@c/0' and http://d:e@f/x", "at 'redis://a:***@c/0' and http://d:***@f/x"),
        ("http://host:80/a?next=x@y", "http://host:80/a?next=x@y"),
    ],
)
def test_redact_url(text: str, shown: str) -> None:
    assert redact_url(text) == shown


def test_secret_values_cover_every_secret_and_the_url_password() -> None:
    settings = load_settings(env={**ENV, "STAR_REDIS_URL": "redis://u:p%40ss-word@h/0"})
    values = secret_values(settings)
    assert {REDIS_PW, API_KEY, CLUSTER, "p@ss-word", "p%40ss-word"} <= set(values)
    assert redact_text(f"auth p@ss-word {API_KEY}", values) == "auth *** ***"


def test_settings_reprs_show_no_secret() -> None:
    """A settings object put in a log line or an f-string shows no secret by itself."""
    settings = load_settings(env=ENV)
    text = repr(settings) + str(settings.redis) + repr(settings.proxy) + repr(settings.cluster)
    assert "redis://star:***@127.0.0.1:1/0" in text and "max_streams=" in text
    assert_clean(text)


# -- star config show ----------------------------------------------------------------


@pytest.mark.parametrize("fmt", [[], ["--json"], ["--toml"], ["--markdown"]])
def test_config_show_masks_every_secret(
    secret_env: None, capsys: pytest.CaptureFixture[str], fmt: list[str]
) -> None:
    assert main(["config", "show", *fmt]) == 0
    out, err = capsys.readouterr()
    assert_clean(out + err)
    assert "redis://star:***@127.0.0.1:1/0" in out  # the rest of the URL is still shown
    if fmt == ["--json"]:
        doc = json.loads(out)
        assert doc["redis"]["password"] == doc["proxy"]["api_key"] == "***"
        assert doc["cluster"]["secret"] == "***"


# -- errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"STAR_REDIS_URL": f"http://star:{URL_PW}@h/0"}, "redis.url: must be a redis://"),
        ({"STAR_CLUSTER_SECRET": "short"}, "cluster.secret: must be empty or at least 16"),
        ({"STAR_REDIS_PASWORD": REDIS_PW}, "unknown environment variable STAR_REDIS_PASWORD"),
        ({"STAR_PROXY_MAX_STREAMS": f"redis://u:{URL_PW}@h"}, "proxy.max_streams: invalid value"),
    ],
)
def test_settings_errors_quote_no_secret(env: dict[str, str], expected: str) -> None:
    with pytest.raises(SettingsError) as caught:
        load_settings(env=env)
    assert expected in str(caught.value)
    assert_clean(str(caught.value))
    assert "short" not in str(caught.value)  # a bad secret is not quoted either


def test_cli_error_for_unreachable_redis_hides_the_password(
    secret_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv in (["status"], ["inspect", "events"]):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert "unreachable" in err and "redis://star:***@127.0.0.1:1/0" in err
        assert_clean(out + err)


async def test_bus_unavailable_hides_the_password() -> None:
    settings = load_settings(env=ENV)
    bus = Bus.from_settings(settings.redis, bus_settings())
    try:
        with pytest.raises(BusUnavailable) as caught:
            await bus.last_id("events")
    finally:
        await bus.close()
    assert "redis://star:***@127.0.0.1:1/0" in str(caught.value)
    assert_clean(str(caught.value))


# -- logs -----------------------------------------------------------------------------------


class Boom(Exception):
    pass


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_log_lines_show_no_secret(fmt: str) -> None:
    settings = load_settings(env=ENV)
    out = io.StringIO()
    configure_logging(
        LogSettings(format=fmt, level="debug"), stream=out, secrets=secret_values(settings)
    )
    log = structlog.get_logger("t")
    log.info("connecting", url=settings.redis.url, redis=settings.redis, proxy=settings.proxy)
    log.warning(f"auth with {REDIS_PW} refused", nested={"keys": [API_KEY, CLUSTER]})
    try:
        raise Boom(f"Redis at {settings.redis.url} said no to {API_KEY}")
    except Boom:
        log.exception("failed")
    logging.getLogger("redis.connection").warning(
        "retrying %s with %s", settings.redis.url, CLUSTER
    )
    text = out.getvalue()
    assert "connecting" in text and "Boom" in text and "retrying" in text
    assert "redis://star:***@127.0.0.1:1/0" in text
    assert_clean(text)
    if fmt == "json":
        lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
        assert [line["event"] for line in lines] == [
            "connecting",
            "auth with *** refused",
            "failed",
        ]


def test_log_lines_mask_url_passwords_without_being_told_the_secrets() -> None:
    out = io.StringIO()
    configure_logging(LogSettings(format="json"), stream=out)
    structlog.get_logger("t").warning("redis down", url=f"rediss://star:{URL_PW}@h:6380/0")
    line = json.loads(out.getvalue())
    assert line["url"] == "rediss://star:***@h:6380/0"


# -- star status, over TLS with an ACL user ------------------------------------------


def test_status_over_tls_shows_no_secret(
    tls_redis: TlsRedisServer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bs = bus_settings()

    async def publish() -> None:
        # Signed as a worker of this cluster would: `star status` with the
        # secret shows no unsigned report (star.bus.signing).
        bus = Bus.from_settings(tls_settings(tls_redis), bs, CLUSTER)
        try:
            await bus.publish("reports", report("decode-0"))
        finally:
            await bus.close()

    asyncio.run(publish())
    env = {
        **ENV,
        "STAR_REDIS_URL": tls_redis.url(),  # the URL's password is the right one
        "STAR_REDIS_TLS_CA_FILE": str(tls_redis.pki.ca),
        "STAR_BUS_PREFIX": bs.prefix,
        "STAR_REDIS_RECONNECT_TIMEOUT_S": "15",
    }
    del env["STAR_REDIS_PASSWORD"]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["status"]) == 0
    assert main(["status", "--json"]) == 0
    out, err = capsys.readouterr()
    assert out.count("decode-0") == 2
    assert_clean(out + err)
    assert PASSWORD not in out + err
