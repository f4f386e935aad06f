"""One ``star top`` frame as plain text (sans-IO).

:func:`render` lays a :class:`~star.top.state.FleetView` out in ``width`` x
``height`` cells: a header (leader, mode, fleet totals), the decode instances
with a KV bar each, the prefill instances, the migrations in flight and the
newest decisions with their ΔV, reason and outcome. Every line is cut to
``width``; when the frame is taller than ``height`` the blank separators go first, then the
rows from the bottom up (decisions, migrations in flight, prefill, decode),
each cut section ending in a "+N more" line. ANSI colour is added after cutting, only when asked.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from star.top.state import DecisionRow, FleetView, InstanceRow, TopState

FULL = "█"
EMPTY = "░"
PARTIAL = " ▏▎▍▌▋▊▉"  # 0/8 .. 7/8 of a cell
ANSI = {
    "bold": "\x1b[1m",
    "dim": "\x1b[2m",
    "red": "\x1b[31m",
    "green": "\x1b[32m",
    "yellow": "\x1b[33m",
    "cyan": "\x1b[36m",
}
RESET = "\x1b[0m"
STATUS_STYLE = {
    "resumed": "green",
    "aborted": "red",
    "refused": "yellow",
    "expired": "red",
    "unknown": "dim",
}
STATE_STYLE = {"draining": "yellow", "stale": "red", "down": "red"}
MIN_WIDTH = 20

Seg = tuple[str, str]  # text, style ("" for none)
Line = list[Seg]


def bar(fraction: float, cells: int) -> str:
    """A bar of ``cells`` characters filled to ``fraction`` (0..1) in eighths."""
    eighths = round(min(max(fraction, 0.0), 1.0) * cells * 8)
    full, part = divmod(eighths, 8)
    text = FULL * full + (PARTIAL[part] if part else "")
    return text + EMPTY * (cells - len(text))


def fit(line: Line, width: int) -> Line:
    """``line`` cut to ``width`` characters, ending in "…" where it was cut."""
    if sum(len(t) for t, _ in line) <= width:
        return line
    out: Line = []
    room = width - 1
    for text, style in line:
        if room <= 0:
            break
        out.append((text[:room], style))
        room -= len(text[:room])
    out.append(("…", ""))
    return out


def paint(line: Line, colour: bool) -> str:
    if not colour:
        return "".join(t for t, _ in line).rstrip()
    return "".join(f"{ANSI[s]}{t}{RESET}" if s and t else t for t, s in line).rstrip()


def kv_style(fraction: float) -> str:
    return "green" if fraction < 0.7 else "yellow" if fraction < 0.9 else "red"


@dataclass(frozen=True, slots=True)
class _Section:
    head: list[Line]
    rows: list[Line]
    noun: str  # for "+N more <noun>"


def render(
    state: TopState,
    width: int,
    height: int,
    now: float | None = None,
    *,
    colour: bool = False,
    title: str = "star top",
) -> str:
    """The frame for ``state`` at wall-clock ``now`` (default: the time now)."""
    return render_view(
        state.view(time.time() if now is None else now), width, height, colour=colour, title=title
    )


def render_view(
    view: FleetView, width: int, height: int, *, colour: bool = False, title: str = "star top"
) -> str:
    width = max(width, MIN_WIDTH)
    top = _header(view, title)
    sections = [
        _instances("DECODE", view.decode, view.decode + view.prefill, width),
        _in_flight(view),
        _decisions(view),
    ]
    if view.prefill:
        sections.insert(1, _instances("PREFILL", view.prefill, view.decode + view.prefill, width))
    lines = top + _allot(sections, height - len(top))
    return "\n".join(paint(fit(line, width), colour) for line in lines[: max(height, 1)])


def _allot(sections: list[_Section], budget: int) -> list[Line]:
    """Heads and rows top-down within ``budget`` lines (blank separators go first)."""
    if sum(len(s.head) + len(s.rows) for s in sections) > budget:
        sections = [dataclasses.replace(s, head=[h for h in s.head if h]) for s in sections]
    out: list[Line] = []
    spare = budget
    for s in sections:
        if spare <= 0:
            break
        out += s.head[:spare]
        spare -= len(s.head[:spare])
        take = len(s.rows) if len(s.rows) <= spare else max(spare - 1, 0)
        out += s.rows[:take]
        spare -= take
        if take < len(s.rows) and spare > 0:
            out.append([(f"  … +{len(s.rows) - take} more {s.noun}", "dim")])
            spare -= 1
    return out


def _header(view: FleetView, title: str) -> list[Line]:
    first: Line = [(title, "bold"), ("  ", "")]
    if view.leader is None:
        first.append(("leader: none known", "yellow"))
    else:
        first.append((f"leader {view.leader.node} (fence {view.leader.fence})", ""))
        if view.leader.mode:
            first.append((f"  mode {view.leader.mode}", ""))
    first.append((time.strftime("  %H:%M:%S", time.gmtime(view.now)) + " UTC", "dim"))
    used = sum(i.used_tokens for i in view.decode)
    cap = sum(i.capacity_tokens for i in view.decode)
    pct = 100 * used / cap if cap else 0.0
    second: Line = [
        (
            f"decode {len(view.decode)}  kv {used}/{cap} ({pct:.0f}%)  "
            f"running {sum(i.running for i in view.decode)}  "
            f"waiting {sum(i.waiting for i in view.decode)}  "
            f"in flight {len(view.in_flight)}  decisions {len(view.decisions)}",
            "",
        )
    ]
    for status in ("resumed", "aborted", "refused", "expired"):
        if view.outcomes.get(status):
            second.append((f"  {status} {view.outcomes[status]}", STATUS_STYLE[status]))
    lines = [first, second]
    lines += [[(f"! {e}", "red")] for e in view.errors]
    return lines


def _instances(
    title: str, rows: list[InstanceRow], everyone: list[InstanceRow], width: int
) -> _Section:
    name_w = min(max([len(title), *(len(i.instance) for i in everyone)]), 24)
    tokens_w = max([9, *(len(f"{i.used_tokens}/{i.capacity_tokens}") for i in everyone)])
    # name, bar, kv%, used/cap, run, wait, step ms, preempt, state ("STALE 99s")
    fixed = (name_w + 1) + 6 + (tokens_w + 1) + 5 + 5 + 8 + 8 + 2 + 10
    cells = min(max(width - fixed, 4), 40)
    head: Line = [
        (
            f"{title:<{name_w}} {'KV':<{cells}} {'kv%':>5} {'used/cap':>{tokens_w}}"
            f" {'run':>4} {'wait':>4} {'step ms':>7} {'preempt':>7}  state",
            "bold",
        )
    ]
    out: list[Line] = []
    for i in rows:
        line: Line = [
            (f"{i.instance[:name_w]:<{name_w}} ", ""),
            (bar(i.kv_fraction, cells), kv_style(i.kv_fraction)),
            (
                f" {100 * i.kv_fraction:>4.0f}% {f'{i.used_tokens}/{i.capacity_tokens}':>{tokens_w}}"
                f" {i.running:>4} {i.waiting:>4} {i.step_ms:>7.1f} {i.preemptions:>7}  ",
                "",
            ),
        ]
        if i.state == "ok":
            line.append(("ok", "dim"))
        else:
            label = i.state.upper() + (f" {i.age_s:.0f}s" if i.state == "stale" else "")
            line.append((label, STATE_STYLE[i.state]))
        out.append(line)
    if not rows:
        out.append([("  (no reports on the bus)", "dim")])
    return _Section([[], head], out, "instances")


def _move(d: DecisionRow) -> str:
    return f"{d.request}  {d.source} -> {d.target}"


def _in_flight(view: FleetView) -> _Section:
    head: Line = [(f"MIGRATIONS IN FLIGHT ({len(view.in_flight)})", "bold")]
    rows: list[Line] = [
        [(f"  {d.age_s:>5.1f}s  {d.status:<9}  {d.reason:<7}  {_move(d)}  {d.id}", "cyan")]
        for d in view.in_flight
    ]
    return _Section([[], head], rows, "migrations")


def _decisions(view: FleetView) -> _Section:
    # What an operator scans for comes first (age, outcome, ΔV, reason), ids last,
    # so a narrow terminal cuts the least useful part.
    head: Line = [(f"LAST DECISIONS ({len(view.decisions)}, newest first)", "bold")]
    rows: list[Line] = []
    for d in view.decisions:
        extra = [f"({d.detail})"] if d.detail else []
        if d.took_s is not None:
            extra.append(f"in {d.took_s:.1f}s")
        if d.origin != "scheduler":
            extra.append(d.origin)
        rows.append(
            [
                (f"  {d.age_s:>4.0f}s ago  ", ""),
                (f"{d.status:<9}", STATUS_STYLE.get(d.status, "cyan")),
                (f"  ΔV {d.delta_v:<+10.4g}  {d.reason:<7}  {_move(d)}  ", ""),
                ("  ".join([*extra, d.id]), "dim"),
            ]
        )
    if not view.decisions:
        rows.append([("  (none in the window)", "dim")])
    return _Section([[], head], rows, "decisions")
