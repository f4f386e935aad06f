"""Fuzzing the signed bus's verifier (star.bus.signing, Publisher.decode_or_bury).

Genuine entries (messages of every bus kind, signed by each role's key under
each stream's key) and mutations of them (a bit of the body or the tag
flipped, the tag cut, its role renamed, another entry's tag, another
stream, another cluster's key, random bytes for any field) go through the
same ``decode_or_bury`` that every GroupReader and Subscriber runs. Whatever
arrives, nothing raises; an entry is returned (applied) only if it is exactly
what a role allowed to write its stream signed and it decodes; every other is
dead-lettered with one of the documented reasons (``unsigned``,
``bad_signature``, ``wrong_role``, or the decoder's refusal) and counted.

Sans IO: the bus's Redis is never touched (its dead-lettering is recorded).
"""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from star.bus import Bus
from star.bus.signing import (
    ALLOWED,
    BAD_SIGNATURE,
    ROLES,
    UNSIGNED,
    WRONG_ROLE,
    Signer,
    new_keyrings,
)
from star.settings import BusSettings, RedisSettings
from star.wire import BUS_MESSAGES, encode
from tests.fuzz.common import FUZZ, Tally, run_fuzz
from tests.fuzz.strategies import message

SECRET = "s3cret-of-this-cluster"
STREAMS = ("reports", "decisions", "events")
SIGNERS = {role: Signer(SECRET, role) for role in ROLES}
FOREIGN = Signer(new_keyrings()["operator"])  # another cluster's keys
REFUSALS = {UNSIGNED, BAD_SIGNATURE, WRONG_ROLE}
EXAMPLES = min(FUZZ.max_examples, 300)  # each input checks a batch: ~5 s in all


class RecordingBus(Bus):
    """A bus whose dead-lettering is recorded instead of written (no Redis)."""

    def __init__(self) -> None:
        super().__init__(None, BusSettings(), RedisSettings(), SECRET)  # type: ignore[arg-type]
        self.dead: list[tuple[str, str]] = []

    async def dead_letter(
        self, stream_key: str, entry_id: str, reason: str, body: bytes, quiet: bool = False
    ) -> None:
        self.dead.append((entry_id, reason))


MUTATIONS = ["none", "flip_body", "flip_sig", "cut_sig", "role", "swap_sig", "restream"]
MUTATIONS += ["foreign", "no_sig", "junk_sig", "junk_body", "no_body", "non_ascii", "signed_junk"]


@st.composite
def entry(draw: st.DrawFn) -> tuple[str, dict[bytes, Any], str]:
    """(stream, raw fields as Redis returns them, the mutation applied)."""
    stream = draw(st.sampled_from(STREAMS))
    msg = draw(st.one_of([message(c) for c in BUS_MESSAGES]))
    body = encode(msg)
    role = draw(st.sampled_from(ROLES))
    key = f"star:{stream}"
    sig = SIGNERS[role].sign(key, body).encode()
    how = draw(st.sampled_from(MUTATIONS))
    raw: dict[bytes, Any] = {b"kind": msg.KIND.encode(), b"body": body, b"sig": sig}
    if how == "flip_body" and body:
        i = draw(st.integers(0, len(body) - 1))
        raw[b"body"] = body[:i] + bytes([body[i] ^ (1 << draw(st.integers(0, 7)))]) + body[i + 1 :]
    elif how == "flip_sig":
        i = draw(st.integers(0, len(sig) - 1))
        raw[b"sig"] = sig[:i] + draw(st.sampled_from([b"0", b"f", b":", b"x"])) + sig[i + 1 :]
    elif how == "cut_sig":
        raw[b"sig"] = sig[: draw(st.integers(0, len(sig) - 1))]
    elif how == "role":
        other = draw(st.sampled_from([*ROLES, "root", "", "worker "]))
        raw[b"sig"] = other.encode() + b":" + sig.partition(b":")[2]
    elif how == "swap_sig":
        other_key = f"star:{draw(st.sampled_from(STREAMS))}"
        raw[b"sig"] = SIGNERS[draw(st.sampled_from(ROLES))].sign(other_key, body + b"x").encode()
    elif how == "restream":
        stream = draw(st.sampled_from(STREAMS))
    elif how == "foreign":
        raw[b"sig"] = FOREIGN.sign(key, body).encode()
    elif how == "no_sig":
        del raw[b"sig"]
    elif how == "junk_sig":
        raw[b"sig"] = draw(st.binary(max_size=200))
    elif how == "junk_body":
        raw[b"body"] = draw(st.binary(max_size=300))
    elif how == "signed_junk":  # a writer's key, a body that is no message: the decoder refuses
        raw[b"body"] = draw(st.binary(max_size=300))
        raw[b"sig"] = SIGNERS[draw(st.sampled_from(sorted(ALLOWED[stream])))].sign(
            key, raw[b"body"]
        )
    elif how == "no_body":
        del raw[b"body"]
    elif how == "non_ascii":
        raw[b"sig"] = "worker:" + draw(st.text(min_size=1, max_size=70))
        raw[b"sig"] = raw[b"sig"].encode("utf-8", "surrogatepass")
    return stream, raw, how


