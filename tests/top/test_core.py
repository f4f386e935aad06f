"""``star top``'s sans-IO core: the fold of bus messages and the text frame."""

from __future__ import annotations

import dataclasses
import json
import re

import msgspec
import pytest

from star.top import TopState, bar, render, render_view
from star.top.render import EMPTY, FULL, PARTIAL
from star.wire import Decision, Event, EventKind, Message, RequestLoad
from tests.reports import report

NOW = 1_800_000_000.0
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def rep(instance: str, used: int, *, ts: float = NOW - 0.1, **kw: object) -> Message:
    base = report(instance, used=used, capacity=10_000)
    return msgspec.structs.replace(base, ts=ts, **kw)  # type: ignore[arg-type]


def dec(mid: str, *, ts: float = NOW - 1.0, **kw: object) -> Decision:
    base = Decision(mid, f"cmpl-{mid}", "decode-0", "decode-1", 1, -1234.5, "predicted", ts)
    return msgspec.structs.replace(base, **kw)  # type: ignore[arg-type]


def ev(kind: EventKind, *, ts: float = NOW - 0.5, **kw: object) -> Event:
    return Event(kind, ts, "proxy:p", **kw)  # type: ignore[arg-type]


def state(*msgs: Message, **kw: float) -> TopState:
    s = TopState(staleness_s=3.0, decision_timeout_s=15.0, forget_s=60.0, **kw)  # type: ignore[arg-type]
    s.fold_all(list(msgs))
    return s


# -- the bar --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fraction", "cells", "full", "partial"),
    [
        (0.0, 10, 0, ""),
        (0.25, 20, 5, ""),
        (0.5, 10, 5, ""),
        (0.33, 10, 3, PARTIAL[2]),  # 3.3 cells = 26.4 eighths -> 3 full + 2/8
        (1.0, 10, 10, ""),
        (1.7, 10, 10, ""),  # over-reporting never overflows the column
        (-0.2, 10, 0, ""),
        (0.01, 40, 0, PARTIAL[3]),
    ],
)
def test_bar_fills_in_eighths_and_keeps_its_width(
    fraction: float, cells: int, full: int, partial: str
) -> None:
    text = bar(fraction, cells)
    assert len(text) == cells
    assert text.count(FULL) == full
    assert text == FULL * full + partial + EMPTY * (cells - full - len(partial))


# -- the fold: decisions and their outcomes -------------------------------------


@pytest.mark.parametrize(
    ("events", "status", "detail", "took"),
    [
        ([], "decided", "", None),
        ([ev(EventKind.MIGRATING, migration="m")], "migrating", "", None),
        (
            [ev(EventKind.MIGRATING, migration="m"), ev(EventKind.RELEASED, migration="m")],
            "released",
            "",
            None,
        ),
        ([ev(EventKind.KV_PULLED, migration="m")], "kv_pulled", "", None),
        ([ev(EventKind.RESUMED, migration="m", ts=NOW - 0.25)], "resumed", "", 0.75),
        ([ev(EventKind.ABORTED, migration="m", detail="src")], "aborted", "src", 0.5),
        (
            [ev(EventKind.REFUSED, migration="m", detail="not migratable")],
            "refused",
            "not migratable",
            0.5,
        ),
        ([ev(EventKind.EXPIRED, migration="m")], "expired", "", 0.5),
        # the first outcome counts; a later one does not rewrite it
        (
            [ev(EventKind.RESUMED, migration="m"), ev(EventKind.ABORTED, migration="m", ts=NOW)],
            "resumed",
            "",
            0.5,
        ),
        # another migration's events do not touch this one
        ([ev(EventKind.RESUMED, migration="other")], "decided", "", None),
    ],
)
def test_a_decision_shows_its_phase_then_its_outcome(
    events: list[Event], status: str, detail: str, took: float | None
) -> None:
    view = state(dec("m"), *events).view(NOW)
    (row,) = view.decisions
    assert (row.status, row.detail, row.took_s) == (status, detail, took)
    assert (view.in_flight == [row]) is (
        status in ("decided", "migrating", "released", "kv_pulled")
    )


