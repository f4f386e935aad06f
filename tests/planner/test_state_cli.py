"""STATE.json decoding and `star plan`."""

from __future__ import annotations

import argparse
import copy
import io
import json
from pathlib import Path
from typing import Any

import pytest

from star.cli import plan as plan_cli
from star.planner import Mode, PlannerParams, plan
from star.planner.state import (
    StateError,
    instances_from_state,
    params_from_dict,
    state_from_instances,
)
from tests.planner.helpers import inst, req

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "state.json"


def doc() -> dict[str, Any]:
    out: dict[str, Any] = json.loads(EXAMPLE.read_text())
    return out


def test_example_decodes_and_round_trips() -> None:
    instances, params = instances_from_state(doc())
    assert [i.id for i in instances] == ["decode-0", "decode-1", "decode-2", "decode-3"]
    assert params["mode"] == "predicted"
    again, _ = instances_from_state(state_from_instances(instances))
    assert again == instances
    r = instances[0].requests[4]
    assert (r.id, r.predicted_remaining, r.migratable) == ("chat-105", None, True)
    assert instances[0].requests[3].migratable is False
    assert instances[1].busy == frozenset({"chat-203"})


def test_draining_decodes_and_round_trips() -> None:
    instances, _ = instances_from_state(_edit("instances.2.draining", True))
    assert [i.draining for i in instances] == [False, False, True, False]
    again, _ = instances_from_state(state_from_instances(instances))
    assert again == instances
    with pytest.raises(StateError, match=r"instances\[2\]\.draining: expected true or false"):
        instances_from_state(_edit("instances.2.draining", "yes"))


def _edit(path: str, value: Any) -> dict[str, Any]:
    d = copy.deepcopy(doc())
    node: Any = d
    keys = path.split(".")
    for key in keys[:-1]:
        node = node[int(key)] if key.isdigit() else node[key]
    last = keys[-1]
    if value is KeyError:
        del node[last]
    else:
        node[int(last) if last.isdigit() else last] = value
    return d


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("instances.0.requests.0.tokens", "12x", r"instances\[0\]\.requests\[0\]\.tokens: .*'12x'"),
        ("instances.0.requests.0.tokens", True, r"tokens: expected an integer >= 0, got True"),
        ("instances.0.requests.0.tokens", -1, r"tokens: expected an integer >= 0, got -1"),
        ("instances.0.requests.0.tokens", KeyError, r"requests\[0\]: missing field 'tokens'"),
        ("instances.0.requests.0.predicted", 5, r"unknown field 'predicted'"),
        ("instances.0.requests.0.migratable", "no", r"migratable: expected true or false"),
        (
            "instances.1.capacity_tokens",
            0,
            r"instances\[1\]\.capacity_tokens: expected an integer >= 1",
        ),
        ("instances.1.step_time_s", "fast", r"step_time_s: expected a number"),
        ("instances.1.trace", [1, "x"], r"instances\[1\]\.trace\[1\]"),
        ("instances.1.id", "decode-0", r"duplicate instance id 'decode-0'"),
        (
            "instances.1.requests.0.id",
            "chat-101",
            r"'chat-101' appears on both 'decode-0' and 'decode-1'",
        ),
        ("instances", {}, r"state\.instances: expected a list"),
        ("v", 2, r"unsupported schema version 2"),
        ("params.thetaa", 1, r"state\.params: unknown field 'thetaa'"),
        ("extra", 1, r"state: unknown field 'extra'"),
    ],
)
def test_schema_errors_name_the_field_and_quote_the_value(
    path: str, value: Any, message: str
) -> None:
    with pytest.raises(StateError, match=message):
        instances_from_state(_edit(path, value))