def _genuine(stream: str, raw: dict[bytes, Any]) -> bool:
    """Whether ``raw`` is exactly what a role allowed on ``stream`` signed there."""
    key, body, sig = f"star:{stream}", raw.get(b"body"), raw.get(b"sig")
    if not isinstance(body, bytes) or not isinstance(sig, bytes):
        return False
    return any(
        SIGNERS[role].sign(key, body).encode() == sig for role in ALLOWED[stream]
    ) or any(  # Ed25519 signatures are not unique: check those with the public key
        role in ("scheduler", "operator")
        and sig.startswith(role.encode() + b":")
        and Signer(SECRET).check(key, body, sig) is None
        for role in ALLOWED[stream]
    )


def check_batch(batch: list[tuple[str, dict[bytes, Any], str]]) -> str:
    bus = RecordingBus()
    applied: list[str] = []
    for n, (stream, raw, _how) in enumerate(batch):
        rows = [(f"{n}-0".encode(), raw)]
        got = asyncio.run(bus.decode_or_bury(f"star:{stream}", rows, None))  # type: ignore[arg-type]
        if got:
            assert _genuine(stream, raw), (stream, raw)
            applied.append(got[0].id)
    dead = dict(bus.dead)
    assert len(applied) + len(dead) == len(batch)
    refused = {r if r in REFUSALS else "undecodable" for r in dead.values()}
    assert sum(bus.refusals.total.values()) == sum(r in REFUSALS for r in dead.values())
    return "+".join(sorted(refused)) or "applied"


def test_no_entry_is_applied_unless_a_writer_of_its_kind_signed_it() -> None:
    tally = Tally("bus verifier, genuine and mutated entries")

    @settings(FUZZ, max_examples=EXAMPLES)
    @given(st.lists(entry(), min_size=1, max_size=6))
    def check(batch: list[tuple[str, dict[bytes, Any], str]]) -> None:
        tally.run(lambda: check_batch(batch))

    run_fuzz(tally, check)
    assert "applied" in tally.outcomes or any("+" in k for k in tally.outcomes)


def test_check_never_raises_on_any_bytes() -> None:
    tally = Tally("bus verifier, random tags")
    reader = Signer(SECRET)

    @settings(FUZZ, max_examples=min(FUZZ.max_examples, 1000))
    @given(
        st.sampled_from([*STREAMS, "load", "dispatch", "other", ""]).map(lambda s: f"star:{s}"),
        st.binary(max_size=100),
        st.none() | st.binary(max_size=200) | st.text(max_size=200),
    )
    def check(key: str, body: bytes, sig: bytes | str | None) -> None:
        tally.run(lambda: str(reader.check(key, body, sig)))

    run_fuzz(tally, check)
    assert set(tally.outcomes) <= {*REFUSALS}
