"""A Redis URL's password is masked in every form, on every surface that shows the URL.

redis-py reads a password from the user-info (``redis://user:pw@host``) or from
a query parameter (``unix:///path?password=pw&db=0``, the only form for a unix
socket, or ``redis://host/0?password=pw``), and takes any other query
parameter as a connection argument too (``ssl_password``). Each surface a user
reads (``star config show``, ``star status`` and ``star inspect`` errors, a
settings error, a settings repr, log lines, ``star up``'s refusal) is run with
each form: the password never shows, in any encoding, and the host (or the
socket path) still does.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
import structlog

from star.bus import Bus, BusUnavailable, Outage
from star.cli.main import main
from star.fleet import FleetError, refuse_a_second_cluster
from star.logs import configure_logging
from star.ports import free_port
from star.redact import MASK, redact_url, url_secrets
from star.settings import LogSettings, load_settings, secret_values
from tests.conftest import bus_settings
from tests.redis_server import launch, terminate
from tests.reports import report
from tests.security.tls_redis import PASSWORD as TLS_PASSWORD
from tests.security.tls_redis import TlsRedisServer

# An "@" in it: a URL carries it percent-encoded (Pw%40Url-7e41b9), a line could
# show it either way.
PW = "Pw@Url-7e41b9"
WRONG = "Wrong@Pw-0d5e"

# form -> (host:port, unix socket path, password) -> URL; the password goes in
# percent-encoded, as a URL must carry an "@".
Form = Callable[[str, str, str], str]
FORMS: dict[str, Form] = {
    "redis://:pw@host": lambda hp, _s, pw: f"redis://:{quote(pw, safe='')}@{hp}/0",
    "redis://user:pw@host": lambda hp, _s, pw: f"redis://star:{quote(pw, safe='')}@{hp}/0",
    "rediss://user:pw@host": lambda hp, _s, pw: f"rediss://star:{quote(pw, safe='')}@{hp}/0",
    "unix:///path?password=pw&db=0": lambda _hp, s, pw: (
        f"unix://{s}?password={quote(pw, safe='')}&db=0"
    ),
    "redis://host?password=pw": lambda hp, _s, pw: f"redis://{hp}/0?password={quote(pw, safe='')}",
    "redis://host?username=u&password=pw": lambda hp, _s, pw: (
        f"redis://{hp}/0?username=star&password={quote(pw, safe='')}"
    ),
    "rediss://user@host?ssl_password=pw": lambda hp, _s, pw: (
        f"rediss://star@{hp}/0?ssl_password={quote(pw, safe='')}"
    ),
}
UNIX = {"unix:///path?password=pw&db=0"}
TLS = {name for name in FORMS if name.startswith("rediss")}

# ``star`` commands configure logging onto a capture stream; it ends with the test.
pytestmark = pytest.mark.usefixtures("restore_logging")


def assert_hidden(text: str, password: str, shown: str) -> None:
    """No form of ``password`` in ``text``; ``shown`` (the host or socket) is there."""
    for form in (password, quote(password, safe=""), password.split("@")[-1]):
        assert form not in text, f"{form!r} shown in:\n{text}"
    assert shown in text, f"{shown!r} missing from:\n{text}"


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No STAR_* setting of the caller's; failures come fast."""
    for name in list(os.environ):
        if name.startswith("STAR_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("STAR_REDIS_RECONNECT_TIMEOUT_S", "0.3")
    monkeypatch.setenv("STAR_REDIS_BACKOFF_BASE_S", "0.05")
    monkeypatch.setenv("STAR_REDIS_CONNECT_TIMEOUT_S", "0.5")


# -- the rule ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("unix:///run/redis.sock?password=pw&db=0", "unix:///run/redis.sock?password=***&db=0"),
        ("unix:///run/redis.sock?db=0&password=p%40w", "unix:///run/redis.sock?db=0&password=***"),
        ("redis://h:6379/0?password=pw", "redis://h:6379/0?password=***"),
        ("redis://h/0?username=bob&password=pw", "redis://h/0?username=bob&password=***"),
        ("rediss://u@h/0?ssl_password=pw&db=1", "rediss://u@h/0?ssl_password=***&db=1"),
        ("http://h/x?token=t&api_key=k&key=v", "http://h/x?token=***&api_key=***&key=***"),
        ("redis://h?password=p:w@x/0", "redis://h?password=***"),  # no user-info: one parameter
        ("url='unix:///s?password=pw' db", "url='unix:///s?password=***' db"),  # in a repr
        ('{"url": "redis://h/0?password=pw#f"}', '{"url": "redis://h/0?password=***#f"}'),
        ("redis://h/0?db=0&username=bob", "redis://h/0?db=0&username=bob"),  # nothing secret
        ("redis://h/0?password=", "redis://h/0?password="),  # no value, nothing to hide
    ],
)
def test_redact_url_masks_query_passwords(text: str, shown: str) -> None:
    assert redact_url(text) == shown


