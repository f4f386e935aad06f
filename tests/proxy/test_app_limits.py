"""The proxy as strict as nginx (issue 27 item 5), driven over raw sockets.

Each test failed on the tree before the change: the key was checked after the
body was read, deep JSON and long stop strings passed, 5xx bodies carried
instance names, addresses and exception text, and a keyless /health listed
the instances.
"""

from __future__ import annotations

import json
from typing import Any

import structlog

from proxy import sse
from proxy.backend import BackendUnavailable, error_from
from proxy.openai import MAX_STOP, MAX_STOP_CHARS
from proxy.validate import MAX_JSON_DEPTH, json_depth_exceeds
from star.wire import Error
from tests.proxy.conftest import ProxyFactory
from tests.proxy.fakes import Script
from tests.proxy.rawhttp import RawResponse, exchange, parse_responses, request_bytes

INTERNALS = ("decode-7f3a", "10.1.2.3", "7001", "Errno", "refused")


async def post(port: int, payload: dict[str, Any], **headers: str) -> RawResponse:
    raw = request_bytes("POST", "/v1/completions", payload, {"connection": "close", **headers})
    (resp,) = parse_responses(await exchange(port, raw, wait_s=10))
    return resp


async def get(port: int, path: str, **headers: str) -> RawResponse:
    raw = request_bytes("GET", path, headers={"connection": "close", **headers})
    (resp,) = parse_responses(await exchange(port, raw, wait_s=10))
    return resp


async def test_the_api_key_is_checked_when_the_head_arrives(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(api_key="sekrit")
    # A body announced (under max_body_bytes) and never sent: the 401 must not wait for it.
    head = b"POST /v1/completions HTTP/1.1\r\nhost: a\r\ncontent-length: 1000000\r\n"
    for auth in (b"", b"authorization: Bearer nope\r\n"):
        data = await exchange(proxy.port, head + auth + b"\r\n", wait_s=10)
        assert data, "no answer before the body"
        (resp,) = parse_responses(data)
        assert resp.status == 401 and resp.headers["www-authenticate"] == "Bearer"
        assert resp.headers["connection"] == "close"
    assert proxy.backend.calls == []
    ok = await post(proxy.port, {"model": "tiny", "prompt": "x"}, authorization="Bearer sekrit")
    assert ok.status == 200


def _nested(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


async def test_json_nested_deeper_than_the_cap_gets_400(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(Script(text="{}"))

    def body(schema_levels: int) -> dict[str, Any]:
        # body (1) > response_format (2) > json_schema (3) > schema (4 ...)
        return {
            "model": "tiny",
            "prompt": "x",
            "max_tokens": 4,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"schema": _nested(schema_levels)},
            },
        }

    deep = await post(proxy.port, body(900))  # reached the wire encoder: RecursionError, 502
    assert deep.status == 400 and deep.json()["error"]["code"] == "invalid_json"
    assert f"deeper than {MAX_JSON_DEPTH}" in deep.json()["error"]["message"]
    at_cap = await post(proxy.port, body(MAX_JSON_DEPTH - 3))
    assert at_cap.status == 200
    assert len(proxy.backend.calls) == 1


def test_json_depth_ignores_brackets_in_strings_and_does_not_recurse() -> None:
    assert not json_depth_exceeds(json.dumps({"s": "[" * 1000 + "{" * 1000}).encode())
    assert not json_depth_exceeds(json.dumps({"s": '\\"[[[' * 100}).encode(), limit=3)
    assert json_depth_exceeds(b"[" * 1_000_000)  # no RecursionError, no decoding
    assert json_depth_exceeds(json.dumps([[[1]]]).encode(), limit=2)
    assert not json_depth_exceeds(json.dumps([[[1]]]).encode(), limit=3)


async def test_stop_strings_are_capped_in_count_and_length(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy()
    base = {"model": "tiny", "prompt": "x", "max_tokens": 4}
    longest = await post(proxy.port, {**base, "stop": ["x" * MAX_STOP_CHARS] * MAX_STOP})
    assert longest.status == 200
    for stop in (["x" * (MAX_STOP_CHARS + 1)], "y" * 100_000, ["a"] * (MAX_STOP + 1)):
        resp = await post(proxy.port, {**base, "stop": stop})
        assert resp.status == 400, stop if isinstance(stop, list) else "long string"
        assert resp.json()["error"]["param"] == "stop"
    assert len(proxy.backend.calls) == 1


async def test_5xx_bodies_carry_a_request_id_not_internals(make_proxy: ProxyFactory) -> None:
    detail = (
        "decode instance decode-7f3a at 10.1.2.3:7001 unreachable: [Errno 111] Connection refused"
    )
    rejected = error_from(
        Error(stream=1, code="bad_request", message="prompt too long"), "decode-7f3a"
    )

    def script(req):  # type: ignore[no-untyped-def]
        temperature = req.sampling.get("temperature")
        if temperature == 0.1:
            return Script(fail_before=BackendUnavailable(detail))
        if temperature == 0.2:
            return Script(fail_after=(2, RuntimeError(f"bad frame from 10.1.2.3:7001: {detail}")))
        if temperature == 0.3:
            return Script(fail_before=rejected)
        return Script(fail_after=(2, KeyError(detail)))

    proxy = await make_proxy(script)
    base = {"model": "tiny", "prompt": "x"}
    with structlog.testing.capture_logs() as logs:
        unavailable = await post(proxy.port, {**base, "temperature": 0.1})
        broken = await post(proxy.port, {**base, "temperature": 0.2, "stream": True})
        bad_request = await post(proxy.port, {**base, "temperature": 0.3})
        bug = await post(proxy.port, {**base, "temperature": 0.4})
    events = [e.data for e in sse.SSEDecoder().feed(broken.body)]
    assert broken.status == 200 and events[-1] == "[DONE]"
    errors = {
        "unavailable": (unavailable.status, unavailable.json()["error"]),
        "mid-stream": (502, json.loads(events[-2])["error"]),
        "bug": (bug.status, bug.json()["error"]),
    }
    assert [status for status, _ in errors.values()] == [503, 502, 500]
    failed = {e["request_id"]: e for e in logs if e["event"] == "request_failed"}
    for name, (_, error) in errors.items():
        message = error["message"]
        assert not any(word in message for word in INTERNALS), (name, message)
        request_id = message.rsplit("request id ", 1)[1].rstrip(")")
        assert "10.1.2.3" in failed[request_id]["error"], name  # the log has what went wrong
    assert any(e["event"] == "generate_failed" and e["exc_info"] for e in logs)
    # The engine's 400 keeps its own words, without the instance that said them.
    assert bad_request.status == 400
    assert bad_request.json()["error"]["message"] == "prompt too long"


async def test_health_lists_instances_only_to_key_holders(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(api_key="sekrit")
    keyless = await get(proxy.port, "/health")
    wrong = await get(proxy.port, "/health", authorization="Bearer nope")
    for resp in (keyless, wrong):
        assert resp.status == 200 and resp.json() == {"ok": True}
    full = await get(proxy.port, "/health", authorization="Bearer sekrit")
    assert (
        full.status == 200 and full.json()["backend"] == "fake" and "active_streams" in full.json()
    )
    proxy.backend.ok = False
    sick = await get(proxy.port, "/health")
    assert sick.status == 503 and sick.json() == {"ok": False}
    # Without a key configured there is nothing to hold back (a loopback-only proxy).
    open_proxy = await make_proxy()
    assert (await get(open_proxy.port, "/health")).json()["backend"] == "fake"
