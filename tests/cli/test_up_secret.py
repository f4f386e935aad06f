"""``star up`` authenticates its own cluster: one secret drawn per cluster, handed to every child."""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path

from star.fleet import SECRET_ENV, LocalCluster


def _cluster(tmp_path: Path, env: dict[str, str]) -> LocalCluster:
    return LocalCluster("redis://127.0.0.1:1/0", port=0, run_dir=tmp_path, env=env)


def test_each_local_cluster_draws_its_own_secret_for_every_child(tmp_path: Path) -> None:
    a, b = _cluster(tmp_path / "a", {}), _cluster(tmp_path / "b", {"STAR_CLUSTER_SECRET": ""})
    try:
        assert len(a.secret) == 64 and a.secret != b.secret
        # Children are started with the launcher's environment (Launcher.start).
        assert a.launcher.env[SECRET_ENV] == a.secret
        assert b.launcher.env[SECRET_ENV] == b.secret
    finally:
        a.stop()
        b.stop()


def test_a_secret_the_caller_set_is_kept(tmp_path: Path) -> None:
    c = _cluster(tmp_path, {SECRET_ENV: "operator-chosen-secret"})
    try:
        assert c.secret == "operator-chosen-secret"
        assert c.launcher.env[SECRET_ENV] == "operator-chosen-secret"
    finally:
        c.stop()


def test_a_drawn_secret_is_in_a_private_file_the_hint_reads(tmp_path: Path) -> None:
    """Another terminal's ``star migrate`` signs its decisions with it (star.bus.signing)."""
    drawn = _cluster(tmp_path / "a", {})
    chosen = _cluster(tmp_path / "b", {SECRET_ENV: "operator-chosen-secret"})
    try:
        assert drawn.secret_file is not None
        assert stat.S_IMODE(drawn.secret_file.stat().st_mode) == 0o600
        hint = drawn.find_hint("star")
        assert drawn.secret not in hint
        echoed = subprocess.run(
            ["bash", "-c", f"{hint}bash -c 'echo ${SECRET_ENV}'"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert echoed.stdout.strip() == drawn.secret
        # The operator's own secret is theirs to give: no file, no hint.
        assert chosen.secret_file is None and SECRET_ENV not in chosen.find_hint("star")
    finally:
        drawn.stop()
        chosen.stop()
