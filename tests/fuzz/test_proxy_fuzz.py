"""Fuzzing the proxy's HTTP parsing and OpenAI body validation.

Bytes go through the real :class:`proxy.http.HttpServer` connection (h11) and
:class:`proxy.app.ProxyApp` over an in-memory transport (no sockets), with a
scripted backend. Whatever arrives, the proxy answers with well-formed HTTP
whose statuses are 2xx or 4xx (a 5xx would be a handler bug; nothing here is
draining or failing), logs no error, and finishes every handler task. Bodies
also go straight to :func:`proxy.openai.parse_completion` /
:func:`~proxy.openai.parse_chat`: a parsed request or a 4xx
:class:`~proxy.http.HttpError`, nothing else.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import structlog
from hypothesis import given
from hypothesis import strategies as st

from proxy.app import ProxyApp, create_server
from proxy.http import HttpError, HttpServer, _Connection
from proxy.openai import parse_chat, parse_completion
from proxy.tokenizer import ModelCard
from star.settings import ProxySettings
from tests.fuzz.common import FUZZ, Tally, run_fuzz
from tests.proxy.fakes import FakeBackend, build_tokenizer, write_model_dir

MODEL = "tiny"
API_KEY = "sk-fuzz-key-0123"
PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/models", f"/v1/models/{MODEL}"]
PATHS += ["/health", "/metrics", "/", "/v1/", "/v1/models/", "/v1/completions?x=1", "*"]


@pytest.fixture(scope="module")
def card(tmp_path_factory: pytest.TempPathFactory) -> ModelCard:
    tok = build_tokenizer()
    return ModelCard.load(write_model_dir(tmp_path_factory.mktemp("m") / MODEL, tok), name=MODEL)


# -- an in-memory connection -------------------------------------------------------------


class MemoryTransport(asyncio.Transport):
    """What the proxy writes, kept; closing ends the connection as a socket would."""

    def __init__(self, protocol: _Connection) -> None:
        super().__init__()
        self.protocol = protocol
        self.out = bytearray()
        self.closing = False
        self.eof = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert not self.eof, "wrote after write_eof"
        self.out += data

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        if not self.closing:
            self.closing = True
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    def abort(self) -> None:
        self.close()

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default


async def _settle(server: HttpServer, conn: _Connection) -> None:
    for _ in range(10_000):
        if conn.task is None and not server._tasks:
            return
        await asyncio.sleep(0)
    await asyncio.wait_for(asyncio.gather(*server._tasks, return_exceptions=True), 10)


async def exchange(card: ModelCard, chunks: list[bytes], api_key: str = "") -> bytes:
    """Send ``chunks`` as one client connection; return every byte the proxy wrote."""
    settings = ProxySettings(
        port=0, api_key=api_key, max_header_bytes=2048, max_body_bytes=64 * 1024
    )
    app = ProxyApp(FakeBackend(_TOK), [card], settings)
    server = create_server(app, settings, idle_timeout_s=60)
    conn = _Connection(server)
    transport = MemoryTransport(conn)
    conn.connection_made(transport)
    for chunk in chunks:
        if transport.closing:
            break  # a closed socket delivers nothing more
        conn.data_received(chunk)
        await _settle(server, conn)
    if not transport.closing:
        conn.eof_received()  # the client half-closes, then the socket goes
        transport.close()
    await _settle(server, conn)
    await asyncio.sleep(0)
    assert conn.closed and not server._tasks
    return bytes(transport.out)


_TOK = build_tokenizer()


def responses(data: bytes) -> list[int]:
    """The statuses of the HTTP/1.x responses in ``data``; asserts they are well formed."""
    statuses = []
    pos = 0
    while pos < len(data):
        end = data.index(b"\r\n\r\n", pos)
        head = data[pos:end].decode("latin-1").split("\r\n")
        version, status, *_ = head[0].split(" ", 2)
        assert version in {"HTTP/1.1", "HTTP/1.0"}, head[0]
        statuses.append(int(status))
        headers = dict(line.lower().split(": ", 1) for line in head[1:])
        pos = end + 4
        if int(status) < 200:
            continue
        if "content-length" in headers:
            after = pos + int(headers["content-length"])
            if after == len(data) or data[after:].startswith(b"HTTP/1."):
                pos = after
            else:  # the answer to a HEAD request: the length, no body
                assert pos == len(data) or data[pos:].startswith(b"HTTP/1."), "bad body length"
        elif headers.get("transfer-encoding") == "chunked":
            while True:
                line_end = data.index(b"\r\n", pos)
                size = int(data[pos:line_end], 16)
                pos = line_end + 2 + size + 2
                if size == 0:
                    break
        else:
            pos = len(data)  # a close-delimited body (an HTTP/1.0 client's stream)
        assert pos <= len(data), "a response body is cut short"
    return statuses


def run_exchange(card: ModelCard, chunks: list[bytes], api_key: str = "") -> str:
    with structlog.testing.capture_logs() as logs:
        out = asyncio.run(asyncio.wait_for(exchange(card, chunks, api_key), 20))
    errors = [e for e in logs if e.get("log_level") in {"error", "critical", "exception"}]
    assert not errors, errors
    statuses = responses(out)
    assert all(s < 500 for s in statuses), statuses
    final = sorted({f"{s // 100}xx" for s in statuses if s >= 200})
    return "+".join(final) or "no response"


def _cut(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True) if b > a]


# -- what clients send ------------------------------------------------------------------

JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
JSON_VALUES: st.SearchStrategy[Any] = st.recursive(
    JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
PARAMS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "top_k", "min_p", "n", "stream", "stream_options", "stop", "stop_token_ids", "seed",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs",
    "top_logprobs", "echo", "suffix", "best_of", "user", "ignore_eos", "min_tokens",
    "response_format", "tools", "tool_choice", "add_generation_prompt", "chat_template_kwargs",
    "include_stop_str_in_output", "skip_special_tokens", "continue_final_message",
    "structured_outputs", "guided_json", "guided_regex", "guided_choice",
]  # fmt: skip
MESSAGE = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "x"])
        | JSON_VALUES,
        "content": st.text(max_size=30)
        | st.lists(
            st.fixed_dictionaries(
                {},
                optional={
                    "type": st.sampled_from(["text", "image_url"]) | JSON_VALUES,
                    "text": st.text(max_size=20) | JSON_VALUES,
                },
            ),
            max_size=3,
        )
        | JSON_VALUES,
        "name": JSON_VALUES,
    },
)
PLAUSIBLE = {
    "model": st.just(MODEL) | JSON_VALUES,
    "prompt": st.text(max_size=40)
    | st.lists(st.integers(-5, 700), max_size=8)
    | st.lists(st.text(max_size=8), max_size=3)
    | JSON_VALUES,
    "messages": st.lists(MESSAGE, max_size=4) | JSON_VALUES,
    "max_tokens": st.integers(-2, 600) | JSON_VALUES,
    "n": st.integers(-1, 4) | JSON_VALUES,
    "stream": st.booleans() | JSON_VALUES,
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=3) | JSON_VALUES,
}


@st.composite
def openai_body(draw: st.DrawFn) -> dict[str, Any]:
    """A request body that is nearly right: a valid base, known parameters set right or wrong."""
    body: dict[str, Any] = {}
    if draw(st.integers(0, 4)):  # mostly a request that could be served
        body = {"model": MODEL, "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
        body["max_tokens"] = draw(st.integers(1, 8))
    for name in draw(st.lists(st.sampled_from(PARAMS), max_size=4, unique=True)):
        if draw(st.integers(0, 5)) == 0:
            body.pop(name, None)
        else:
            body[name] = draw(PLAUSIBLE.get(name, JSON_VALUES))
    if draw(st.integers(0, 5)) == 0:
        body[draw(st.text(max_size=10))] = draw(JSON_VALUES)
    return body


@st.composite
def deep_body(draw: st.DrawFn) -> bytes:
    """A parameter nested near and past the interpreter's recursion limit."""
    depth = draw(st.integers(1, 1200))
    opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
    name = draw(st.sampled_from(PARAMS))
    value = opener * depth + "1" + closer * depth
    return f'{{"model": "{MODEL}", "{name}": {value}}}'.encode()


