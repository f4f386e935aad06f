"""Workloads for the simulator: dataset loaders and a synthetic generator.

Paper §6.1, "Workload": "We utilize two widely adopted real-world datasets,
ShareGPT and Alpaca ... The prompt and generation length distribution of the
dataset using DeepSeek-R1-Distill-Qwen-7B are shown in Table 2". The
generation lengths that matter are the *reasoning model's* (up to 32K tokens),
not the lengths of the answers stored in the public datasets, so:

- :func:`load_sharegpt` / :func:`load_alpaca` parse the real file formats and
  take lengths from a recorded field when the file has one (a replay of a
  measured run: ``output_tokens``, ``output_len``, ...), else count the
  tokens of the stored text with a pluggable counter;
- :func:`load_trace` reads a JSON-lines trace with timestamps and lengths
  (Mooncake's ``{"timestamp", "input_length", "output_length"}`` layout);
- :func:`synthetic` draws lengths that reproduce Table 2 (mean, std, P50, P90,
  P95 of input and output for both datasets, outputs capped at 32K).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

# DeepSeek-R1-Distill-Qwen-7B "supports up to 32K tokens for both prompt and
# output" (paper §6.1); Table 2's P95 outputs (32,679 and 32,691) sit just
# under the 32,768-token limit.
MAX_OUTPUT_TOKENS = 32_768


class WorkloadError(ValueError):
    """A workload file or name cannot be used."""


@dataclass(frozen=True)
class Workload:
    """Request lengths, and arrival times when the source recorded them.

    ``arrival_s`` is None for length-only sources: the simulator then draws
    Poisson arrivals at the configured rate and samples lengths from here.
    """

    name: str
    prompt_tokens: IntArray
    output_tokens: IntArray
    arrival_s: FloatArray | None = None

    def __post_init__(self) -> None:
        if self.prompt_tokens.shape != self.output_tokens.shape or self.prompt_tokens.ndim != 1:
            raise WorkloadError(
                f"workload {self.name!r}: prompt and output arrays must be 1-D and equal"
            )
        if self.prompt_tokens.size == 0:
            raise WorkloadError(f"workload {self.name!r} has no requests")
        if self.arrival_s is not None and self.arrival_s.shape != self.prompt_tokens.shape:
            raise WorkloadError(f"workload {self.name!r}: one arrival time per request expected")
        if int(self.prompt_tokens.min()) < 1 or int(self.output_tokens.min()) < 1:
            raise WorkloadError(f"workload {self.name!r}: every length must be >= 1 token")

    def __len__(self) -> int:
        return int(self.prompt_tokens.size)


# -- synthetic lengths (Table 2) ---------------------------------------------


@dataclass(frozen=True)
class QuantileKnots:
    """A distribution given by its quantile function, log-linear between knots.

    ``knots`` are (u, value) with u from 0 to 1; value(u) interpolates
    ln(value) linearly in u. Sampling is inverse-transform: u ~ U(0, 1).
    Table 2 gives P50/P90/P95 exactly, so those are knots; the others were
    fitted once (scipy Nelder-Mead on 2M quantiles) so that the mean and std
    of the rounded values match Table 2. ``tests/sim/test_workload.py``
    checks the sampled statistics against Table 2.
    """

    knots: tuple[tuple[float, float], ...]

    def sample(self, rng: np.random.Generator, n: int) -> IntArray:
        """``n`` integer lengths (>= 1)."""
        us = np.array([u for u, _ in self.knots])
        logs = np.log(np.array([v for _, v in self.knots]))
        values = np.exp(np.interp(rng.random(n), us, logs))
        out: IntArray = np.maximum(1, np.rint(values)).astype(np.int64)
        return out


# Table 2 of the paper ("Workload Statistics"), DeepSeek-R1-Distill-Qwen-7B.
TABLE2: dict[str, dict[str, dict[str, float]]] = {
    "sharegpt": {
        "input": {"mean": 305, "std": 1053, "p50": 36, "p90": 920, "p95": 1609},
        "output": {"mean": 7542, "std": 12008, "p50": 1536, "p90": 32670, "p95": 32679},
    },
    "alpaca": {
        "input": {"mean": 11, "std": 4, "p50": 10, "p90": 15, "p95": 18},
        "output": {"mean": 8596, "std": 13354, "p50": 987, "p90": 32690, "p95": 32691},
    },
}

# ShareGPT outputs also use paper §3.2 (Fig. 2): "29.2% requests generating
# fewer than 1K tokens ... 17.3% with exceeding 30K tokens" (knots at
# u = 0.292 -> 1,000 and u = 0.827 -> 30,000). Free knots: 0.7 (ShareGPT
# output), 0.75/0.99/1.0 (ShareGPT input), 0.7/0.8 (Alpaca output), 0.0/1.0
# (Alpaca input).
SYNTHETIC: dict[str, tuple[QuantileKnots, QuantileKnots]] = {
    "sharegpt": (
        QuantileKnots(
            (
                (0.0, 2.0),
                (0.5, 36.0),
                (0.75, 161.0),
                (0.9, 920.0),
                (0.95, 1609.0),
                (0.99, 1891.0),
                (1.0, 21794.0),
            )
        ),
        QuantileKnots(
            (
                (0.0, 16.0),
                (0.292, 1000.0),
                (0.5, 1536.0),
                (0.7, 1971.0),
                (0.827, 30000.0),
                (0.9, 32670.0),
                (0.95, 32679.0),
                (1.0, float(MAX_OUTPUT_TOKENS)),
            )
        ),
    ),
    "alpaca": (
        QuantileKnots(((0.0, 6.48), (0.5, 10.0), (0.9, 15.0), (0.95, 18.0), (1.0, 29.8))),
        QuantileKnots(
            (
                (0.0, 16.0),
                (0.5, 987.0),
                (0.7, 4863.0),
                (0.8, 32690.0),
                (0.9, 32690.0),
                (0.95, 32691.0),
                (1.0, float(MAX_OUTPUT_TOKENS)),
            )
        ),
    ),
}


def synthetic(name: str, n: int, rng: np.random.Generator) -> Workload:
    """``n`` requests with Table 2's length statistics for ``sharegpt`` or ``alpaca``.

    Input and output lengths are drawn independently (Table 2 gives only the
    marginals).
    """
    try:
        inputs, outputs = SYNTHETIC[name]
    except KeyError:
        raise WorkloadError(
            f"unknown synthetic workload {name!r}; expected one of {', '.join(SYNTHETIC)}"
        ) from None
    prompt = inputs.sample(rng, n)
    output = np.minimum(outputs.sample(rng, n), MAX_OUTPUT_TOKENS)
    return Workload(name, prompt, output)


def stats(values: npt.ArrayLike) -> dict[str, float]:
    """Table 2's columns for a length array: mean, std, P50, P90, P95."""
    x = np.asarray(values, dtype=np.float64)
    p50, p90, p95 = np.percentile(x, [50, 90, 95])
    return {
        "mean": float(x.mean()),
        "std": float(x.std()),
        "p50": float(p50),
        "p90": float(p90),
        "p95": float(p95),
    }


