"""The event bus: Redis streams through redis-py's asyncio client (docs/design.md §4).

Every role publishes with :class:`Bus` (msgpack ``body`` beside a few plain
fields, ``XADD ... MAXLEN ~``, undecodable entries to ``<prefix>:dead``) and
reads with :class:`GroupReader` (at-least-once, explicit ack) or
:class:`Subscriber` (in order, never skipping). Every call waits out a Redis
outage with bounded, logged backoff, then raises :class:`BusUnavailable`;
iterating a reader outlives outages of any length.
"""

from star.bus.connection import (
    STREAMS,
    TRANSIENT,
    BusError,
    BusUnavailable,
    Connection,
    Keys,
    Outage,
    RawRow,
    as_str,
    connect_redis,
    first_stream_rows,
    xrevrange,
)
from star.bus.publish import DeadEntry, Entry, Publisher, parse_dead
from star.bus.queries import Bus
from star.bus.readers import GroupReader, Subscriber

__all__ = [
    "STREAMS",
    "TRANSIENT",
    "Bus",
    "BusError",
    "BusUnavailable",
    "Connection",
    "DeadEntry",
    "Entry",
    "GroupReader",
    "Keys",
    "Outage",
    "Publisher",
    "RawRow",
    "Subscriber",
    "as_str",
    "connect_redis",
    "first_stream_rows",
    "parse_dead",
    "xrevrange",
]
