"""``star top``: a live terminal view of the fleet, refreshed from the bus.

The adapter around :mod:`star.top`: a :class:`star.fleet.feed.Feed` reads
``<prefix>:reports``, ``:decisions`` and ``:events`` in order (starting
``--window`` seconds back, so the first frame already shows the fleet) and
the leader lock into a :class:`~star.top.TopState`; this module draws a
frame every ``--interval``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

from star.aio import deadline
from star.bus import Bus, BusUnavailable
from star.cli.common import CliError, add_settings_args, guarded, settings_from_args
from star.fleet.feed import Feed
from star.logs import configure_logging
from star.settings import LogSettings, Settings
from star.top import TopState, render_view

ENTER_SCREEN = "\x1b[?1049h\x1b[?25l"  # alternate screen, hide the cursor
LEAVE_SCREEN = "\x1b[?25h\x1b[?1049l"

EPILOG = """\
what it shows:
  header      the scheduler leader (from the <prefix>:leader lock) and its mode
              (from its newest decision), decode totals, outcome counts
  DECODE      per decode instance: KV bar and %, used/capacity tokens, running and
              waiting requests, mean step ms, preemptions (cumulative), state:
              ok, DRAINING (stopping; its requests are moved away), STALE (no
              report for scheduler.staleness_s), DOWN (worker_down seen)
  PREFILL     the same, one line per prefill instance
  IN FLIGHT   decisions without an outcome yet, with their phase
              (decided, migrating, released, kv_pulled)
  DECISIONS   newest first: ΔV (negative = variance lowered), reason (balance or
              drain) and the outcome from <prefix>:events: resumed, aborted (src
              or dst), refused (why), expired, or unknown once older than
              scheduler.decision_timeout_s without one in sight

examples:
  star top                                   # live; q or Ctrl-C quits
  star top --set bus.prefix=bench-3          # another cluster on the same Redis
  star top --once --width 120                # one frame, for a script or a log
  star top --once --json | jq '.decode[] | {instance, kv_fraction}'
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "top",
        help="live terminal view: KV per instance, migrations in flight, last decisions",
        description=(
            "Watch the fleet rebalance: read the bus (reports, decisions, events) and "
            "redraw every --interval seconds. Starts --window seconds back so the first "
            "frame already shows the fleet and the recent decisions."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=0.5,
        metavar="S",
        help="seconds between frames (default 0.5)",
    )
    parser.add_argument(
        "--window",
        type=float,
        default=60.0,
        metavar="S",
        help="read this far back at start; an instance silent this long leaves the view (default 60)",
    )
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    parser.add_argument("--json", action="store_true", help="with --once: print the view as JSON")
    parser.add_argument("--width", type=int, metavar="N", help="columns (default: the terminal's)")
    parser.add_argument(
        "--height",
        type=int,
        metavar="N",
        help="lines (default: the terminal's; unlimited with --once)",
    )
    parser.add_argument(
        "--no-color",
        action="store_true",
        help="no ANSI colour (default: colour on a terminal, unless NO_COLOR is set)",
    )
    add_settings_args(parser)
    parser.set_defaults(func=guarded(run))