def test_an_outcome_folded_before_its_decision_still_counts() -> None:
    s = state(ev(EventKind.RESUMED, migration="m"), dec("m"))
    (row,) = s.view(NOW).decisions
    assert row.status == "resumed" and not s.view(NOW).in_flight


def test_a_decision_past_the_timeout_without_outcome_is_unknown_not_in_flight() -> None:
    view = state(dec("m", ts=NOW - 20)).view(NOW)
    assert view.decisions[0].status == "unknown" and view.in_flight == []


def test_decisions_newest_first_in_flight_oldest_first_and_counted() -> None:
    s = state(
        dec("a", ts=NOW - 5),
        dec("b", ts=NOW - 4),
        dec("c", ts=NOW - 3, reason="drain"),
        dec("d", ts=NOW - 2),
        ev(EventKind.RESUMED, migration="a"),
        ev(EventKind.REFUSED, migration="d"),
    )
    view = s.view(NOW)
    assert [d.id for d in view.decisions] == ["d", "c", "b", "a"]
    assert [d.id for d in view.in_flight] == ["b", "c"]
    assert view.outcomes == {"resumed": 1, "refused": 1, "decided": 2}
    assert view.decisions[1].reason == "drain"


def test_only_the_newest_decisions_are_kept() -> None:
    s = TopState(keep=3)
    s.fold_all([dec(str(i), ts=NOW - 10 + i) for i in range(5)])
    assert [d.id for d in s.view(NOW).decisions] == ["4", "3", "2"]


# -- the fold: instances ----------------------------------------------------------


@pytest.mark.parametrize(
    ("msgs", "expected"),
    [
        ([rep("decode-0", 10)], "ok"),
        ([rep("decode-0", 10, draining=True)], "draining"),
        ([rep("decode-0", 10, ts=NOW - 5)], "stale"),  # older than staleness_s
        (
            [
                rep("decode-0", 10),
                Event(EventKind.INSTANCE_STALE, NOW, "scheduler:a", instance="decode-0"),
            ],
            "stale",
        ),
        (  # a report after the stale event: back
            [
                Event(EventKind.INSTANCE_STALE, NOW - 1, "scheduler:a", instance="decode-0"),
                rep("decode-0", 10, ts=NOW - 0.5),
            ],
            "ok",
        ),
        (
            [
                rep("decode-0", 10, draining=True),
                Event(EventKind.WORKER_DOWN, NOW, "decode-0", instance="decode-0"),
            ],
            "down",
        ),
        (
            [
                rep("decode-0", 10, ts=NOW - 2),
                Event(EventKind.WORKER_DOWN, NOW - 1.5, "decode-0", instance="decode-0"),
                Event(EventKind.WORKER_UP, NOW - 1, "decode-0", instance="decode-0"),
                rep("decode-0", 10, ts=NOW - 0.5),
            ],
            "ok",
        ),
    ],
)
def test_instance_state(msgs: list[Message], expected: str) -> None:
    (row,) = state(*msgs).view(NOW).decode
    assert row.state == expected


def test_instances_split_by_role_in_natural_order_and_old_ones_leave() -> None:
    s = state(
        rep("decode-10", 1),
        rep("decode-2", 2),
        rep("prefill-0", 3, role="prefill"),
        rep("decode-9", 4, ts=NOW - 61),  # past forget_s
    )
    view = s.view(NOW)
    assert [i.instance for i in view.decode] == ["decode-2", "decode-10"]
    assert [i.instance for i in view.prefill] == ["prefill-0"]


def test_an_older_report_does_not_replace_a_newer_one() -> None:
    s = state(rep("decode-0", 500, seq=2, ts=NOW - 0.1), rep("decode-0", 100, seq=1, ts=NOW - 0.2))
    (row,) = s.view(NOW).decode
    assert row.used_tokens == 500


