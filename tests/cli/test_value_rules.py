"""Each value rule once (issue 29 item 2): one table, every surface.

A setting's rule (``star.settings.RULES``: its type, Literal choices or declared
:class:`~star.settings.Bound`) is the only rule of every place the value can be
given: the settings file, its ``STAR_*`` variable, ``--set area.key=``, the
planner's parameters (``PlannerParams`` through ``validate_params``, and
STATE.json / ``star plan --set`` through ``params_from_dict``), the simulator's
``SimConfig``, ``star simulate --set`` and the flag that mirrors it (``star
simulate``, ``star up``, ``star bench``, ``star plan --mode`` and the services':
``star scheduler``, ``star worker``, ``star proxy``). The cases come from the rule's metadata (just inside, just
outside, not finite, the wrong type), and every surface must accept and refuse
exactly the same ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import pytest

from star.cli import proxy as proxy_cli
from star.cli import scheduler as scheduler_cli
from star.cli import worker as worker_cli
from star.cli.common import Mirror, mirrored, settings_from_args
from star.cli.simulate import MIRRORED, _apply_settings, apply_sets, build_base, register
from star.planner.state import params_from_dict
from star.planner.types import PARAM_RULES, PlannerParams, validate_params
from star.rules import Bound, Rule
from star.settings import RULES, env_key, load_settings, migrations, planner_mode
from star.sim.config import RULES_BY_FIELD, SimConfig


@dataclasses.dataclass(frozen=True)
class Counterpart:
    """Where setting ``key`` can also be given."""

    planner: str | None = None  # a PlannerParams field
    sim: str | None = None  # a SimConfig field, or planner.FIELD (SimConfig.planner's)
    flag: str | None = None  # a star simulate flag
    scale: float = 1.0  # planner value = setting value x scale (a unit)


COUNTERPARTS: dict[str, Counterpart] = {
    "scheduler.mode": Counterpart(planner="mode", sim="mode"),
    "scheduler.dispatch": Counterpart(sim="dispatch", flag="--dispatch"),
    "proxy.dispatch": Counterpart(sim="dispatch", flag="--dispatch"),
    "proxy.dispatch_charge": Counterpart(sim="dispatch_charge"),
    "scheduler.horizon": Counterpart(planner="horizon", sim="planner.horizon"),
    "scheduler.delta": Counterpart(planner="delta", sim="planner.delta"),
    "scheduler.beta_decay": Counterpart(planner="beta_decay", sim="planner.beta_decay"),
    "scheduler.theta": Counterpart(planner="theta", sim="planner.theta"),
    "scheduler.min_gain": Counterpart(planner="min_gain", sim="planner.min_gain"),
    "scheduler.max_migrations": Counterpart(
        planner="max_migrations", sim="planner.max_migrations", flag="--max-migrations"
    ),
    "scheduler.transfer_budget_s": Counterpart(
        planner="transfer_budget_s", sim="planner.transfer_budget_s"
    ),
    "scheduler.bandwidth_gbps": Counterpart(
        planner="bandwidth_bytes_per_s", sim="bandwidth_gbps", scale=1e9 / 8
    ),
    "scheduler.handoff_latency_s": Counterpart(
        planner="handoff_latency_s", sim="handoff_latency_s"
    ),
    "simulator.duration_s": Counterpart(sim="duration_s", flag="--duration"),
    "simulator.rate_per_8": Counterpart(sim="rate_per_8", flag="--rate-per-8"),
    "simulator.bandwidth_gbps": Counterpart(sim="bandwidth_gbps", flag="--bandwidth-gbps"),
    "simulator.tick_s": Counterpart(sim="tick_s", flag="--tick"),
    "predictor.every_k": Counterpart(sim="predict_every", flag="--predict-every"),
}
# scheduler.bins_scale_tokens is no counterpart of PlannerParams.bins_scale_tokens
# by design: the setting's 0 means worker.max_model_len, resolved by
# PlannerParams.from_settings (test_bins_scale_tokens_zero_is_resolved_not_passed).
# The planner fields with a rule of their own.
NOT_SAME_RULE = {"bins_scale_tokens", "default_step_time_s"}


# -- the cases, from a rule's metadata ------------------------------------------


def cases(rule: Rule) -> list[tuple[Any, bool]]:
    """(a typed value, whether the rule accepts it): its edges and the wrong types."""
    tp, check = rule.tp, rule.check
    if check is planner_mode:
        return [
            ("predicted", True),
            ("bins:2", True),
            ("bins:6", True),
            ("no-migration", True),
            ("bins:3", False),
            ("bogus", False),
            ("", False),
            (3, False),
        ]
    if check is migrations:
        return [
            ("auto", True),
            (1, True),
            (7, True),
            (0, False),
            (-1, False),
            ("lots", False),
            (1.5, False),
            (True, False),
        ]
    if typing.get_origin(tp) is Literal:
        return [*((w, True) for w in typing.get_args(tp)), ("bogus", False), (1, False)]
    if isinstance(check, Bound) and tp in (int, float):
        step: float = 1 if tp is int else 1e-6
        out: list[tuple[Any, bool]] = [("abc", False), (True, False)]
        if check.gt is not None:
            out += [(tp(check.gt + step), True), (tp(check.gt), False)]
        if check.ge is not None:
            out += [(tp(check.ge), True), (tp(check.ge - step), False)]
        if check.le is not None:
            out += [(tp(check.le), True), (tp(check.le + step), False)]
        low = check.gt if check.gt is not None else check.ge
        assert low is not None, rule.key
        inside = tp(low + 1)
        out.append((inside, check.le is None or inside <= check.le))
        if tp is float:
            out += [(math.inf, False), (-math.inf, False), (math.nan, False)]
        else:
            out += [(1.5, False)]
        return out
    if tp is str and check is None:  # any text (a host, a model path, an id, a key)
        return [("127.0.0.1", True), ("decode-7", True), ("", True)]
    raise AssertionError(f"no cases for {rule.key}: give it a Bound or Literal, or cases here")


def text(value: Any) -> str:
    """A value as it is typed in the environment or on a command line."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return repr(value)