_ODD_BODIES = st.sampled_from(
    [
        b"",
        b"{",
        b"[" * 5000,
        b'{"a":' * 3000,
        b"NaN",
        b'{"model": Infinity}',
        b"\xff\xfe{}",
        b'{"model": "tiny", "prompt": "\\ud800"}',
        b"1" * 5000,
    ]
)
# Half the bodies are nearly-right OpenAI requests, the rest anything at all.
BODY_BYTES: st.SearchStrategy[bytes] = st.sampled_from(
    [openai_body().map(lambda b: json.dumps(b).encode())] * 4
    + [
        deep_body(),
        JSON_VALUES.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=200),
        _ODD_BODIES,
    ]
).flatmap(lambda strategy: strategy)


@st.composite
def http_request(draw: st.DrawFn) -> bytes:
    """An HTTP/1.x request, most of it right, parts of it wrong."""
    # Repeats weight the choices toward requests that get through to the application.
    method = draw(
        st.sampled_from(["POST"] * 6 + ["GET"] * 2 + ["HEAD", "PUT", "OPTIONS", "post", "G\x00T"])
    )
    target = draw(
        st.sampled_from(PATHS + ["/v1/completions", "/v1/chat/completions"] * 4)
        | st.text(max_size=20).map(lambda t: "/" + t)
    )
    version = draw(
        st.sampled_from(["HTTP/1.1"] * 8 + ["HTTP/1.0", "HTTP/2.0", "HTTP/1.1 ", "HTTX/1.1"])
    )
    body = draw(BODY_BYTES)
    headers: list[tuple[str, str]] = []
    if draw(st.booleans()) or version != "HTTP/1.0":
        headers.append(("host", "proxy"))
    framing = draw(
        st.sampled_from(["length"] * 6 + ["chunked"] * 2 + ["wrong-length", "bad-chunked", "none"])
    )
    if framing == "length":
        headers.append(("content-length", str(len(body))))
    elif framing == "wrong-length":
        headers.append(("content-length", draw(st.sampled_from(["-1", "abc", "1e3", "99999999999"])
                                                | st.integers(0, 400).map(str))))  # fmt: skip
    elif framing in {"chunked", "bad-chunked"}:
        headers.append(("transfer-encoding", "chunked"))
        size = (
            f"{len(body):x}"
            if framing == "chunked"
            else draw(st.sampled_from(["zz", "-1", "ffffffffffff", "1"]))
        )
        body = size.encode() + b"\r\n" + body + b"\r\n0\r\n\r\n"
    if draw(st.booleans()):
        auth = draw(st.sampled_from([f"Bearer {API_KEY}", "Bearer", "bearer x", "Basic abc", ""]))
        headers.append(("authorization", auth))
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2]))):
        headers.append(
            (draw(st.sampled_from(["expect", "connection", "x-a", "content-type", "x y", ""])),
             draw(st.sampled_from(["100-continue", "close", "keep-alive", "a\x00b"]) | st.text(max_size=10)))
        )  # fmt: skip
    head = f"{method} {target} {version}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)
    return head.encode("utf-8", "surrogatepass") + b"\r\n" + body


