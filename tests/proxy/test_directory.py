"""Where the proxy's directory says a request runs (from the workers' reports)."""

from __future__ import annotations

from unittest import mock

from proxy.cluster import Directory
from star.wire import RequestLoad
from tests.reports import report


def test_a_request_runs_where_the_latest_fresh_report_lists_it() -> None:
    directory = Directory(bus=None, staleness_s=5.0)  # type: ignore[arg-type]
    directory.note_report(report("decode-0", requests=[RequestLoad("a", 10, 1)]))
    directory.note_report(report("decode-1", requests=[RequestLoad("b", 10, 1)]))
    assert (directory.running_on("a"), directory.running_on("b")) == ("decode-0", "decode-1")
    assert directory.running_on("c") is None
    # The next report of decode-0 no longer lists "a" (it finished or moved).
    directory.note_report(report("decode-0", seq=2))
    assert directory.running_on("a") is None
    # A report older than the staleness bound says nothing.
    with mock.patch("proxy.cluster.time.monotonic", return_value=10**9):
        assert directory.running_on("b") is None
