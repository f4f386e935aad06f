"""A sample of every wire message kind, optional fields both set and left out."""

from __future__ import annotations

from star.wire import (
    Abort,
    Accept,
    Answer,
    Attach,
    Attached,
    Challenge,
    Decision,
    Error,
    ErrorCode,
    Event,
    EventKind,
    Generate,
    Handoff,
    Hello,
    LoadEntry,
    LogprobTokens,
    Message,
    Ping,
    Pong,
    PromptLogprobs,
    Release,
    Report,
    RequestLoad,
    ResumableGenerate,
    Tokens,
)

LOADS = [
    RequestLoad("cmpl-0", 812, 40),
    RequestLoad("cmpl-1", 2048, 1900, 148.5, False, true_remaining=148),
    RequestLoad("cmpl-é", 0, 0, None, True, None),
]

SAMPLES: dict[str, Message] = {
    "report": Report(
        "decode-0",
        "decode",
        17,
        1764201600.25,
        "10.0.0.5:9001",
        262144,
        2860,
        131072,
        0.0183,
        32,
        [2860.0, 2048.5, 0.0],
        LOADS,
    ),
    "report_all_fields": Report(
        "decode-1",
        "decode",
        2**40,
        1764201601.0,
        "[::1]:9002",
        0,
        0,
        1,
        0.0,
        1,
        [],
        [],
        in_flight=["cmpl-2", "cmpl-3"],
        waiting=3,
        preemptions=250,
        draining=True,
        predictor=False,
        pad_share=0.125,
        refused_peers=2,
    ),
    "report_int_in_float_fields": Report(
        "prefill-0",
        "prefill",
        0,
        1764201602,
        "h:1",
        10,
        1,
        2,
        0,
        8,
        [3, 2.5],
        LOADS[:1],
        predictor=True,
    ),
    "decision": Decision(
        "d-1", "cmpl-1", "decode-0", "decode-1", 42, -1.5e3, "predicted", 1764201603.5
    ),
    "decision_manual": Decision(
        "m-1", "cmpl-9", "a", "b", 0, 0.0, "current", 1.0, fence=7, origin="manual", reason="drain"
    ),
    "event": Event(EventKind.FINISHED, 1764201604.0, "proxy:p1"),
    "event_all_fields": Event(
        EventKind.ABORTED,
        1764201605.0,
        "decode-0",
        request="cmpl-1",
        migration="m-1",
        instance="decode-0",
        detail="source: engine_dead",
        data={
            "tokens": 12,
            "ratio": 0.5,
            "ok": True,
            "none": None,
            "nested": {"a": [1, "b", 2.5]},
            "raw": b"\x00\xff",
        },
    ),
    "load": LoadEntry("decode-0", "decode", "10.0.0.5:9001", 2860, 262144, 3.25, 3, 1764201606.0),
    "challenge": Challenge(bytes(range(32))),
    "answer": Answer(b"\x01" * 32, b"\x02" * 16),
    "accept": Accept(b"\xfe" * 32),
    "hello": Hello("decode-0", "decode", "Qwen/Qwen2.5-0.5B"),
    "generate": Generate(3, "cmpl-1", [1, 2, 3], {"max_tokens": 8, "temperature": 0.0}),
    "generate_continued": Generate(
        2**31,
        "cmpl-2",
        list(range(300)),
        {"max_tokens": 300, "stop": ["\n"], "seed": None},
        {"remote_block_ids": [1, 2], "remote_host": "10.0.0.6", "do_remote_prefill": True},
        continued=20,
        fusion=[3.5, 1200.0],
    ),
    "tokens": Tokens(3, [17]),
    "tokens_last": Tokens(
        3, [], "stop", 50256, {"remote_block_ids": [4], "x": None}, num_prompt_tokens=1024
    ),
    "tokens_stop_string": Tokens(4, [1, 2], "stop", "###"),
    "abort": Abort(3),
    "release": Release(3, "m-1"),
    "handoff": Handoff(3, "m-1", {"remote_block_ids": [1, 2, 3], "remote_port": 5600}, 412),
    "handoff_fusion": Handoff(3, "m-1", {}, 0, fusion=[1.0, 2.0]),
    "error": Error(3, ErrorCode.NOT_RELEASABLE, "cmpl-1 is not migratable"),
    "error_connection": Error(-1, "some_future_code", "bad frame"),
    "ping": Ping(0),
    "pong": Pong(2**32 + 5),
}

# Kinds newer than the record (wire_v1_bytes.json): an older peer never gets
# one. LogprobTokens answers only a request with logprobs, which a proxy from
# before it refuses.
NEWER: dict[str, Message] = {
    "logprob_tokens": LogprobTokens(
        3,
        [17, 18],
        "length",
        logprobs=[-0.25, float("-inf")],
        top_ids=[17, 5, 9, 18],
        top_logprobs=[-0.25, -2.5, -1.0, -7.5],
    ),
    # The prompt's logprobs, sent only to a proxy that asked for them.
    "prompt_logprobs": PromptLogprobs(
        3,
        logprobs=[-1.5, float("-inf")],
        ranks=[2, 900],
        top_ids=[4, 17, 9, 4],
        top_logprobs=[-0.5, -1.5, -0.25, -3.0],
    ),
    # A request a client may resume on any proxy, and its takeover (proxy.adopt):
    # only a proxy that knows them sends the first two, and the third answers one.
    "generate_resumable": ResumableGenerate(
        stream=4,
        request_id="cmpl-r",
        prompt_token_ids=[1, 2, 9],
        sampling={"max_tokens": 30},
        continued=1,
        context=b"\x81\xa1v\x01",
    ),
    "attach": Attach(stream=5, request_id="cmpl-r"),
    "attached": Attached(
        stream=5,
        request_id="cmpl-r",
        prompt_token_ids=[1, 2],
        output_token_ids=[9, 10],
        context=b"\x81\xa1v\x01",
        finish_reason="length",
        stop_reason=None,
        released=False,
    ),
}