def run(args: argparse.Namespace) -> int:
    if not args.interval > 0:
        raise CliError(f"--interval must be > 0 seconds, got {args.interval}")
    if not args.window >= 0:
        raise CliError(f"--window must be >= 0 seconds, got {args.window}")
    if args.json and not args.once:
        raise CliError("--json needs --once (a live view is text)")
    for flag in ("width", "height"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise CliError(f"--{flag} must be >= 1, got {value}")
    settings = settings_from_args(args)
    live_tty = not args.once and sys.stdout.isatty()
    # Logs go to stderr; on a live screen only errors (the frame says what is wrong).
    configure_logging(LogSettings(level="error") if live_tty else settings.log, sys.stderr)
    try:
        return asyncio.run(_top(settings, args))
    except BusUnavailable as exc:
        raise CliError(str(exc)) from None


async def _top(settings: Settings, args: argparse.Namespace) -> int:
    bus = Bus.for_cluster(settings, "operator")
    state = TopState(
        staleness_s=settings.scheduler.staleness_s,
        decision_timeout_s=settings.scheduler.decision_timeout_s,
        forget_s=max(args.window, settings.scheduler.staleness_s),
    )
    feed = Feed(bus, state, args.window)
    title = f"star top [{settings.bus.prefix}]"
    colour = not args.no_color and sys.stdout.isatty() and "NO_COLOR" not in os.environ
    try:
        if args.once:
            await feed.refresh()
            view = state.view(time.time())
            if args.json:
                print(json.dumps(dataclasses.asdict(view), indent=2))
            else:
                width = args.width or shutil.get_terminal_size((120, 40)).columns
                print(
                    render_view(view, width, args.height or 1_000_000, colour=colour, title=title)
                )
            return 0
        await _live(feed, args, colour, title)
        return 0
    finally:
        await bus.close()


async def _live(feed: Feed, args: argparse.Namespace, colour: bool, title: str) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    tty = sys.stdout.isatty()
    with _keyboard(loop, stop), _screen(tty):
        stopping = asyncio.ensure_future(stop.wait())
        next_at = loop.time()
        try:
            while not stop.is_set():
                refresh = asyncio.ensure_future(feed.refresh())
                await asyncio.wait({refresh, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if stop.is_set():
                    refresh.cancel()
                    with contextlib.suppress(asyncio.CancelledError, BusUnavailable):
                        await refresh
                    break
                try:
                    refresh.result()
                    feed.state.errors = []
                except BusUnavailable as exc:
                    feed.state.errors = [f"bus unreadable, retrying: {exc}"]
                _draw(feed.state, args, colour, title, tty)
                next_at += args.interval
                now = loop.time()
                if next_at < now:  # a slow refresh: skip the missed frames
                    next_at = now
                with contextlib.suppress(TimeoutError):
                    async with deadline(next_at - now):
                        await asyncio.shield(stopping)
        finally:
            stopping.cancel()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)


def _draw(state: TopState, args: argparse.Namespace, colour: bool, title: str, tty: bool) -> None:
    view = state.view(time.time())
    try:  # the terminal's own size, resized or not ($COLUMNS may be stale)
        size = os.get_terminal_size(sys.stdout.fileno())
    except OSError:
        size = shutil.get_terminal_size((120, 40))
    if not tty:  # a pipe or a file: frames one after another
        frame = render_view(view, args.width or size.columns, args.height or 1_000_000, title=title)
        sys.stdout.write(frame + "\n\n")
    else:
        # One column spare: a full-width line leaves the cursor in the
        # terminal's pending-wrap state, where clearing to the end of the line
        # would erase its last character.
        width = (args.width or size.columns) - 1
        frame = render_view(view, width, args.height or size.lines, colour=colour, title=title)
        sys.stdout.write("\x1b[H" + "\x1b[K\n".join(frame.split("\n")) + "\x1b[K\x1b[J")
    sys.stdout.flush()


@contextlib.contextmanager
def _screen(tty: bool) -> Iterator[None]:
    if not tty:
        yield
        return
    sys.stdout.write(ENTER_SCREEN)
    sys.stdout.flush()
    try:
        yield
    finally:
        sys.stdout.write(LEAVE_SCREEN)
        sys.stdout.flush()


@contextlib.contextmanager
def _keyboard(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> Iterator[None]:
    """``q`` quits when stdin is a terminal (read unbuffered; Ctrl-C still signals)."""
    if not sys.stdin.isatty():
        yield
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved: Any = termios.tcgetattr(fd)

    def on_key() -> None:
        try:
            data = os.read(fd, 64)
        except OSError:
            data = b""
        if not data or b"q" in data.lower():
            stop.set()

    tty.setcbreak(fd)
    loop.add_reader(fd, on_key)
    try:
        yield
    finally:
        loop.remove_reader(fd)
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
