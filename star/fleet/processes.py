"""Process groups: each child in a session of its own, stopped group and all.

A :class:`Launcher` starts every child with ``start_new_session`` so that
stopping it kills the whole process group (vLLM's engine-core children
included), and with ``PR_SET_PDEATHSIG`` so that a parent killed outright
(SIGKILL) takes its children along. :func:`on_sigterm_raise` makes a SIGTERM
unwind like Ctrl-C (:class:`Terminated`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType


@dataclass
class Child:
    name: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    pass_fds: tuple[int, ...] = ()  # inherited descriptors (the proxy's listening socket)


@dataclass
class Launcher:
    run_dir: Path
    env: dict[str, str]
    children: list[Child] = field(default_factory=list)

    def start(
        self,
        name: str,
        argv: list[str],
        extra_env: dict[str, str] | None = None,
        pass_fds: tuple[int, ...] = (),
        stdin: bytes | None = None,
    ) -> Child:
        """Start ``argv`` in a session of its own; ``stdin``, if given, is written
        to its standard input, which is then closed (a secret it must not see
        on its command line, where every local user can read it)."""
        child = Child(
            name, argv, self.run_dir / f"{name}.log", None, dict(extra_env or {}), pass_fds
        )
        with child.log.open("wb") as out:
            child.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**self.env, **(extra_env or {})},
                start_new_session=True,
                pass_fds=pass_fds,
                preexec_fn=_die_with_parent(),
            )
        self.children.append(child)
        if stdin is not None:
            assert child.proc.stdin is not None
            with contextlib.suppress(BrokenPipeError):
                child.proc.stdin.write(stdin)
            child.proc.stdin.close()
        return child

    def restart(self, child: Child, log: Path) -> Child:
        """Start ``child``'s command again in its place; its old log is renamed ``log``."""
        with contextlib.suppress(OSError):
            child.log.rename(log)
        index = self.children.index(child)
        self.children.remove(child)
        again = self.start(child.name, child.argv, child.extra_env, child.pass_fds)
        self.children.remove(again)
        self.children.insert(index, again)
        return again

    def dead(self) -> Child | None:
        for child in self.children:
            if child.proc is not None and child.proc.poll() is not None:
                return child
        return None

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM every process group, wait, then SIGKILL what is left."""
        for child in reversed(self.children):
            _signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for child in self.children:
            if child.proc is None:
                continue
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(max(0.1, deadline - time.monotonic()))
        for child in self.children:
            _signal_group(child, signal.SIGKILL)  # engine-core grandchildren too
            if child.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.proc.wait(5)
        # SIGKILL is asynchronous: return once no member of any group is left
        # (a killed process on a loaded host can take seconds to be reaped).
        groups = {c.proc.pid for c in self.children if c.proc is not None}
        deadline = time.monotonic() + 30
        while group_members(groups) and time.monotonic() < deadline:
            time.sleep(0.05)


def group_members(groups: set[int]) -> list[tuple[int, int, str]]:
    """(pid, process group, name) of the live (non-zombie) processes in ``groups``.

    Reads ``/proc`` (Linux); elsewhere it only checks the groups' leaders.
    """
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        alive = []
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, 0)
                alive.append((pgid, pgid, "?"))
        return alive
    out = []
    for stat in proc.glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # exited while we looked
        fields = text[text.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[2]) in groups:
            name = text[text.index("(") + 1 : text.rindex(")")]
            out.append((int(stat.parent.name), int(fields[2]), name))
    return out


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel SIGKILL the child when this process dies.

    Each child runs in its own session, so a SIGKILL of this process (which
    no handler sees) reaches none of them: without this they ran on, engines
    and all. The kernel sends the signal when the *thread* that forked exits,
    so only children started from the main thread get it (it lives as long as
    the process). A worker's engine core ends itself once the worker is gone
    (``workers.parent.end_with_parent``). Linux only; None elsewhere.
    """
    if not sys.platform.startswith("linux"):
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def _signal_group(child: Child, sig: signal.Signals) -> None:
    if child.proc is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.proc.pid, sig)


class Terminated(BaseException):
    """SIGTERM arrived; a BaseException so ``except Exception`` cannot swallow it."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated(signal.Signals(signum).name)


SigHandler = Callable[[int, FrameType | None], object] | int | None


def on_sigterm_raise() -> SigHandler:
    """Make SIGTERM raise :class:`Terminated` (main thread only; returns the old handler)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _raise_terminated)


def restore_sigterm(previous: SigHandler) -> None:
    if previous is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, previous)