# -- dataset files ------------------------------------------------------------

_PIECES = re.compile(r"\w+|[^\w\s]", re.UNICODE)


def approx_tokens(text: str) -> int:
    """Rough BPE token count without a tokenizer: a word is one token per 4
    characters (rounded up), each punctuation mark one token.

    Used only when a file has no recorded length and no tokenizer is given;
    pass ``count_tokens=lambda s: len(tok.encode(s).ids)`` for real counts.
    """
    return max(1, sum(math.ceil(len(p) / 4) for p in _PIECES.findall(text)))


# Fields a replayed run may record, most specific first.
_OUTPUT_FIELDS = (
    "output_tokens",
    "output_len",
    "output_length",
    "num_output_tokens",
    "completion_tokens",
)
_PROMPT_FIELDS = ("prompt_tokens", "input_tokens", "prompt_len", "input_len", "input_length")
_TIME_FIELDS = ("arrival_s", "arrival_time", "timestamp")


def _recorded(record: Mapping[str, Any], fields: Iterable[str], where: str) -> int | None:
    for name in fields:
        if name in record and record[name] is not None:
            value = record[name]
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise WorkloadError(
                    f"{where}: field {name!r} must be a non-negative number, got {value!r}"
                )
            return int(value)
    return None


def _timestamp(record: Mapping[str, Any], where: str) -> float | None:
    for name in _TIME_FIELDS:
        if name in record and record[name] is not None:
            value = record[name]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise WorkloadError(f"{where}: field {name!r} must be a number, got {value!r}")
            return float(value)
    return None


