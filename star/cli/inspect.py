"""``star inspect STREAM``: decoded entries of a STAR stream, readable or JSON."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import enum
import json
from typing import Any

import msgspec

from star.bus import STREAMS, Bus, BusUnavailable, Entry, Subscriber, first_stream_rows, parse_dead
from star.cli.common import CliError, add_settings_args, guarded, settings_from_args
from star.settings import Settings
from star.wire import Decision, Event, LoadEntry, Message, Report, WireError

CHOICES = (*STREAMS, "load")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "inspect",
        help="print decoded entries of a STAR stream",
        description=(
            "Print the last entries of a STAR stream, decoded: reports (worker state), "
            "decisions (migrations), events (lifecycle), dead (entries that failed to "
            "decode, with the reason), or the load hash (the dispatch view). "
            "Raw entries stay readable with `redis-cli XRANGE <prefix>:<stream> - +`."
        ),
        epilog="example: star inspect decisions --follow",
    )
    parser.add_argument("stream", choices=CHOICES, metavar="STREAM", help=f"one of {', '.join(CHOICES)}")
    parser.add_argument("--count", "-n", type=int, default=20, metavar="N", help="last N entries (default 20)")
    parser.add_argument("--follow", "-f", action="store_true", help="keep printing new entries (Ctrl-C stops)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    add_settings_args(parser)
    parser.set_defaults(func=guarded(run))


def run(args: argparse.Namespace) -> int:
    if args.count < 0:
        raise CliError(f"--count must be >= 0, got {args.count}")
    settings = settings_from_args(args)
    try:
        return asyncio.run(_inspect(settings, args))
    except BusUnavailable as exc:
        raise CliError(str(exc)) from None


def to_jsonable(value: Any) -> Any:
    if isinstance(value, Message):  # its kind, then its fields (``v`` is the stream's, not shown)
        names = (f for f in value.__struct_fields__ if f != "v")
        return {"kind": value.KIND, **{f: to_jsonable(getattr(value, f)) for f in names}}
    if isinstance(value, msgspec.Struct):
        return {f: to_jsonable(getattr(value, f)) for f in value.__struct_fields__}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    return value


def _when(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%H:%M:%S.%f")[:-3]


def describe(msg: Message) -> str:
    """One readable line per message."""
    if isinstance(msg, Report):
        cap = max(msg.capacity_tokens, 1)
        reqs = " ".join(
            f"{r.id}:{r.tokens}" + (f"/+{r.predicted_remaining:.0f}" if r.predicted_remaining is not None else "")
            for r in msg.requests[:8]
        )
        more = f" (+{len(msg.requests) - 8})" if len(msg.requests) > 8 else ""
        return (
            f"{_when(msg.ts)} report   {msg.instance} [{msg.role}] seq={msg.seq} "
            f"kv={msg.used_tokens}/{msg.capacity_tokens} ({100 * msg.used_tokens / cap:.0f}%) "
            f"step={msg.step_time_s * 1000:.1f}ms running={len(msg.requests)} {reqs}{more}"
        )
    if isinstance(msg, Decision):
        return (
            f"{_when(msg.ts)} decision {msg.id} move {msg.request} {msg.source} -> {msg.target} "
            f"dV={msg.delta_v:.4g} mode={msg.mode} tick={msg.tick} origin={msg.origin}"
        )
    if isinstance(msg, Event):
        parts = [f"{_when(msg.ts)} event    {msg.event.value:<15} from {msg.origin}"]
        for name in ("request", "migration", "instance", "detail"):
            value = getattr(msg, name)
            if value:
                parts.append(f"{name}={value}")
        parts.extend(f"{k}={v}" for k, v in msg.data.items())
        return " ".join(parts)
    if isinstance(msg, LoadEntry):
        return (
            f"{_when(msg.ts)} load     {msg.instance} [{msg.role}] {msg.address} "
            f"tokens={msg.tokens}/{msg.capacity_tokens} w={msg.workload:.0f} running={msg.running}"
        )
    return repr(msg)


def _print_entry(entry_id: str, msg: Message, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"id": entry_id, **to_jsonable(msg)}), flush=True)
    else:
        print(f"{entry_id:<16} {describe(msg)}", flush=True)


async def _inspect(settings: Settings, args: argparse.Namespace) -> int:
    bus = Bus.for_cluster(settings, "operator")
    try:
        if args.stream == "load":
            for name, load in sorted((await bus.read_load()).items()):
                _print_entry(name, load, args.json)
            return 0
        rows = await bus.tail(args.stream, args.count) if args.count else []
        for entry_id, raw in rows:
            _print_raw(bus, args.stream, entry_id, raw, args.json)
        if args.follow:
            start = rows[-1][0] if rows else await bus.last_id(args.stream)
            sub = Subscriber(bus, args.stream, start=start)
            if args.stream == "dead":
                while True:
                    batch = await bus.retrying(
                        "XREAD", lambda: bus.redis.xread({sub.key: sub.last_id}, block=1000)
                    )
                    for dead_id, dead_raw in first_stream_rows(batch):
                        sub.last_id = dead_id.decode()
                        if dead_raw is not None:
                            _print_raw(bus, "dead", sub.last_id, dead_raw, args.json)
            async for entry in sub:
                _print_entry(entry.id, entry.msg, args.json)
        return 0
    finally:
        await bus.close()


def _print_raw(bus: Bus, stream: str, entry_id: str, raw: dict[bytes, bytes], as_json: bool) -> None:
    if stream == "dead":
        dead = parse_dead(entry_id, raw)
        if as_json:
            print(json.dumps(to_jsonable(dead)), flush=True)
        else:
            print(f"{entry_id:<16} dead     from {dead.stream} {dead.original_id}: {dead.reason}", flush=True)
        return
    key = bus.keys.stream(stream)
    if bus.signer is not None:
        refused = bus.signer.check(key, raw.get(b"body", b""), raw.get(b"sig"))
        if refused is not None:  # shown, never trusted: a reader dead-letters it
            print(f"{entry_id:<16} REFUSED ({refused}): not signed with this cluster.secret", flush=True)
            return
    try:
        entry: Entry = bus.decode_fields(key, entry_id, raw, None)
    except WireError as exc:
        print(f"{entry_id:<16} UNDECODABLE: {exc}", flush=True)
        return
    _print_entry(entry.id, entry.msg, as_json)
