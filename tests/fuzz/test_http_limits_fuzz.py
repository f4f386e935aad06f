"""Fuzzing the proxy's HTTP limits (proxy/http.py, issue 27 item 5).

Each input is one client connection driven sans IO through the real
:class:`proxy.http.HttpServer` connection and :class:`proxy.app.ProxyApp`
(tests/fuzz/test_proxy_fuzz.py's in-memory transport), with a request
pipelined after the one under test. Whatever the head, body or framing:

- ambiguous framing (Content-Length with Transfer-Encoding, in any case,
  order or value), a bare LF anywhere in the head, or a head over
  ``proxy.max_header_bytes``: exactly one answer, a 400 (431 for the size;
  501, as nginx, when the transfer coding is one h11 does not implement),
  then the proxy closes: the pipelined request is never served;
- a request without the API key: 401 on the head, before any byte of its
  body arrives, then close;
- JSON nested past the cap: 400;
- random heads and chunked bodies cut anywhere: 2xx or 4xx only (or no
  answer, when the client half-closes before a head is complete);

and never an error logged, an exception, or a hang (each input runs under
a hard time limit, the connection must end).
"""

from __future__ import annotations

import asyncio

import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.app import ProxyApp, create_server
from proxy.http import _Connection
from proxy.tokenizer import ModelCard
from star.settings import ProxySettings
from tests.fuzz.common import FUZZ, Tally, run_fuzz
from tests.fuzz.test_proxy_fuzz import MemoryTransport, _cut, _settle, responses
from tests.proxy.fakes import FakeBackend, build_tokenizer, write_model_dir

MODEL = "tiny"
API_KEY = "sk-fuzz-key-0123"
MAX_HEAD = 2048
EXAMPLES = min(FUZZ.max_examples, 800)  # per test: under ~6 s here
_TOK = build_tokenizer()
BODY = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}'
NEXT = b"GET /health HTTP/1.1\r\nhost: proxy\r\n\r\n"  # pipelined after the request under test


@pytest.fixture(scope="module")
def card(tmp_path_factory: pytest.TempPathFactory) -> ModelCard:
    return ModelCard.load(write_model_dir(tmp_path_factory.mktemp("m") / MODEL, _TOK), name=MODEL)


async def _exchange(card: ModelCard, chunks: list[bytes], api_key: str) -> tuple[bytes, bool]:
    """Every byte the proxy wrote, and whether it closed before the client was done."""
    settings = ProxySettings(
        port=0, api_key=api_key, max_header_bytes=MAX_HEAD, max_body_bytes=64 * 1024
    )
    app = ProxyApp(FakeBackend(_TOK), [card], settings)
    server = create_server(app, settings, idle_timeout_s=60)
    conn = _Connection(server)
    transport = MemoryTransport(conn)
    conn.connection_made(transport)
    for chunk in chunks:
        if transport.closing:
            break
        conn.data_received(chunk)
        await _settle(server, conn)
    closed_by_proxy = transport.closing or transport.eof  # closed, or lingering after write_eof
    if not transport.closing:
        conn.eof_received()
        transport.close()
    await _settle(server, conn)
    await asyncio.sleep(0)
    assert conn.closed and not server._tasks
    return bytes(transport.out), closed_by_proxy


def exchange(
    card: ModelCard,
    chunks: list[bytes],
    api_key: str = "",
    allowed_5xx: frozenset[int] = frozenset(),
) -> tuple[list[int], bool]:
    """Statuses of the responses (well formed), whether the proxy closed; no error logged."""
    with structlog.testing.capture_logs() as logs:
        out, closed = asyncio.run(asyncio.wait_for(_exchange(card, chunks, api_key), 20))
    errors = [e for e in logs if e.get("log_level") in {"error", "critical", "exception"}]
    assert not errors, errors
    statuses = [s for s in responses(out) if s >= 200]
    assert all(s < 500 or s in allowed_5xx for s in statuses), statuses
    return statuses, closed


def _post(headers: list[tuple[bytes, bytes]], body: bytes, sep: bytes = b"\r\n") -> bytes:
    lines = [b"POST /v1/completions HTTP/1.1", *(k + b": " + v for k, v in headers)]
    return sep.join(lines) + sep + sep + body


CUTS = st.lists(st.integers(0, 4000), max_size=4)
CASES = st.sampled_from([str.lower, str.upper, str.title])