def test_instance_row_carries_the_report() -> None:
    r = rep(
        "decode-0",
        2500,
        requests=[RequestLoad("a", 10, 1), RequestLoad("b", 20, 2)],
        waiting=3,
        preemptions=7,
        step_time_s=0.0123,
    )
    (row,) = state(r).view(NOW).decode
    assert (row.kv_fraction, row.running, row.waiting, row.preemptions) == (0.25, 2, 3, 7)
    assert row.step_ms == pytest.approx(12.3)


# -- the fold: leader and mode -----------------------------------------------------


def leader_event(node: str, fence: int, ts: float) -> Event:
    return Event(EventKind.LEADER, ts, f"scheduler:{node}", data={"fence": fence})


@pytest.mark.parametrize(
    ("msgs", "lock", "expected"),
    [
        ([], False, None),
        ([leader_event("a", 3, NOW - 9), leader_event("b", 4, NOW - 1)], False, ("b", 4, None)),
        ([leader_event("a", 3, NOW - 9)], "b|5", ("b", 5, None)),  # the lock says who leads now
        ([leader_event("a", 3, NOW - 9)], None, None),  # read, and nobody holds it
        ([dec("m", mode="current")], "b|5", ("b", 5, "current")),
        (
            [dec("m", mode="current"), dec("n", mode="oracle", origin="manual")],
            "b|5",
            ("b", 5, "current"),
        ),
    ],
)
def test_leader_and_mode(
    msgs: list[Message], lock: str | bool | None, expected: tuple[str, int, str | None] | None
) -> None:
    s = state(*msgs)
    if lock is not False:
        s.set_leader_lock(lock)  # type: ignore[arg-type]
    leader = s.view(NOW).leader
    assert (None if leader is None else (leader.node, leader.fence, leader.mode)) == expected


def test_the_view_is_json() -> None:
    s = state(rep("decode-0", 10), dec("m"), ev(EventKind.RESUMED, migration="m"))
    s.set_leader_lock("a|1")
    doc = json.loads(json.dumps(dataclasses.asdict(s.view(NOW))))
    assert doc["decode"][0]["instance"] == "decode-0"
    assert doc["decisions"][0]["status"] == "resumed" and doc["leader"]["node"] == "a"


# -- the frame --------------------------------------------------------------------


def fleet() -> TopState:
    s = state(
        rep("decode-0", 2500),
        rep("decode-1", 7500, draining=True),
        rep("decode-2", 9900, ts=NOW - 10),
        rep("prefill-0", 100, role="prefill"),
        dec("m1", ts=NOW - 3, delta_v=-12345.0),
        ev(EventKind.RESUMED, migration="m1", ts=NOW - 2),
        dec("m2", ts=NOW - 1, reason="drain", source="decode-1", target="decode-0"),
        ev(EventKind.RELEASED, migration="m2"),
        dec("m3", ts=NOW - 0.5, delta_v=-7.5),
        ev(EventKind.ABORTED, migration="m3", detail="dst"),
    )
    s.set_leader_lock("node-a|4")
    return s


def rows(frame: str) -> dict[str, str]:
    return {
        line.split()[0]: line
        for line in frame.splitlines()
        if line.startswith(("decode-", "prefill-"))
    }


def fill(line: str) -> float:
    cells: str
    (cells,) = re.findall(f"[{FULL}{EMPTY}{PARTIAL[1:]}]+", line)
    return (
        cells.count(FULL) + sum((PARTIAL.index(c)) / 8 for c in cells if c in PARTIAL[1:])
    ) / len(cells)