def _read_json_list(path: Path) -> list[Any]:
    try:
        with path.open(encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise WorkloadError(f"cannot read workload {str(path)!r}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, list):
        raise WorkloadError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
    return data


def _build(
    name: str, prompts: list[int], outputs: list[int], times: list[float | None], path: Path
) -> Workload:
    if not prompts:
        raise WorkloadError(f"{path}: no usable records")
    have = [t is not None for t in times]
    arrival: FloatArray | None = None
    if all(have):
        arrival = np.array(times, dtype=np.float64)
        arrival -= arrival.min()
        order = np.argsort(arrival, kind="stable")
        return Workload(
            name,
            np.array(prompts, dtype=np.int64)[order],
            np.array(outputs, dtype=np.int64)[order],
            arrival[order],
        )
    if any(have):
        raise WorkloadError(f"{path}: some records have a timestamp and some do not")
    return Workload(
        name, np.array(prompts, dtype=np.int64), np.array(outputs, dtype=np.int64), arrival
    )


def load_sharegpt(path: str | Path, count_tokens: Callable[[str], int] = approx_tokens) -> Workload:
    """ShareGPT format: a list of ``{"conversations": [{"from", "value"}, ...]}``.

    As vLLM's benchmark does, the first turn is the prompt and the second the
    answer; records with fewer than two turns are skipped. Recorded lengths
    (``prompt_tokens``/``output_tokens`` and the aliases in ``_PROMPT_FIELDS``
    / ``_OUTPUT_FIELDS``) win over counting the text; a ``timestamp`` (s) on
    every record makes it a trace.
    """
    path = Path(path)
    prompts: list[int] = []
    outputs: list[int] = []
    times: list[float | None] = []
    for i, rec in enumerate(_read_json_list(path)):
        where = f"{path} record {i}"
        if not isinstance(rec, dict):
            raise WorkloadError(f"{where}: expected an object")
        conv = rec.get("conversations", rec.get("conversation"))
        if not isinstance(conv, list):
            raise WorkloadError(f"{where}: no 'conversations' list")
        p = _recorded(rec, _PROMPT_FIELDS, where)
        o = _recorded(rec, _OUTPUT_FIELDS, where)
        if (p is None or o is None) and len(conv) < 2:
            continue
        if p is None:
            p = count_tokens(_turn_text(conv[0], where))
        if o is None:
            o = count_tokens(_turn_text(conv[1], where))
        prompts.append(max(1, p))
        outputs.append(max(1, o))
        times.append(_timestamp(rec, where))
    return _build("sharegpt-file", prompts, outputs, times, path)


def _turn_text(turn: Any, where: str) -> str:
    if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
        raise WorkloadError(f"{where}: a turn must be an object with a string 'value'")
    text: str = turn["value"]
    return text


def load_alpaca(path: str | Path, count_tokens: Callable[[str], int] = approx_tokens) -> Workload:
    """Alpaca format: a list of ``{"instruction", "input", "output"}``.

    The prompt is the instruction followed by the input when it is not empty;
    the output length is a recorded field when present, else the token count
    of ``output``.
    """
    path = Path(path)
    prompts: list[int] = []
    outputs: list[int] = []
    times: list[float | None] = []
    for i, rec in enumerate(_read_json_list(path)):
        where = f"{path} record {i}"
        if not isinstance(rec, dict):
            raise WorkloadError(f"{where}: expected an object")
        p = _recorded(rec, _PROMPT_FIELDS, where)
        o = _recorded(rec, _OUTPUT_FIELDS, where)
        if p is None:
            instruction = rec.get("instruction")
            extra = rec.get("input", "")
            if not isinstance(instruction, str) or not isinstance(extra, str):
                raise WorkloadError(f"{where}: 'instruction' and 'input' must be strings")
            p = count_tokens(instruction + ("\n\n" + extra if extra else ""))
        if o is None:
            answer = rec.get("output")
            if not isinstance(answer, str):
                raise WorkloadError(f"{where}: no recorded output length and no 'output' string")
            o = count_tokens(answer)
        prompts.append(max(1, p))
        outputs.append(max(1, o))
        times.append(_timestamp(rec, where))
    return _build("alpaca-file", prompts, outputs, times, path)


def load_trace(path: str | Path) -> Workload:
    """JSON lines ``{"timestamp": ms, "input_length": n, "output_length": m}`` (Mooncake).

    Timestamps are milliseconds as in Mooncake's traces; a record may instead
    carry ``arrival_s`` (seconds). Lengths also accept the aliases of
    ``_PROMPT_FIELDS`` / ``_OUTPUT_FIELDS``.
    """
    path = Path(path)
    prompts: list[int] = []
    outputs: list[int] = []
    times: list[float | None] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise WorkloadError(f"cannot read trace {str(path)!r}: {exc.strerror}") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(rec, dict):
            raise WorkloadError(f"{where}: expected an object")
        p = _recorded(rec, _PROMPT_FIELDS, where)
        o = _recorded(rec, _OUTPUT_FIELDS, where)
        if p is None or o is None:
            raise WorkloadError(f"{where}: needs input_length and output_length")
        if "arrival_s" in rec:
            t = _timestamp(rec, where)
        else:
            ms = _timestamp(rec, where)
            t = None if ms is None else ms / 1000.0
        prompts.append(max(1, p))
        outputs.append(max(1, o))
        times.append(t)
    return _build("trace", prompts, outputs, times, path)


def load(spec: str, fmt: str = "auto") -> Workload | str:
    """A synthetic name (returned as is, drawn per run) or a loaded file.

    ``fmt`` is ``auto`` (by extension and content), ``sharegpt``, ``alpaca``
    or ``trace``.
    """
    if spec in SYNTHETIC and fmt == "auto":
        return spec
    path = Path(spec)
    if not path.exists():
        raise WorkloadError(
            f"workload {spec!r} is neither a file nor one of {', '.join(SYNTHETIC)}"
        )
    if fmt == "auto":
        fmt = "trace" if path.suffix in {".jsonl", ".ndjson"} else _sniff(path)
    loaders: dict[str, Callable[[Path], Workload]] = {
        "sharegpt": load_sharegpt,
        "alpaca": load_alpaca,
        "trace": load_trace,
    }
    if fmt not in loaders:
        raise WorkloadError(f"unknown workload format {fmt!r}; expected auto, {', '.join(loaders)}")
    return loaders[fmt](path)


def _sniff(path: Path) -> str:
    data = _read_json_list(path)
    first = next((r for r in data if isinstance(r, dict)), None)
    if first is None:
        raise WorkloadError(f"{path}: no records")
    if "conversations" in first or "conversation" in first:
        return "sharegpt"
    if "instruction" in first:
        return "alpaca"
    raise WorkloadError(
        f"{path}: neither ShareGPT (conversations) nor Alpaca (instruction) records"
    )


def poisson_arrivals(rate: float, duration_s: float, rng: np.random.Generator) -> FloatArray:
    """Arrival times of a Poisson process of ``rate`` per second on [0, duration)."""
    if rate <= 0 or duration_s <= 0:
        return np.zeros(0)
    # Draw a few sigma more gaps than expected, top up in the rare short case.
    expect = rate * duration_s
    chunks: list[FloatArray] = []
    total = 0.0
    while total < duration_s:
        gaps = rng.exponential(1.0 / rate, int(expect + 6 * math.sqrt(expect) + 16))
        times = total + np.cumsum(gaps)
        chunks.append(times)
        total = float(times[-1])
    out = np.concatenate(chunks)
    result: FloatArray = out[out < duration_s]
    return result