@st.composite
def smuggled(draw: st.DrawFn) -> tuple[bytes, bool]:
    """Content-Length and Transfer-Encoding both, in any case, order and value."""
    chunked = f"{len(BODY):x}\r\n".encode() + BODY + b"\r\n0\r\n\r\n"
    te = draw(st.sampled_from(["chunked", "Chunked", "gzip, chunked", "identity", "chunked "]))
    cl = draw(st.sampled_from([str(len(BODY)), str(len(chunked)), "0", "5"]))
    pair = [
        (draw(CASES)("content-length").encode(), cl.encode()),
        (draw(CASES)("transfer-encoding").encode(), te.encode()),
    ]
    if draw(st.booleans()):
        pair.reverse()
    headers = [(b"host", b"proxy"), *pair]
    return _post(headers, draw(st.sampled_from([chunked, BODY]))), te.strip().lower() == "chunked"


@st.composite
def bare_lf(draw: st.DrawFn) -> bytes:
    """A valid request head with one or more of its CRLFs a bare LF."""
    head = _post([(b"host", b"proxy"), (b"content-length", str(len(BODY)).encode())], b"")
    ends = [i for i in range(len(head) - 1) if head[i : i + 2] == b"\r\n"]
    picked = draw(st.lists(st.sampled_from(ends), min_size=1, unique=True))
    out = bytearray(head)
    for i in sorted(picked, reverse=True):
        del out[i]  # the \r
    return bytes(out) + BODY