def test_frame_shows_every_part() -> None:
    frame = render(fleet(), 140, 60, NOW)
    assert "leader node-a (fence 4)  mode predicted" in frame
    head = next(line for line in frame.splitlines() if line.startswith("DECODE"))
    for column in ("KV", "kv%", "used/cap", "run", "wait", "step ms", "preempt", "state"):
        assert column in head
    r = rows(frame)
    assert r["decode-0"].endswith("ok") and "2500/10000" in r["decode-0"]
    assert r["decode-1"].endswith("DRAINING") and r["decode-2"].endswith("STALE 10s")
    assert "PREFILL" in frame and "prefill-0" in r
    flights = frame.split("MIGRATIONS IN FLIGHT (1)")[1].split("LAST DECISIONS")[0].split()
    assert flights == ["1.0s", "released", "drain", "cmpl-m2", "decode-1", "->", "decode-0", "m2"]
    decisions = frame.split("LAST DECISIONS")[1].splitlines()[1:]
    assert [d.split()[-1] for d in decisions] == ["m3", "m2", "m1"]  # newest first
    assert decisions[2].split() == [
        "3s",
        "ago",
        "resumed",
        "ΔV",
        "-1.234e+04",
        "balance",
        "cmpl-m1",
        "decode-0",
        "->",
        "decode-1",
        "in",
        "1.0s",
        "m1",
    ]
    assert decisions[1].split()[2:7] == ["released", "ΔV", "-1234", "drain", "cmpl-m2"]
    assert decisions[0].split()[2:6] == ["aborted", "ΔV", "-7.5", "balance"]
    assert "(dst)  in 0.0s  m3" in decisions[0]


@pytest.mark.parametrize("width", [60, 100, 140, 200])
def test_bar_fill_is_proportional_to_kv_use(width: int) -> None:
    r = rows(render(fleet(), width, 60, NOW))
    cells = len(re.findall(f"[{FULL}{EMPTY}{PARTIAL[1:]}]+", r["decode-0"])[0])
    for name, used in (
        ("decode-0", 0.25),
        ("decode-1", 0.75),
        ("decode-2", 0.99),
        ("prefill-0", 0.01),
    ):
        assert fill(r[name]) == pytest.approx(used, abs=1 / (8 * cells) + 1e-9)


@pytest.mark.parametrize("width", [20, 33, 50, 79, 120])
def test_every_line_fits_the_width(width: int) -> None:
    frame = render(fleet(), width, 60, NOW)
    lines = frame.splitlines()
    assert all(len(line) <= width for line in lines)
    if width < 100:
        assert any(line.endswith("…") for line in lines)  # cut, and it says so
    assert any(line.startswith("decode-0") for line in lines)


@pytest.mark.parametrize("height", [9, 12, 16, 20])
def test_a_short_screen_drops_decisions_first(height: int) -> None:
    frame = render(fleet(), 140, height, NOW)
    lines = frame.splitlines()
    assert len(lines) <= height
    assert all(name in frame for name in ("decode-0", "decode-1", "decode-2"))
    if "m1" not in frame:  # the screen was full before the oldest decision
        assert len(lines) == height
        assert "LAST DECISIONS" not in frame or "more decisions" in lines[-1]


def test_many_instances_on_a_short_screen_say_how_many_are_hidden() -> None:
    s = state(*(rep(f"decode-{i}", 100 * i) for i in range(30)))
    frame = render(s, 120, 20, NOW)
    assert len(frame.splitlines()) <= 20
    shown = sum(line.startswith("decode-") for line in frame.splitlines())
    assert f"+{30 - shown} more instances" in frame


def test_colour_only_when_asked_and_it_adds_nothing_visible() -> None:
    plain = render(fleet(), 120, 60, NOW)
    coloured = render(fleet(), 120, 60, NOW, colour=True)
    assert "\x1b[" not in plain and "\x1b[31m" in coloured  # red: decode-2 is stale
    assert ANSI.sub("", coloured) == plain


def test_an_empty_bus_renders() -> None:
    frame = render_view(TopState().view(NOW), 80, 24)
    assert "leader: none known" in frame and "(no reports on the bus)" in frame
    assert "(none in the window)" in frame
