"""Several hosts on one machine: a network namespace per host on one bridge.

Each :class:`Host` is a network namespace with one veth link (``eth0``
inside) to a bridge in the root namespace, an address in a private /24 that
this run picks (``10.77.<k>.0/24``), and nothing else: processes started with
:meth:`Network.argv` see only loopback and that link, so every byte between
two hosts crosses a link that :meth:`Network.partition`, :meth:`Network.shape`
and :meth:`Network.link` can break. The root namespace keeps ``.1`` on the
bridge, so a client here reaches the hosts (and nothing else is routed).

Faults are ``tc`` rules (iproute2 only; iptables/nft need not exist):

* ``partition(a, b)``: an ``htb`` qdisc on each side's ``eth0`` with a
  class that drops, and a ``u32`` filter sending packets for the other
  side's address there; other traffic is untouched.
* ``link(host, up=False)``: the host's link down (it is cut from everyone).
* ``shape(host, delay_ms, loss_pct)``: this kernel has no ``netem``, so a
  host named in ``shaped`` gets a TAP pair instead of a veth pair, and a
  relay process (:mod:`benchmarks.chaos.wire`) between the two delays and
  drops frames in user space, each direction.

Needs root (``CAP_NET_ADMIN``); :func:`unavailable` says why not, in one line.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "10.77"


class NetnsError(Exception):
    """An ``ip``/``tc`` command failed (its stderr is the message)."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    probe = f"star-probe-{os.getpid()}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add refused: {made.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


@dataclass(frozen=True)
class Host:
    """One simulated host: a namespace, its address, its link's root-side name."""

    name: str
    ns: str
    ip: str
    peer: str  # the veth (or TAP) end in the root namespace, on the bridge
    inner: str  # its other end's name before it moved into the namespace (as eth0)


@dataclass
class Network:
    """A bridge and one namespace per host; :meth:`close` removes them all.

    ``with Network(["redis", "proxy", "d0"]) as net: net.hosts["d0"].ip``
    """

    names: list[str]
    shaped: set[str] = field(default_factory=set)  # hosts whose link goes through user space
    hosts: dict[str, Host] = field(default_factory=dict)
    subnet: str = ""
    bridge: str = ""
    _relays: dict[str, subprocess.Popen[str]] = field(default_factory=dict)

    def __enter__(self) -> Network:
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        if len(self.names) > 250:
            raise NetnsError("at most 250 hosts on one bridge")
        tag = os.getpid() % 100_000
        self.subnet = f"{PREFIX}.{_free_octet()}"
        self.bridge = f"stbr{tag}"
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for i, name in enumerate(self.names, start=2):
            host = Host(
                name, f"star{tag}-{name}", f"{self.subnet}.{i}", f"st{tag}v{i}", f"st{tag}i{i}"
            )
            self.hosts[name] = host
            inner = host.inner
            _run("ip", "netns", "add", host.ns)
            if name in self.shaped:
                self._relays[name] = _relay(inner, host.peer)
            else:
                _run("ip", "link", "add", host.peer, "type", "veth", "peer", "name", inner)
            _run("ip", "link", "set", host.peer, "master", self.bridge, "up")
            _run("ip", "link", "set", inner, "netns", host.ns)
            self._in(host, "ip", "link", "set", inner, "name", "eth0")
            self._in(host, "ip", "addr", "add", f"{host.ip}/24", "dev", "eth0")
            self._in(host, "ip", "link", "set", "eth0", "up")
            self._in(host, "ip", "link", "set", "lo", "up")

    def close(self) -> None:
        """Remove every namespace and the bridge (veth pairs go with them)."""
        for relay in self._relays.values():
            with contextlib.suppress(OSError):
                relay.stdin.close()  # type: ignore[union-attr]
            try:
                relay.wait(5)
            except subprocess.TimeoutExpired:
                relay.kill()
                relay.wait(5)
        self._relays.clear()
        for host in self.hosts.values():
            _run("ip", "netns", "del", host.ns, check=False)
            _run("ip", "link", "del", host.peer, check=False)
            _run("ip", "link", "del", host.inner, check=False)
        if self.bridge:
            _run("ip", "link", "del", self.bridge, check=False)
        self.hosts.clear()

    @property
    def gateway(self) -> str:
        """The root namespace's address on the bridge (where a client here sends from)."""
        return f"{self.subnet}.1"

    def argv(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace (same pid: ``ip netns exec`` execs)."""
        return ["ip", "netns", "exec", self.hosts[host].ns, *argv]

    def _in(self, host: Host, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return _run("ip", "netns", "exec", host.ns, *argv, check=check)

    # -- faults ---------------------------------------------------------------

    def partition(self, a: str, b: str) -> None:
        """Drop every packet between hosts ``a`` and ``b`` (both directions)."""
        for src, dst in ((a, b), (b, a)):
            host = self.hosts[src]
            self._drop_band(host)
            rule = f"filter add dev eth0 parent 1: protocol ip prio 1 u32 match ip dst {self.hosts[dst].ip}/32 flowid 1:20"
            self._in(host, "tc", *rule.split())

    def heal(self) -> None:
        """Undo every partition; bring every link up."""
        for name in self._relays:
            self.shape(name)
        for host in self.hosts.values():
            self._in(host, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
            self.link(host.name, up=True)

    def shape(self, host: str, delay_ms: float = 0.0, loss_pct: float = 0.0) -> None:
        """Delay and random loss on both directions of a shaped host's link (0: none)."""
        relay = self._relays.get(host)
        if relay is None or relay.stdin is None or relay.stdout is None:
            raise NetnsError(f"{host} is not a shaped host (Network(shaped={{...}}))")
        relay.stdin.write(json.dumps({"delay_ms": delay_ms, "loss_pct": loss_pct}) + "\n")
        relay.stdin.flush()
        if relay.stdout.readline().strip() != "ok":
            raise NetnsError(f"the link relay of {host} did not answer")

    def link(self, host: str, up: bool) -> None:
        """Set ``host``'s link up or down (down: it reaches no one, loopback aside)."""
        self._in(self.hosts[host], "ip", "link", "set", "eth0", "up" if up else "down")

    def _drop_band(self, host: Host) -> None:
        """An ``htb`` root on ``eth0``: class 1:10 passes everything, 1:20 drops.

        This kernel has no ``netem``, ``prio`` or ``gact``: the drop class is
        an 8 bit/s class without burst and a queue of length 0, so what the
        filters send there is dropped.
        """
        shown = self._in(host, "tc", "qdisc", "show", "dev", "eth0").stdout
        if "htb 1:" in shown:
            return
        for rule in (
            "qdisc replace dev eth0 root handle 1: htb default 10",
            "class add dev eth0 parent 1: classid 1:10 htb rate 100gbit",
            "class add dev eth0 parent 1: classid 1:20 htb rate 8bit ceil 8bit burst 1b cburst 1b",
            "qdisc add dev eth0 parent 1:20 handle 20: pfifo limit 0",
        ):
            self._in(host, "tc", *rule.split())


def _relay(inner: str, outer: str) -> subprocess.Popen[str]:
    """Two TAP devices and the process that copies frames between them (:mod:`.wire`)."""
    for tap in (inner, outer):
        _run("ip", "tuntap", "add", "dev", tap, "mode", "tap")
    relay = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.chaos.wire", inner, outer],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert relay.stdout is not None
    if relay.stdout.readline().strip() != "ok":
        relay.kill()
        raise NetnsError(f"the link relay for {inner} did not start")
    return relay


def _free_octet() -> int:
    """A third octet no address on this machine uses within ``10.77.0.0/16``."""
    shown = _run("ip", "-o", "-4", "addr", "show").stdout
    used = {
        int(word.split(".")[2])
        for word in shown.split()
        if word.startswith(PREFIX + ".") and word.count(".") == 3
    }
    start = os.getpid() % 250
    for k in range(250):
        octet = (start + k) % 250
        if octet not in used:
            return octet
    raise NetnsError(f"every {PREFIX}.<k>.0/24 is in use on this machine")


@contextlib.contextmanager
def network(names: list[str]) -> Iterator[Network]:
    """:class:`Network` as a context manager (namespaces removed on any exit)."""
    with Network(list(names)) as net:
        yield net