# -- the surfaces: each says whether it takes the value ---------------------------


def refuses(call: Callable[[], object]) -> bool:
    try:
        call()
    except (ValueError, SystemExit):  # SettingsError, ConfigError, StateError: ValueErrors
        return True
    return False


def file_takes(key: str, value: Any, tmp_path: Path) -> bool:
    area, name = key.split(".")
    path = tmp_path / "star.toml"
    path.write_text(f"[{area}]\n{name} = {toml(value)}\n")
    return not refuses(lambda: load_settings(config=path, env={}))


def env_takes(key: str, value: Any) -> bool:
    return not refuses(lambda: load_settings(env={env_key(key): text(value)}))


def set_takes(key: str, value: Any) -> bool:
    return not refuses(lambda: load_settings(env={}, overrides={key: text(value)}))


def scaled(value: Any, scale: float) -> Any:
    if scale == 1.0 or isinstance(value, bool) or not isinstance(value, int | float):
        return value
    return value * scale


def planner_surfaces(field: str, value: Any, scale: float) -> dict[str, bool]:
    value = scaled(value, scale)
    out = {
        # STATE.json's params (a JSON value) and star plan --set (text)
        "planner json": not refuses(lambda: params_from_dict({field: value})),
        "planner text": not refuses(lambda: params_from_dict({field: text(value)})),
    }
    if field != "mode":  # PlannerParams.mode holds a parsed Mode
        params = dataclasses.replace(PlannerParams(), **{field: value})
        out["PlannerParams"] = not refuses(lambda: validate_params(params))
    return out


def sim_config(field: str, value: Any) -> SimConfig:
    if field.startswith("planner."):
        planner = dataclasses.replace(PlannerParams(), **{field.removeprefix("planner."): value})
        return SimConfig(planner=planner)
    return SimConfig(**{field: value})


def simulate_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["simulate", *argv])
    _apply_settings(args)
    return args


def sim_surfaces(field: str | None, flag: str | None, value: Any) -> dict[str, bool]:
    out: dict[str, bool] = {}
    if field is not None:
        out["SimConfig"] = not refuses(lambda: sim_config(field, value))
        out["simulate --set"] = not refuses(
            lambda: apply_sets(SimConfig(), [f"{field}={text(value)}"])
        )
    if flag is not None:
        out[f"simulate {flag}"] = not refuses(
            lambda: build_base(simulate_args([f"{flag}={text(value)}"]))
        )
    return out


