"""The end-to-end workloads: what each client sends, and whether its final length is known.

- ``task``: the tiny model's countdown-list task with natural lengths (the
  length predictor's own regime: lengths depend on the prompt; decoding is
  greedy, so a prompt's length is the same in every mode). Final lengths are unknown in advance, so ``oracle`` cannot run.
- ``replay``: ``ignore_eos`` with output lengths drawn from a heavy-tailed
  distribution shaped like the paper's Table 3 (ShareGPT on
  DeepSeek-R1-Distill-Qwen-7B: P50 4.7 % of the 32K cap, mean 23 %, over
  15 % of answers at the cap), scaled to ``cap`` tokens. Each prompt is the
  task's prompt of the size whose natural answer is nearest the drawn length,
  so a prompt carries a coarse length signal as a real trace's prompts do.
  Final lengths are known: ``oracle`` runs.
- a ShareGPT-format JSON file: the first human turn and the recorded
  answer's length in tokens as ``max_tokens``, with ``ignore_eos`` (as vLLM's
  benchmark replays it), so ``oracle`` runs too.

Pure: the same seed gives the same requests and arrival times.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from benchmarks.serve import BenchRequest, arrival_times, sharegpt_requests, task_requests

# Table 3, ShareGPT output lengths with a 32,768-token cap, as fractions of the cap.
TABLE3_P50 = 1536 / 32768
TABLE3_MEAN = 7542 / 32768
AT_CAP_SHARE = 0.16  # "over 15 % of requests generate over 25K tokens"
NEAR_CAP = 0.95  # answers "at the cap" are drawn from [NEAR_CAP, 1] x cap
BODY_SIGMA = 1.5  # log-normal spread of the rest (puts the mean near Table 3's)

# Natural answer length of each task size: nominal items x ~5 tokens (star.model.task).
TOKENS_PER_ITEM = 5


@dataclass(frozen=True, slots=True)
class Workload:
    """A workload by name: ``task``, ``replay`` or a ShareGPT file path."""

    name: str
    sizes: tuple[str, ...] = ("tiny", "short", "medium", "long", "huge")
    cap: int = 1024  # replay: the longest answer; task/sharegpt: max_tokens

    @property
    def known_lengths(self) -> bool:
        """Whether each request's final length is known (``ignore_eos``): oracle can run."""
        return self.name != "task"

    @property
    def extra(self) -> dict[str, object]:
        """Request fields every request of this workload carries.

        Greedy decoding, so every mode of a seed serves the same requests with
        the same output lengths (paired by construction: a migration keeps a
        greedy answer exact); ``ignore_eos`` where the length is fixed.
        """
        greedy: dict[str, object] = {"temperature": 0.0}
        return {**greedy, "ignore_eos": True} if self.known_lengths else greedy

    def requests(
        self, n: int, rng: np.random.Generator, count_tokens: Callable[[str], int] | None = None
    ) -> list[BenchRequest]:
        if n < 1:
            raise ValueError(f"a workload needs at least 1 request, got {n}")
        if self.cap < 2:
            raise ValueError(f"the length cap must be >= 2 tokens, got {self.cap}")
        if self.name == "task":
            return task_requests(n, rng, self.sizes, self.cap)
        if self.name == "replay":
            lengths = replay_lengths(n, rng, self.cap)
            return [BenchRequest(prompt_for_length(int(x), rng), int(x)) for x in lengths]
        path = Path(self.name)
        if not path.exists():
            raise ValueError(
                f"workload {self.name!r}: expected task, replay or a ShareGPT JSON file"
            )
        if count_tokens is None:
            raise ValueError("a ShareGPT workload needs a tokenizer to count answer tokens")
        return sharegpt_requests(path, n, rng, count_tokens, self.cap)


def replay_lengths(n: int, rng: np.random.Generator, cap: int) -> npt.NDArray[np.int64]:
    """``n`` output lengths in [1, cap] shaped like Table 3 (see the module docstring).

    A share :data:`AT_CAP_SHARE` lies in [NEAR_CAP, 1] x cap; the rest is
    log-normal with spread :data:`BODY_SIGMA`, placed so the overall median
    is Table 3's P50 fraction of the cap, and cut at the cap.
    """
    at_cap = rng.random(n) < AT_CAP_SHARE
    # The overall median is the body's quantile 0.5 / (1 - AT_CAP_SHARE).
    from scipy.stats import norm

    z = float(norm.ppf(0.5 / (1.0 - AT_CAP_SHARE)))
    mu = math.log(TABLE3_P50 * cap) - BODY_SIGMA * z
    body = np.exp(rng.normal(mu, BODY_SIGMA, size=n))
    top = rng.uniform(NEAR_CAP * cap, cap, size=n)
    out = np.where(at_cap, top, np.minimum(body, cap))
    lengths: npt.NDArray[np.int64] = np.clip(np.rint(out), 1, cap).astype(np.int64)
    return lengths


def size_for_length(tokens: int) -> str:
    """The task size whose natural answer (nominal items x ~5 tokens) is nearest ``tokens``, in log scale."""
    from star.model.task import SIZES

    return min(
        SIZES,
        key=lambda s: abs(math.log(max(tokens, 1)) - math.log(SIZES[s].nominal * TOKENS_PER_ITEM)),
    )


def prompt_for_length(tokens: int, rng: np.random.Generator) -> list[dict[str, str]]:
    """A task prompt (chat messages) whose size word matches an answer of ``tokens``."""
    from star.model.task import sample_prompt

    return sample_prompt(rng, [size_for_length(tokens)]).messages()


def schedule(
    workload: Workload,
    n: int,
    rate: float,
    seed: int,
    count_tokens: Callable[[str], int] | None = None,
) -> tuple[list[BenchRequest], list[float]]:
    """The requests and their send times (s) for one seed: the same in every mode."""
    rng = np.random.default_rng(seed)
    requests = workload.requests(n, rng, count_tokens)
    return requests, arrival_times(n, rate, np.random.default_rng([seed, 1]))
