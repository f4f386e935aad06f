"""``star up`` authenticates its own cluster: one secret drawn per cluster, handed to every child."""

from __future__ import annotations

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