# -- the tests ---------------------------------------------------------------------------


def test_raw_bytes_get_a_4xx_or_nothing(card: ModelCard) -> None:
    tally = Tally("proxy HTTP random bytes")

    @FUZZ
    @given(st.binary(max_size=600), st.lists(st.integers(0, 600), max_size=4))
    def check(data: bytes, cuts: list[int]) -> None:
        tally.run(lambda: run_exchange(card, _cut(data, cuts)))

    run_fuzz(tally, check)


def test_malformed_requests_get_4xx_and_never_5xx(card: ModelCard) -> None:
    tally = Tally("proxy HTTP requests, right and wrong")

    @FUZZ
    @given(
        st.lists(http_request(), min_size=1, max_size=3),
        st.lists(st.integers(0, 20_000), max_size=4),
        st.sampled_from(["", API_KEY]),
    )
    def check(requests: list[bytes], cuts: list[int], api_key: str) -> None:
        data = b"".join(requests)  # pipelined
        tally.run(lambda: run_exchange(card, _cut(data, cuts), api_key))

    run_fuzz(tally, check)


def _parse(parse: Any, card: ModelCard, body: bytes) -> str:
    try:
        parse(body, {MODEL: card})
    except HttpError as exc:
        assert 400 <= exc.status < 500, (exc.status, exc.message)
        json.dumps(exc.payload())  # the error body can be sent
        return f"{exc.status} {exc.code}"
    return "parsed"