def test_params_from_strings_and_json_values() -> None:
    p = params_from_dict({"mode": "bins:4", "horizon": "8", "theta": 0.2, "min_gain": "1e3"})
    assert p == PlannerParams(mode=Mode.parse("bins:4"), horizon=8, theta=0.2, min_gain=1000.0)
    with pytest.raises(ValueError, match="horizon='eight': expected an integer"):
        params_from_dict({"horizon": "eight"})
    with pytest.raises(ValueError, match=r"horizon=2\.5: expected an integer"):
        params_from_dict({"horizon": 2.5})
    with pytest.raises(ValueError, match="unknown planner parameter 'H'"):
        params_from_dict({"H": 8})
    with pytest.raises(ValueError, match="delta=0"):
        params_from_dict({"delta": "0"})
    with pytest.raises(ValueError, match="unknown mode 'fast'"):
        params_from_dict({"mode": "fast"})
    several = params_from_dict({"max_migrations": "auto", "transfer_budget_s": "0.5"})
    assert several.max_migrations == "auto" and several.transfer_budget_s == 0.5
    assert params_from_dict({"max_migrations": 3}).max_migrations == 3
    with pytest.raises(ValueError, match="max_migrations='many': expected \"auto\" or an integer"):
        params_from_dict({"max_migrations": "many"})
    with pytest.raises(ValueError, match=r"transfer_budget_s=-1\.0"):
        params_from_dict({"transfer_budget_s": -1})


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    plan_cli.register(parser.add_subparsers())
    try:
        args = parser.parse_args(["plan", *argv])
        code = args.func(args)
    except SystemExit as exc:  # argparse refused a flag (--mode: scheduler.mode's rule)
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_star_plan_explains_the_example(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["--input", str(EXAMPLE), "--limit", "0"], capsys)
    assert code == 0
    assert "migrate chat-101: decode-0 -> decode-3" in out
    for verdict in (
        "chosen",
        "not-best",
        "too-short",
        "over-capacity",
        "not-migratable",
        "in-flight",
    ):
        assert verdict in out
    assert "decode-2  U" in out and "decode-0  O" in out
    assert "unknown" in out  # chat-105 has no prediction yet


def test_star_plan_json_matches_the_planner(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(
        ["-i", str(EXAMPLE), "--json", "--mode", "current", "--set", "max_migrations=2"], capsys
    )
    assert code == 0
    got = json.loads(out)
    instances, _ = instances_from_state(doc())
    expect = plan(
        instances, PlannerParams(mode=Mode.parse("current"), max_migrations=2), explain=True
    )
    assert got["mode"] == "current"
    assert [(m["request"], m["source"], m["target"]) for m in got["moves"]] == [
        (m.request, m.source, m.target) for m in expect.moves
    ]
    assert len(got["candidates"]) == len(expect.candidates)
    assert all(c["remaining"] is None for c in got["candidates"])  # inf -> null in current mode
    assert got["variance_after"] < got["variance_before"]


def test_star_plan_says_why_nothing_moves(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["-i", str(EXAMPLE), "--set", "theta=1.5"], capsys)
    assert code == 0
    assert "decision: no migration (no instance is overloaded" in out
    code, out, _ = run_cli(["-i", str(EXAMPLE), "--mode", "no-migration"], capsys)
    assert "mode no-migration never migrates" in out


def test_star_plan_reads_stdin(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    state = state_from_instances(
        [inst("a", req("x", 900, 500), req("y", 500, 500), req("z", 100, 500)), inst("b")]
    )
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(state)))
    code, out, _ = run_cli(["--input", "-", "--json"], capsys)
    assert code == 0 and json.loads(out)["moves"][0]["request"] == "x"


def test_star_plan_says_a_draining_instance_is_no_target(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    state = state_from_instances(
        [inst("a", req("x", 900, 500), req("y", 500, 500)), inst("b", draining=True)]
    )
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(state)))
    code, out, _ = run_cli(["--input", "-"], capsys)
    assert code == 0
    row = next(line for line in out.splitlines() if line.startswith("b "))
    assert row.endswith("draining")
    assert "decision: no migration (no instance is underloaded (draining ones never are: b)" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "--input STATE.json or --from-redis is required"),
        (["-i", "/nonexistent/state.json"], "No such file"),
        (["-i", "EXAMPLE", "--mode", "bins:5"], "bins takes 2, 4 or 6"),
        (["-i", "EXAMPLE", "--set", "theta"], "--set 'theta': expected KEY=VALUE"),
        (["-i", "EXAMPLE", "--set", "theta=abc"], "theta='abc': expected a number"),
    ],
)
def test_star_plan_rejects_bad_input_with_status_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [str(EXAMPLE) if a == "EXAMPLE" else a for a in argv]
    code, _, err = run_cli(argv, capsys)
    assert code == 2
    assert message in err


def test_star_plan_rejects_non_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "state.json"
    bad.write_text("{nope")
    code, _, err = run_cli(["-i", str(bad)], capsys)
    assert code == 2 and "not JSON" in err