@st.composite
def huge_head(draw: st.DrawFn) -> bytes:
    """A head over the limit: one long header, or many, or a long target."""
    how = draw(st.sampled_from(["one", "many", "target"]))
    size = draw(st.integers(MAX_HEAD + 1, 4 * MAX_HEAD))
    headers = [(b"host", b"proxy"), (b"content-length", str(len(BODY)).encode())]
    if how == "one":
        headers.append((b"x-big", b"a" * size))
    elif how == "many":
        headers += [(f"x-{i}".encode(), b"b" * 30) for i in range(size // 36 + 1)]
    else:
        return b"GET /" + b"c" * size + b" HTTP/1.1\r\nhost: proxy\r\n\r\n"
    return _post(headers, BODY)


def _check_refused_and_closed(
    card: ModelCard, tally: Tally, request: bytes, cuts: list[int], allowed: set[int]
) -> None:
    def run() -> str:
        statuses, closed = exchange(card, _cut(request + NEXT, cuts), "", frozenset(allowed))
        assert len(statuses) == 1 and statuses[0] in allowed, statuses
        assert closed  # and the pipelined request was never answered
        return str(statuses[0])

    tally.run(run)


def test_ambiguous_framing_is_400_and_close(card: ModelCard) -> None:
    tally = Tally("proxy HTTP Content-Length with Transfer-Encoding")

    @settings(FUZZ, max_examples=EXAMPLES)
    @given(smuggled(), CUTS)
    def check(case: tuple[bytes, bool], cuts: list[int]) -> None:
        request, chunked = case
        # A coding h11 does not implement ("gzip, chunked", "identity") is refused
        # before the framing check, with 501 as nginx answers it: closed all the same.
        _check_refused_and_closed(card, tally, request, cuts, {400} if chunked else {501})

    run_fuzz(tally, check)


def test_bare_lf_is_400_and_close(card: ModelCard) -> None:
    tally = Tally("proxy HTTP bare LF in the head")

    @settings(FUZZ, max_examples=EXAMPLES)
    @given(bare_lf(), CUTS)
    def check(request: bytes, cuts: list[int]) -> None:
        _check_refused_and_closed(card, tally, request, cuts, {400})

    run_fuzz(tally, check)


def test_a_head_over_the_limit_is_431_and_close(card: ModelCard) -> None:
    tally = Tally("proxy HTTP heads over max_header_bytes")

    @settings(FUZZ, max_examples=EXAMPLES)
    @given(huge_head(), st.lists(st.integers(0, 10_000), max_size=4))
    def check(request: bytes, cuts: list[int]) -> None:
        _check_refused_and_closed(card, tally, request, cuts, {431})

    run_fuzz(tally, check)


def test_no_key_is_401_before_the_body(card: ModelCard) -> None:
    tally = Tally("proxy HTTP requests without the API key")

    @settings(FUZZ, max_examples=EXAMPLES)
    @given(
        st.sampled_from([None, "Bearer", "Bearer x", "Basic " + API_KEY, "bearer" + API_KEY]),
        st.integers(1, 10_000_000),
    )
    def check(auth: str | None, length: int) -> None:
        headers = [(b"host", b"proxy"), (b"content-length", str(length).encode())]
        if auth is not None:
            headers.append((b"authorization", auth.encode()))

        def run() -> str:
            # The head alone: the body never comes, the answer must not wait for it.
            statuses, closed = exchange(card, [_post(headers, b"")], API_KEY)
            assert statuses == [401] and closed, statuses
            return "401"

        tally.run(run)

    run_fuzz(tally, check)


def test_deep_json_is_400(card: ModelCard) -> None:
    tally = Tally("proxy HTTP deep JSON")

    @settings(FUZZ, max_examples=EXAMPLES)
    @given(
        st.integers(65, 5000),
        st.sampled_from([("[", "]"), ('{"a":', "}")]),
        st.sampled_from(["prompt", "stop", "logit_bias", "response_format", "messages"]),
    )
    def check(depth: int, brackets: tuple[str, str], name: str) -> None:
        opener, closer = brackets
        value = opener * depth + "1" + closer * depth
        body = f'{{"model": "{MODEL}", "{name}": {value}}}'.encode()
        headers = [(b"host", b"proxy"), (b"content-length", str(len(body)).encode())]

        def run() -> str:
            statuses, _closed = exchange(card, [_post(headers, body)])
            assert statuses[:1] == [400], statuses
            return "400"

        tally.run(run)

    run_fuzz(tally, check)


TOKEN = st.text(st.sampled_from("abcxyz-_!#~0123456789"), min_size=1, max_size=12)
FIELD_VALUE = st.text(max_size=40).map(lambda t: t.encode("utf-8", "surrogatepass")) | st.binary(
    max_size=40
)


@st.composite
def random_head(draw: st.DrawFn) -> bytes:
    """A head from plausible parts and junk: any method, target, version, header lines."""
    method = draw(st.sampled_from([b"GET", b"POST", b"HEAD", b"DELETE"]) | st.binary(max_size=8))
    target = draw(
        st.sampled_from([b"/v1/completions", b"/health", b"/v1/models", b"*"])
        | st.binary(max_size=30)
    )
    version = draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.0"]) | st.binary(max_size=10))
    lines = [method + b" " + target + b" " + version]
    for _ in range(draw(st.integers(0, 6))):
        name = draw(TOKEN.map(str.encode) | st.binary(max_size=12))
        sep = draw(st.sampled_from([b": ", b":", b" : ", b":\t", b""]))
        lines.append(name + sep + draw(FIELD_VALUE))
        if draw(st.integers(0, 9)) == 0:
            lines.append(b" folded")  # obs-fold
    return b"\r\n".join(lines) + b"\r\n\r\n"


@st.composite
def chunked_body(draw: st.DrawFn) -> bytes:
    """A chunked body: random chunk sizes (right or wrong), extensions, trailers."""
    out = b""
    data = draw(st.binary(max_size=200) | st.just(BODY))
    pos = 0
    while pos < len(data):
        n = draw(st.integers(1, max(1, len(data) - pos)))
        size = f"{n:x}".encode()
        if draw(st.integers(0, 9)) == 0:
            size = draw(st.sampled_from([b"zz", b"-1", b"ffffffffffffffffff", b"", b"1;ext=1"]))
        out += size + b"\r\n" + data[pos : pos + n] + b"\r\n"
        pos += n
    out += b"0\r\n"
    if draw(st.booleans()):
        out += b"x-trailer: " + draw(FIELD_VALUE) + b"\r\n"
    return out + b"\r\n"


def test_random_heads_and_chunked_bodies_get_2xx_or_4xx(card: ModelCard) -> None:
    tally = Tally("proxy HTTP random heads and chunked bodies")

    @settings(FUZZ, max_examples=EXAMPLES)
    @given(
        random_head() | chunked_body().map(lambda b: _post([(b"host", b"x"), (b"transfer-encoding", b"chunked")], b) ),
        CUTS,
        st.sampled_from(["", API_KEY]),
    )  # fmt: skip
    def check(request: bytes, cuts: list[int], api_key: str) -> None:
        def run() -> str:
            statuses, _closed = exchange(card, _cut(request + NEXT, cuts), api_key)
            return "+".join(sorted({f"{s // 100}xx" for s in statuses})) or "no response"

        tally.run(run)

    run_fuzz(tally, check)