def test_well_framed_openai_requests_get_2xx_or_4xx(card: ModelCard) -> None:
    """Right HTTP, nearly-right bodies: the application's whole path, streamed or not."""
    tally = Tally("proxy HTTP well-framed OpenAI requests")

    @FUZZ
    @given(
        st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
        openai_body(),
        st.sampled_from([None, True, False]),
        st.lists(st.integers(0, 2000), max_size=3),
    )
    def check(path: str, body: dict[str, Any], stream: bool | None, cuts: list[int]) -> None:
        if stream is not None:
            body = {**body, "stream": stream}
        raw = json.dumps(body).encode()
        head = f"POST {path} HTTP/1.1\r\nhost: proxy\r\ncontent-length: {len(raw)}\r\n\r\n"
        tally.run(lambda: run_exchange(card, _cut(head.encode() + raw, cuts)))

    run_fuzz(tally, check)


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 100_000,  # json's decoder raised RecursionError: a 500
        b'{"model": "tiny", "prompt": "\\ud800"}',  # the tokenizer raised TypeError: a 500
        b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\udc00"}]}',
        b'{"model": "tiny", "\\uDBFF": 1}',
    ],
)
def test_inputs_the_fuzzer_found_get_400(card: ModelCard, body: bytes) -> None:
    for parse in (parse_completion, parse_chat):
        with pytest.raises(HttpError) as caught:
            parse(body, {MODEL: card})
        assert caught.value.status == 400 and caught.value.code == "invalid_json"
    request = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body)
    assert run_exchange(card, [request + body]) == "4xx"


@pytest.mark.parametrize("role", [[], {}, ["user"]])
def test_an_unhashable_role_gets_400(card: ModelCard, role: object) -> None:
    # CI's fuzz run found {"role": []}: `role not in _ROLES` raised TypeError, a 500.
    body = json.dumps({"model": "tiny", "messages": [{"role": role}]}).encode()
    with pytest.raises(HttpError) as caught:
        parse_chat(body, {MODEL: card})
    assert caught.value.status == 400 and caught.value.param == "messages[0].role"
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n"
    assert run_exchange(card, [head % len(body) + body]) == "4xx"


def test_a_paired_surrogate_escape_is_text(card: ModelCard) -> None:
    body = b'{"model": "tiny", "prompt": "\\ud83d\\ude00"}'
    assert _parse(parse_completion, card, body) == "parsed"


def test_openai_body_validation(card: ModelCard) -> None:
    tally = Tally("proxy OpenAI body validation")

    @FUZZ
    @given(st.sampled_from([parse_completion, parse_chat]), BODY_BYTES)
    def check(parse: Any, body: bytes) -> None:
        tally.run(lambda: _parse(parse, card, body))

    run_fuzz(tally, check)