# -- the table ---------------------------------------------------------------------


ROWS = [
    pytest.param(key, value, accepted, id=f"{key}={value!r}")
    for key in COUNTERPARTS
    for value, accepted in cases(RULES[key])
]


@pytest.mark.parametrize(("key", "value", "accepted"), ROWS)
def test_every_surface_accepts_and_refuses_the_same(
    key: str, value: Any, accepted: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [n for n in os.environ if n.startswith("STAR_")]:
        monkeypatch.delenv(name)  # star simulate reads the settings for its defaults
    where = COUNTERPARTS[key]
    seen = {
        "file": file_takes(key, value, tmp_path),
        "env": env_takes(key, value),
        "--set": set_takes(key, value),
    }
    if where.planner is not None:
        seen |= planner_surfaces(where.planner, value, where.scale)
    seen |= sim_surfaces(where.sim, where.flag, value)
    assert seen == dict.fromkeys(seen, accepted), f"{key}={value!r}"


ALL_CHECKED = [
    key
    for key, rule in RULES.items()
    if isinstance(rule.check, Bound)
    or rule.check in (migrations, planner_mode)
    or typing.get_origin(rule.tp) is Literal
]


@pytest.mark.parametrize("key", ALL_CHECKED)
def test_every_bounded_setting_reads_alike_from_file_env_and_flag(key: str, tmp_path: Path) -> None:
    for value, accepted in cases(RULES[key]):
        seen = {
            "file": file_takes(key, value, tmp_path),
            "env": env_takes(key, value),
            "--set": set_takes(key, value),
        }
        assert seen == dict.fromkeys(seen, accepted), f"{key}={value!r}"


def test_the_table_names_every_counterpart() -> None:
    # A planner parameter, simulator field or star simulate flag that follows a
    # setting's rule must be in COUNTERPARTS, or it escapes the table.
    by_rule = {id(rule): key for key, rule in RULES.items()}
    planner = {field for field, rule in PARAM_RULES.items() if id(rule) in by_rule}
    assert planner == {c.planner for c in COUNTERPARTS.values() if c.planner} - {"mode"}
    assert set(PARAM_RULES) - planner == NOT_SAME_RULE
    sim = {field for field, rule in RULES_BY_FIELD.items() if id(rule) in by_rule}
    for field in sim:
        key = by_rule[id(RULES_BY_FIELD[field])]
        assert COUNTERPARTS[key].sim == field, key
    flags = {flag: key for flag, key, _, _ in MIRRORED}
    for flag, key in flags.items():
        assert key in COUNTERPARTS and COUNTERPARTS[key].flag == flag, flag
    assert {c.flag for c in COUNTERPARTS.values() if c.flag} == set(flags)
    # Every setting with a bound or choices has its cases (no rule left to a surface).
    assert set(COUNTERPARTS) <= set(ALL_CHECKED)


def test_bins_scale_tokens_zero_is_resolved_not_passed() -> None:
    # The setting's 0 means "the served model's length"; the planner gets that.
    settings = load_settings(env={"STAR_SCHEDULER_BINS_SCALE_TOKENS": "0"})
    assert PlannerParams.from_settings(settings).bins_scale_tokens == 4096
    assert refuses(lambda: params_from_dict({"bins_scale_tokens": 0}))
    assert refuses(lambda: load_settings(env={"STAR_SCHEDULER_BINS_SCALE_TOKENS": "-1"}))


def test_simulate_set_takes_a_migration_latency() -> None:
    # Its default is None (the handoff's); --set once failed with "expected NoneType".
    assert apply_sets(SimConfig(), ["migration_latency_s=0.01"]).migration_latency_s == 0.01


def _up_parser() -> argparse.ArgumentParser:
    from star.cli import up

    parser = argparse.ArgumentParser()
    up.register(parser.add_subparsers())
    return parser


def _bench_parser() -> argparse.ArgumentParser:
    from benchmarks import planner, scheduler_load, simulator

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    planner.configure(sub.add_parser("planner"))
    simulator.configure(sub.add_parser("simulator"))
    scheduler_load.configure(sub.add_parser("scheduler"))
    return parser


def _parser(command: str) -> Callable[[], argparse.ArgumentParser]:
    """A parser of ``star COMMAND`` alone."""

    def make() -> argparse.ArgumentParser:
        import importlib

        parser = argparse.ArgumentParser()
        importlib.import_module(f"star.cli.{command}").register(parser.add_subparsers())
        return parser

    return make


# The services' flags that mirror a setting (star.cli.common.Mirror), every one.
MIRRORS_OF: dict[str, tuple[Mirror, ...]] = {
    "scheduler": scheduler_cli.MIRRORS,
    "worker": worker_cli.MIRRORS,
    "proxy": proxy_cli.MIRRORS,
}
SERVICE_MIRRORS = [(command, m) for command, mirrors in MIRRORS_OF.items() for m in mirrors]

# Other commands' flags made from a setting (star.settings.add_setting_flag).
OTHER_FLAGS = [
    *((m.key, _parser(command), [command], m.flag) for command, m in SERVICE_MIRRORS),
    ("scheduler.mode", _parser("plan"), ["plan"], "--mode"),
    ("proxy.port", _up_parser, ["up"], "--port"),
    ("scheduler.mode", _up_parser, ["up"], "--mode"),
    ("scheduler.horizon", _bench_parser, ["planner"], "--horizon"),
    ("scheduler.mode", _bench_parser, ["planner"], "--mode"),
    ("scheduler.max_migrations", _bench_parser, ["planner"], "--max-migrations"),
    ("simulator.duration_s", _bench_parser, ["simulator"], "--duration"),
    ("scheduler.mode", _bench_parser, ["scheduler"], "--mode"),
    ("scheduler.interval_s", _bench_parser, ["scheduler"], "--interval"),
]


@pytest.mark.parametrize(
    ("key", "parser", "argv", "flag"), OTHER_FLAGS, ids=[f"{a[2][0]} {a[3]}" for a in OTHER_FLAGS]
)
def test_other_commands_flags_follow_the_setting(
    key: str, parser: Callable[[], argparse.ArgumentParser], argv: list[str], flag: str
) -> None:
    p = parser()
    for value, accepted in cases(RULES[key]):
        given = [*argv, f"{flag}={text(value)}"]
        takes = not refuses(lambda: p.parse_args(given))  # noqa: B023 (called at once)
        assert takes == accepted == set_takes(key, value), f"{flag} {value!r}"


@pytest.mark.parametrize(
    ("command", "mirror"), SERVICE_MIRRORS, ids=[f"{c} {m.flag}" for c, m in SERVICE_MIRRORS]
)
def test_a_service_flag_sets_its_setting_over_the_environment(
    command: str, mirror: Mirror, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What the command runs with (star.cli.common.mirrored): the flag's value as
    # the setting reads it, above STAR_*; not given, the environment's, else the default.
    for name in [n for n in os.environ if n.startswith("STAR_")]:
        monkeypatch.delenv(name)
    rule, p = RULES[mirror.key], _parser(command)()
    area, name = mirror.key.split(".")
    mirrors = MIRRORS_OF[command]

    def runs_with(argv: list[str]) -> Any:
        args = p.parse_args([command, *argv])
        return getattr(getattr(settings_from_args(args, mirrored(args, mirrors)), area), name)

    assert runs_with([]) == rule.default
    taken = [rule.parse(text(v)) for v, accepted in cases(rule) if accepted]
    env = next(v for v in taken if v != rule.default)
    monkeypatch.setenv(env_key(mirror.key), text(env))
    assert runs_with([]) == env
    assert any(v != env for v in taken)
    for value in taken:
        assert runs_with([f"{mirror.flag}={text(value)}"]) == value, value


def test_planner_and_simulator_defaults_are_the_settings() -> None:
    # Defaults are values too: PlannerParams and SimConfig take the settings'
    # (bins_scale_tokens: the paper's 32768, where the setting's 0 = max_model_len).
    defaults = load_settings(env={})
    live = PlannerParams.from_settings(defaults)
    assert dataclasses.replace(live, bins_scale_tokens=32768) == PlannerParams()
    sim = SimConfig()
    for key, where in COUNTERPARTS.items():
        if where.sim is not None and not where.sim.startswith("planner."):
            area, name = key.split(".")
            assert getattr(sim, where.sim) == getattr(getattr(defaults, area), name), key
