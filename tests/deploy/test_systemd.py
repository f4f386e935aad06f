"""The systemd units in deploy/systemd/: valid units whose ExecStart is a real `star` command."""

from __future__ import annotations

import configparser
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from star.cli.main import build_parser
from star.settings import load_settings

UNITS = Path(__file__).resolve().parents[2] / "deploy" / "systemd"
SERVICES = ["star-worker@.service", "star-scheduler.service", "star-proxy.service"]


def read_unit(path: Path) -> configparser.ConfigParser:
    # systemd allows repeated keys (EnvironmentFile=): keep them all, in order.
    parser = configparser.ConfigParser(strict=False, interpolation=None, dict_type=_MultiDict)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(path)
    return parser


class _MultiDict(dict[str, object]):
    def __setitem__(self, key: str, value: object) -> None:
        if isinstance(value, list) and key in self and isinstance(self[key], list):
            self[key].extend(value)  # type: ignore[union-attr]
        else:
            super().__setitem__(key, value)


def env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"{path.name}: not KEY=VALUE: {line!r}"
            out[key] = value
    return out


@pytest.mark.parametrize("name", SERVICES)
def test_unit_is_notify_restarts_and_reads_the_env_file(name: str) -> None:
    service = read_unit(UNITS / name)["Service"]
    assert service["Type"] == "notify"
    assert service["Restart"] == "on-failure"
    assert "/etc/star/star.env" in service["EnvironmentFile"]
    assert service["ExecStart"].split()[0].endswith("/star")


@pytest.mark.parametrize("name", SERVICES)
def test_exec_start_is_a_real_star_subcommand_with_valid_flags(name: str) -> None:
    argv = shlex.split(read_unit(UNITS / name)["Service"]["ExecStart"])[1:]
    argv = [a.replace("%i", "decode-0").replace("%H", "host-a") for a in argv]
    args = build_parser().parse_args(argv)  # argparse exits (SystemExit) on a bad flag
    assert args.command == name.split("-")[1].split("@")[0].split(".")[0]
    assert callable(args.func)


def test_env_examples_name_only_real_settings() -> None:
    for example in ("star.env.example", "worker.env.example"):
        values = {k: v for k, v in env_file(UNITS / example).items() if k.startswith("STAR_")}
        assert values, example
        settings = load_settings(env=values)  # raises on an unknown key or a bad value
        assert settings.redis.url
    worker = load_settings(
        env={**env_file(UNITS / "star.env.example"), **env_file(UNITS / "worker.env.example")}
    )
    assert worker.worker.role == "prefill"


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed"
)
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    """Point the units at this machine's `star` and env files, then let systemd check them."""
    star = shutil.which("star")
    if star is None:
        pytest.skip("the star console script is not on PATH")
    env = tmp_path / "star.env"
    shutil.copy(UNITS / "star.env.example", env)
    names = []
    for name in [*SERVICES, "star.target"]:
        text = (UNITS / name).read_text()
        text = text.replace("/opt/star/venv/bin/star", star).replace("/etc/star/star.env", str(env))
        text = text.replace("/etc/star/worker-%i.env", str(tmp_path / "worker-%i.env"))
        text = text.replace("User=star\n", "").replace("Group=star\n", "")  # no such user here
        target = tmp_path / (name.replace("@.service", "@decode-0.service"))
        target.write_text(text)
        names.append(str(target))
    proc = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *names],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    problems = [
        line
        for line in (proc.stdout + proc.stderr).splitlines()
        # A container without systemd as PID 1 warns about the host, not our units.
        if str(tmp_path) in line or "star" in line
    ]
    assert proc.returncode == 0 and not problems, proc.stdout + proc.stderr
