"""Settings: precedence, coercion, validation messages."""

from __future__ import annotations

from pathlib import Path

import pytest

from star.settings import SettingsError, env_key, load_settings


def test_defaults_are_valid_and_sourced_as_default() -> None:
    s = load_settings(env={})
    assert s.scheduler.interval_s == 0.25
    assert s.proxy.port == 8000
    assert s.sources == {}


def test_precedence_file_env_flag(tmp_path: Path) -> None:
    cfg = tmp_path / "star.toml"
    cfg.write_text('[scheduler]\ninterval_s = 0.5\ntheta = 0.2\nmode = "current"\n[proxy]\nport = 9001\n')
    env = {"STAR_SCHEDULER_THETA": "0.3", "STAR_PROXY_PORT": "9002"}
    s = load_settings(cfg, env=env, overrides={"proxy.port": "9003", "scheduler.mode": None})
    assert s.scheduler.interval_s == 0.5
    assert s.scheduler.theta == 0.3
    assert s.proxy.port == 9003
    assert s.scheduler.mode == "current"  # None = flag not given
    assert s.sources["scheduler.interval_s"] == f"file {cfg}"
    assert s.sources["scheduler.theta"] == "env STAR_SCHEDULER_THETA"
    assert s.sources["proxy.port"] == "flag"


def test_max_migrations_is_auto_or_an_integer(tmp_path: Path) -> None:
    assert load_settings(env={}).scheduler.max_migrations == "auto"
    assert load_settings(env={"STAR_SCHEDULER_MAX_MIGRATIONS": "3"}).scheduler.max_migrations == 3
    cfg = tmp_path / "star.toml"
    cfg.write_text("[scheduler]\nmax_migrations = 2\n")
    assert load_settings(cfg, env={}).scheduler.max_migrations == 2
    cfg.write_text('[scheduler]\nmax_migrations = "auto"\n')
    assert load_settings(cfg, env={}).scheduler.max_migrations == "auto"


def test_config_path_from_env(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[bus]\nprefix = 'prod'\n")
    assert load_settings(env={"STAR_CONFIG": str(cfg)}).bus.prefix == "prod"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"STAR_SCHEDULER_INTERVAL_S": "-1"}, "scheduler.interval_s: must be > 0, got -1.0 (from env STAR_SCHEDULER_INTERVAL_S)"),
        ({"STAR_SCHEDULER_INTERVAL_S": "fast"}, "scheduler.interval_s: invalid value 'fast'"),
        ({"STAR_PROXY_PORT": "70000"}, "proxy.port: must be a TCP port"),
        ({"STAR_SCHEDULER_MODE": "bins:3"}, "scheduler.mode: mode 'bins:3'"),
        ({"STAR_SCHEDULER_DISPATCH": "random"}, "scheduler.dispatch: must be one of round-robin"),
        ({"STAR_REDIS_URL": "http://x"}, "redis.url: must be a redis://"),
        ({"STAR_SCHEDULER_INTERVL_S": "1"}, "unknown environment variable STAR_SCHEDULER_INTERVL_S"),
        ({"STAR_WORKER_ROLE": "both"}, "worker.role: must be one of prefill, decode, got 'both'"),
        ({"STAR_SCHEDULER_MAX_MIGRATIONS": "many"}, "scheduler.max_migrations: invalid value 'many' (from env STAR_SCHEDULER_MAX_MIGRATIONS): expected \"auto\" or an integer"),
        ({"STAR_SCHEDULER_MAX_MIGRATIONS": "0"}, 'scheduler.max_migrations: must be "auto" or an integer >= 1, got 0'),
    ],
)
def test_validation_names_key_and_quotes_value(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(env=env)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[schedular]\nx = 1\n", "unknown section [schedular]"),
        ("[scheduler]\nintervall = 1\n", "unknown key scheduler.intervall"),
        ("[scheduler]\ninterval_s = 'soon'\n", "scheduler.interval_s: invalid value 'soon'"),
        ("[proxy]\nport = 8000.5\n", "proxy.port: invalid value 8000.5"),
        ("[scheduler\n", "not valid TOML"),
    ],
)
def test_file_errors(tmp_path: Path, toml: str, message: str) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(toml)
    with pytest.raises(SettingsError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_settings(cfg, env={})


def test_missing_file() -> None:
    with pytest.raises(SettingsError, match="does not exist"):
        load_settings("/nonexistent/star.toml", env={})


def test_tuple_and_bool_coercion() -> None:
    s = load_settings(env={"STAR_PREDICTOR_HIDDEN_SIZES": "256, 64", "STAR_WORKER_ENGINE_ARGS": '["a=1", "b=2"]'})
    assert s.predictor.hidden_sizes == (256, 64)
    assert s.worker.engine_args == ("a=1", "b=2")


def test_unrelated_star_variables_are_ignored() -> None:
    assert load_settings(env={"STARSHIP": "1", "STAR_TREK": "x"}).bus.prefix == "star"


def test_env_key() -> None:
    assert env_key("scheduler.interval_s") == "STAR_SCHEDULER_INTERVAL_S"


def test_settings_are_frozen() -> None:
    s = load_settings(env={})
    with pytest.raises(AttributeError):
        s.scheduler.interval_s = 1.0  # type: ignore[misc]