def test_url_secrets_lists_query_passwords_in_every_encoding() -> None:
    assert url_secrets("unix:///s?db=0&password=p%40ss+w") >= {"p%40ss+w", "p@ss w", "p@ss+w"}
    assert url_secrets("rediss://u@h/0?ssl_password=k3y") == {"k3y"}
    assert url_secrets("redis://h/0?username=bob") == set()
    settings = load_settings(env={"STAR_REDIS_URL": "unix:///s?password=p%40ss-word&db=0"})
    assert {"p@ss-word", "p%40ss-word"} <= set(secret_values(settings))


# -- surfaces that need no server: configuration, errors, logs -----------------------


Surface = Callable[[pytest.CaptureFixture[str], pytest.MonkeyPatch], str]


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str], status: int) -> str:
    assert main(argv) == status
    out, err = capsys.readouterr()
    return out + err


def config_show(fmt: list[str]) -> Surface:
    return lambda capsys, _mp: _cli(["config", "show", *fmt], capsys, 0)


def unreachable(argv: list[str]) -> Surface:
    def run(capsys: pytest.CaptureFixture[str], _mp: pytest.MonkeyPatch) -> str:
        text = _cli(argv, capsys, 2)
        assert "unreachable" in text
        return text

    return run


def tls_file_error(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("STAR_REDIS_TLS_CA_FILE", "/nonexistent/ca.pem")
    text = _cli(["status"], capsys, 2)
    assert "is not rediss://" in text
    return text


def settings_repr(_capsys: pytest.CaptureFixture[str], _mp: pytest.MonkeyPatch) -> str:
    settings = load_settings()
    return f"{settings!r} {settings.redis} {settings.redis!r}"


def log_lines(fmt: str, told: bool) -> Surface:
    """A service's lines about its Redis: the URL as a field, a settings object, the
    BusUnavailable it gave up with (logged by Outage, and as a traceback), a library line.
    ``told``: configured with the secrets, as services are; else redact_url alone."""

    def run(_capsys: pytest.CaptureFixture[str], _mp: pytest.MonkeyPatch) -> str:
        settings = load_settings()
        out = io.StringIO()
        secrets = secret_values(settings) if told else ()
        configure_logging(LogSettings(format=fmt, level="debug"), stream=out, secrets=secrets)
        log = structlog.get_logger("t")
        log.info("redis_configured", url=settings.redis.url, redis=settings.redis)

        async def give_up() -> BusUnavailable:
            bus = Bus.from_settings(settings.redis, bus_settings())
            try:
                with pytest.raises(BusUnavailable) as caught:
                    await bus.last_id("events")
            finally:
                await bus.close()
            return caught.value

        exc = asyncio.run(give_up())
        Outage("events_unpublishable", "events_publishable_again").down(exc)
        try:
            raise RuntimeError(f"cannot use {settings.redis.url}")
        except RuntimeError:
            log.exception("failed")
        logging.getLogger("redis.connection").warning("retrying %s", settings.redis.url)
        text = out.getvalue()
        assert "redis_configured" in text and "events_unpublishable" in text
        return text

    return run


SURFACES: dict[str, Surface] = {
    "config show": config_show([]),
    "config show --json": config_show(["--json"]),
    "config show --toml": config_show(["--toml"]),
    "config show --markdown": config_show(["--markdown"]),
    "status (unreachable)": unreachable(["status"]),
    "status --json (unreachable)": unreachable(["status", "--json"]),
    "inspect events (unreachable)": unreachable(["inspect", "events"]),
    "tls file with a non-TLS URL": tls_file_error,
    "settings repr": settings_repr,
    "json log lines": log_lines("json", told=True),
    "console log lines": log_lines("console", told=True),
    "log lines, secrets not told": log_lines("json", told=False),
}


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("surface", list(SURFACES))
def test_every_surface_masks_every_url_form(
    surface: str,
    form: str,
    clean_env: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if surface == "tls file with a non-TLS URL" and form in TLS:
        pytest.skip("a rediss:// URL takes TLS files")
    hostport, sock = f"127.0.0.1:{free_port()}", str(tmp_path / "nothing.sock")
    monkeypatch.setenv("STAR_REDIS_URL", FORMS[form](hostport, sock, PW))
    text = SURFACES[surface](capsys, monkeypatch)
    assert_hidden(text, PW, sock if form in UNIX else hostport)
    assert MASK in text


def test_config_show_json_keeps_the_url_but_the_password(
    clean_env: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("STAR_REDIS_URL", "unix:///run/redis.sock?password=Pw-5a1&db=0")
    doc = json.loads(_cli(["config", "show", "--json"], capsys, 0))
    assert doc["redis"]["url"] == "unix:///run/redis.sock?password=***&db=0"


# -- surfaces with a server: star status, refused credentials, star up's refusal ----------


class PasswordRedis:
    """redis-server on a TCP port and a unix socket; the default user and ``star``
    both need PW."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        assert binary is not None
        self.port = free_port()
        self.sock = str(workdir / "redis.sock")
        args = [
            binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--unixsocket", self.sock,
            "--unixsocketperm", "700",
            "--requirepass", PW,
            "--user", "star", "on", f">{PW}", "~*", "&*", "+@all",
            "--dir", str(workdir),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--logfile", str(workdir / "redis.log"),
        ]  # fmt: skip
        self.proc = launch(args, workdir / "redis.log", self._answers)

    def _answers(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"-NOAUTH")


@pytest.fixture(scope="module")
def password_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PasswordRedis]:
    server = PasswordRedis(tmp_path_factory.mktemp("pwredis"))
    yield server
    terminate(server.proc)


LIVE = [
    "redis://:pw@host",
    "redis://user:pw@host",
    "unix:///path?password=pw&db=0",
    "redis://host?password=pw",
    "redis://host?username=u&password=pw",
    "rediss://user:pw@host",
]


def _live_env(
    form: str,
    password: str,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> tuple[str, str]:
    """Point STAR_* at the server for ``form``; return the URL and what must show of it."""
    if form in TLS:
        tls: TlsRedisServer = request.getfixturevalue("tls_redis")
        monkeypatch.setenv("STAR_REDIS_TLS_CA_FILE", str(tls.pki.ca))
        hostport, sock = f"127.0.0.1:{tls.port}", ""
        if password == PW:
            password = TLS_PASSWORD
    else:
        server: PasswordRedis = request.getfixturevalue("password_redis")
        hostport, sock = f"127.0.0.1:{server.port}", server.sock
    url = FORMS[form](hostport, sock, password)
    monkeypatch.setenv("STAR_REDIS_URL", url)
    return password, sock if form in UNIX else hostport


@pytest.mark.parametrize("form", LIVE)
def test_status_with_each_url_form_shows_the_cluster_and_no_password(
    form: str,
    clean_env: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    request: pytest.FixtureRequest,
) -> None:
    password, _host = _live_env(form, PW, monkeypatch, request)
    monkeypatch.setenv("STAR_REDIS_RECONNECT_TIMEOUT_S", "15")
    prefix = bus_settings().prefix
    monkeypatch.setenv("STAR_BUS_PREFIX", prefix)

    async def publish() -> None:
        settings = load_settings()
        bus = Bus.from_settings(settings.redis, settings.bus)
        try:
            await bus.publish("reports", report("decode-0"))
        finally:
            await bus.close()

    asyncio.run(publish())
    text = _cli(["status"], capsys, 0) + _cli(["status", "--json"], capsys, 0)
    assert text.count("decode-0") == 2
    for shown in (password, quote(password, safe="")):
        assert shown not in text


@pytest.mark.parametrize("form", LIVE)
def test_refused_credentials_error_masks_the_password(
    form: str,
    clean_env: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    request: pytest.FixtureRequest,
) -> None:
    """A wrong password is still a secret (a typo of the right one, or another system's)."""
    _password, host = _live_env(form, WRONG, monkeypatch, request)
    text = _cli(["status"], capsys, 2)
    # At once, or after redis.reconnect_timeout_s of retries (redis-py does not
    # always raise its AuthenticationError for it): either way Redis's reason.
    assert "refused the credentials" in text or "invalid username-password pair" in text
    assert_hidden(text, WRONG, host)


@pytest.mark.parametrize("form", LIVE)
def test_star_up_refusal_masks_the_password(
    form: str,
    clean_env: None,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    """``star up`` on a bus where a cluster runs names the URL it found it on."""
    password, host = _live_env(form, PW, monkeypatch, request)
    monkeypatch.setenv("STAR_REDIS_RECONNECT_TIMEOUT_S", "15")
    monkeypatch.setenv("STAR_BUS_PREFIX", bus_settings().prefix)
    settings = load_settings()

    async def first_cluster() -> None:
        bus = Bus.from_settings(settings.redis, settings.bus)
        try:
            await bus.publish("reports", report("decode-0"))
        finally:
            await bus.close()

    asyncio.run(first_cluster())
    with pytest.raises(FleetError) as caught:
        refuse_a_second_cluster(settings)
    assert "a cluster is already running on" in str(caught.value)
    assert_hidden(str(caught.value), password, host)
