"""Cluster state as plain JSON: what ``star plan --input STATE.json`` reads.

The schema (documented for operators in ``docs/plan-state.md``)::

    {
      "v": 1,                                  # optional schema version
      "params": {"mode": "predicted", ...},    # optional PlannerParams fields
      "instances": [
        {"id": "decode-0", "capacity_tokens": 400000,
         "bytes_per_token": 131072, "step_time_s": 0.02,       # optional
         "in_flight": false, "busy": ["req-7"],                 # optional
         "draining": false,                                     # optional
         "trace": [..H+1 numbers..] | null,                     # optional
         "requests": [
           {"id": "req-1", "tokens": 1200,
            "predicted_remaining": 3000 | null, "true_remaining": 2800 | null,
            "generated": 200, "migratable": true}]}]}

Decoding is strict: a missing field, a wrong type or an unknown key raises
:class:`StateError` naming the path (``instances[2].requests[0].tokens``) and
quoting the bad value, so a typo never silently becomes a default.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from star.planner.types import PARAM_RULES, Instance, Mode, PlannerParams, Request, validate_params

SCHEMA_VERSION = 1

_PARAM_NAMES: tuple[str, ...] = ("mode", *PARAM_RULES)
assert set(_PARAM_NAMES) == {f.name for f in dataclasses.fields(PlannerParams)}


class StateError(ValueError):
    """A STATE.json document that does not follow the schema."""


def _keys(obj: Mapping[str, Any], path: str, required: set[str], optional: set[str]) -> None:
    missing = sorted(required - obj.keys())
    if missing:
        raise StateError(f"{path}: missing field {missing[0]!r}")
    unknown = sorted(obj.keys() - required - optional)
    if unknown:
        allowed = ", ".join(sorted(required | optional))
        raise StateError(f"{path}: unknown field {unknown[0]!r} (expected {allowed})")


def _mapping(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise StateError(f"{path}: expected an object, got {value!r}")
    return value


def _list(value: Any, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise StateError(f"{path}: expected a list, got {value!r}")
    return value


def _str(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value:
        raise StateError(f"{path}: expected a non-empty string, got {value!r}")
    return value


def _int(value: Any, path: str, *, minimum: int = 0) -> int:
    # bool is an int in Python; `true` is never a token count.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise StateError(f"{path}: expected an integer >= {minimum}, got {value!r}")
    return value


def _num(value: Any, path: str, *, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise StateError(f"{path}: expected a number >= {minimum:g}, got {value!r}")
    if not math.isfinite(value) or value < minimum:
        raise StateError(f"{path}: expected a number >= {minimum:g}, got {value!r}")
    return float(value)


def _bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise StateError(f"{path}: expected true or false, got {value!r}")
    return value


def _request(obj: Any, path: str) -> Request:
    m = _mapping(obj, path)
    _keys(
        m,
        path,
        {"id", "tokens"},
        {"predicted_remaining", "true_remaining", "generated", "migratable"},
    )
    predicted = m.get("predicted_remaining")
    true = m.get("true_remaining")
    return Request(
        id=_str(m["id"], f"{path}.id"),
        tokens=_int(m["tokens"], f"{path}.tokens"),
        # A regressor may predict <= 0; the planner clamps, the file need not.
        predicted_remaining=(
            None
            if predicted is None
            else _num(predicted, f"{path}.predicted_remaining", minimum=-math.inf)
        ),
        true_remaining=None if true is None else _int(true, f"{path}.true_remaining"),
        generated=_int(m.get("generated", 0), f"{path}.generated"),
        migratable=_bool(m.get("migratable", True), f"{path}.migratable"),
    )


def _instance(obj: Any, path: str) -> Instance:
    m = _mapping(obj, path)
    _keys(
        m,
        path,
        {"id", "capacity_tokens"},
        {"bytes_per_token", "step_time_s", "in_flight", "draining", "busy", "trace", "requests"},
    )
    requests = tuple(
        _request(r, f"{path}.requests[{j}]")
        for j, r in enumerate(_list(m.get("requests", []), f"{path}.requests"))
    )
    busy = frozenset(
        _str(b, f"{path}.busy[{j}]") for j, b in enumerate(_list(m.get("busy", []), f"{path}.busy"))
    )
    raw_trace = m.get("trace")
    trace = (
        None
        if raw_trace is None
        else tuple(
            _num(x, f"{path}.trace[{j}]") for j, x in enumerate(_list(raw_trace, f"{path}.trace"))
        )
    )
    return Instance(
        id=_str(m["id"], f"{path}.id"),
        requests=requests,
        capacity_tokens=_int(m["capacity_tokens"], f"{path}.capacity_tokens", minimum=1),
        bytes_per_token=_int(m.get("bytes_per_token", 0), f"{path}.bytes_per_token"),
        step_time_s=_num(m.get("step_time_s", 0.0), f"{path}.step_time_s"),
        in_flight=_bool(m.get("in_flight", False), f"{path}.in_flight"),
        busy=busy,
        trace=trace,
        draining=_bool(m.get("draining", False), f"{path}.draining"),
    )


def instances_from_state(obj: dict[str, Any]) -> tuple[list[Instance], dict[str, Any]]:
    """Decode a STATE.json document into instances and its ``params`` overrides.

    The overrides are returned as given (keys checked against
    :class:`PlannerParams`, values not yet converted); pass them to
    :func:`params_from_dict`. Instance ids and request ids must be unique.
    """
    root = _mapping(obj, "state")
    _keys(root, "state", {"instances"}, {"v", "params"})
    if "v" in root and root["v"] != SCHEMA_VERSION:
        raise StateError(f"state.v: unsupported schema version {root['v']!r} (expected 1)")
    instances = [
        _instance(x, f"instances[{i}]")
        for i, x in enumerate(_list(root["instances"], "state.instances"))
    ]
    seen: set[str] = set()
    for i, inst in enumerate(instances):
        if inst.id in seen:
            raise StateError(f"instances[{i}].id: duplicate instance id {inst.id!r}")
        seen.add(inst.id)
    owner: dict[str, str] = {}
    for inst in instances:
        for r in inst.requests:
            if r.id in owner:
                raise StateError(
                    f"request id {r.id!r} appears on both {owner[r.id]!r} and {inst.id!r}"
                )
            owner[r.id] = inst.id
    params = dict(_mapping(root.get("params", {}), "state.params"))
    _keys(params, "state.params", set(), set(_PARAM_NAMES))
    return instances, params


def params_from_dict(
    overrides: Mapping[str, Any], base: PlannerParams | None = None
) -> PlannerParams:
    """``base`` (default: the defaults) with ``overrides`` applied and validated.

    Values may be JSON values or strings (as from ``--set key=value``); the
    result passes :func:`star.planner.validate_params`.
    """
    changes: dict[str, Any] = {}
    for key, value in overrides.items():
        if key not in _PARAM_NAMES:
            raise ValueError(
                f"unknown planner parameter {key!r}; expected one of {', '.join(_PARAM_NAMES)}"
            )
        changes[key] = _convert(key, value)
    params = dataclasses.replace(base or PlannerParams(), **changes)
    validate_params(params)
    return params


def _convert(key: str, value: Any) -> Any:
    """A JSON value or ``--set`` text by the parameter's rule (``PARAM_RULES``: the setting's)."""
    if key == "mode":
        if isinstance(value, Mode):
            return value
        if not isinstance(value, str):
            raise ValueError(f"planner parameter mode={value!r}: expected a string")
        return Mode.parse(value)
    try:
        return PARAM_RULES[key].convert(value)
    except ValueError as exc:
        raise ValueError(f"planner parameter {key}={value!r}: {exc}") from None
    # The bound: validate_params, on the whole result.


def state_from_instances(
    instances: list[Instance] | tuple[Instance, ...], params: PlannerParams | None = None
) -> dict[str, Any]:
    """The inverse of :func:`instances_from_state` (defaults left out)."""
    out: dict[str, Any] = {"v": SCHEMA_VERSION}
    if params is not None:
        out["params"] = {
            f.name: str(getattr(params, f.name)) if f.name == "mode" else getattr(params, f.name)
            for f in dataclasses.fields(PlannerParams)
        }
    rows: list[dict[str, Any]] = []
    for inst in instances:
        row: dict[str, Any] = {"id": inst.id, "capacity_tokens": inst.capacity_tokens}
        if inst.bytes_per_token:
            row["bytes_per_token"] = inst.bytes_per_token
        if inst.step_time_s:
            row["step_time_s"] = inst.step_time_s
        if inst.in_flight:
            row["in_flight"] = True
        if inst.draining:
            row["draining"] = True
        if inst.busy:
            row["busy"] = sorted(inst.busy)
        if inst.trace is not None:
            row["trace"] = list(inst.trace)
        reqs: list[dict[str, Any]] = []
        for r in inst.requests:
            req: dict[str, Any] = {"id": r.id, "tokens": r.tokens}
            req["predicted_remaining"] = r.predicted_remaining
            if r.true_remaining is not None:
                req["true_remaining"] = r.true_remaining
            req["generated"] = r.generated
            if not r.migratable:
                req["migratable"] = False
            reqs.append(req)
        row["requests"] = reqs
        rows.append(row)
    out["instances"] = rows
    return out
