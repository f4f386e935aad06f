"""``star proxy --api-key``: still honoured, but the environment is the way.

A command line is readable by every local user (``ps``, ``/proc/PID/cmdline``):
``--help`` points at ``STAR_PROXY_API_KEY``, and a key given with the flag is
warned about in the proxy's log (the key itself never shows).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from star.cli.main import main

# ``star`` commands configure logging onto a capture stream; it ends with the test.
pytestmark = pytest.mark.usefixtures("restore_logging")


KEY = "sk-Cmdline-Key-93b1"


def _proxy(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``star proxy`` up to its socket: ``--fd`` names no open file, so it stops there
    (exit 2) after its settings and logging are set up, before it serves."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("STAR_")}
    return subprocess.run(
        [sys.executable, "-m", "star.cli.main", "proxy", *args, "--fd", "987"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, "STAR_LOG_FORMAT": "json", **env},
    )


def _warnings(stderr: str) -> list[dict[str, str]]:
    lines = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    return [line for line in lines if line["event"] == "api_key_on_command_line"]


def test_proxy_api_key_on_the_command_line_is_warned_about() -> None:
    out = _proxy(["--api-key", KEY], {})
    assert out.returncode == 2 and "--fd 987: not an open socket" in out.stderr
    (warning,) = _warnings(out.stderr)
    assert warning["level"] == "warning"
    assert "visible to local users in the process list" in warning["detail"]
    assert "use STAR_PROXY_API_KEY" in warning["detail"]
    assert KEY not in out.stdout + out.stderr


def test_proxy_api_key_from_the_environment_is_not_warned_about() -> None:
    out = _proxy([], {"STAR_PROXY_API_KEY": KEY})
    assert out.returncode == 2 and "--fd 987: not an open socket" in out.stderr
    assert _warnings(out.stderr) == []
    assert KEY not in out.stdout + out.stderr


def test_proxy_api_key_flag_still_sets_the_key(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import proxy.service

    for name in list(os.environ):
        if name.startswith("STAR_"):
            monkeypatch.delenv(name)

    seen: list[str] = []

    class Stub:
        def __init__(self, settings: object, *_args: object, **_kw: object) -> None:
            seen.append(settings.proxy.api_key)  # type: ignore[attr-defined]

        def run(self) -> int:
            return 0

    monkeypatch.setattr(proxy.service, "ProxyService", Stub)
    assert main(["proxy", "--api-key", KEY]) == 0
    assert seen == [KEY]
    assert KEY not in "".join(capsys.readouterr())


def test_proxy_help_says_to_use_the_environment(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["proxy", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "STAR_PROXY_API_KEY" in text
    assert "visible to every local user in the process list" in text
