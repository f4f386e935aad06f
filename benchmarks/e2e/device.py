"""The emulated device of ``star bench e2e``'s device regime: one card, one compression rule.

A :class:`DeviceCard` is the paper's device as ``star simulate`` models it
(its defaults, :class:`star.sim.config.SimConfig`: DeepSeek-R1-Distill-Qwen-7B
W8A8 on an RTX 4090D, paper §5.3 and §6.3): a decode step of
``a + b x (KV tokens in the batch)``, a prefill (and a recompute after
preemption) cost per token, the KV cache's size in tokens and bytes per
token, the D->D link, and answers up to 32,768 tokens.

The served model is tiny and its answers short (``cap`` tokens at most), so
the card is **compressed** by one factor ``c = card.max_output / cap``: one
served token stands for ``c`` card tokens, and one served decode step for
``c`` card steps, so everything keeps the card's proportions when time runs
``c`` times faster than the card's except in the step itself:

- the KV capacity is the card's divided by ``c`` (a full instance holds as
  many of the longest answers as on the card);
- a decode step is ``a + (b x c) x (served KV tokens)``: 8 ms empty, 28 ms at
  full KV, as on the card;
- a prefill, a recompute after preemption and a KV pull cost the card's
  price per token **per served token** (0.125 ms, 57,344 B over 25 Gbit/s):
  ``N / c`` served tokens take ``1 / c`` of the card's time for ``N``
  tokens, as every other duration of the request does (its decode lasts
  ``1 / c`` as many steps). A stall then weighs on a request's TPOT and a
  move against its remaining decode exactly as on the card. (Pricing these
  at ``c`` times the card's per-token cost instead would keep their length in
  steps but make each ``c`` times heavier against the requests it delays:
  a cap-length move would cost 13 % of the request's life at ``c = 55``
  where the card's costs 0.1 %.)
- rates: ``c`` times the card's (requests live ``c`` times fewer steps);
  the sweep's rates are the served fleet's.

What does not scale: the scheduler's tick and report cadence (wall time and
steps) are the live settings', so relative to a request's life the
scheduler reacts ``c`` times later than on the card.

**Time dilation** ``d`` multiplies every device time (and the SLOs) and
divides the request rates, so the CPU idles most of every padded step even
with several engines on a few cores; ``d = 1`` is the card's own clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class DeviceCard:
    """A device in its own units (seconds, tokens, bytes)."""

    step_base_s: float
    step_per_token_s: float
    prefill_per_token_s: float
    kv_tokens: int
    kv_bytes_per_token: int
    link_gbps: float
    max_output: int
    slo_ttft_s: float
    slo_tpot_s: float

    @classmethod
    def paper(cls) -> DeviceCard:
        """The card ``star simulate`` models by default (see the module docstring)."""
        from star.sim.config import SimConfig

        c = SimConfig()
        return cls(
            step_base_s=c.step_base_s,
            step_per_token_s=c.step_per_token_s,
            prefill_per_token_s=c.prefill_per_token_s,
            kv_tokens=c.kv_capacity_tokens,
            kv_bytes_per_token=c.bytes_per_token,
            link_gbps=c.bandwidth_gbps,
            max_output=c.max_output_tokens,
            slo_ttft_s=c.ttft_slo_s,
            slo_tpot_s=c.tpot_slo_s,
        )


@dataclass(frozen=True, slots=True)
class Emulation:
    """``card`` compressed to answers of ``cap`` served tokens and dilated by ``dilation``."""

    card: DeviceCard
    cap: int
    dilation: float = 1.0

    def __post_init__(self) -> None:
        if self.cap < 1:
            raise ValueError(f"cap must be >= 1 token, got {self.cap}")
        if not self.dilation >= 1.0:
            raise ValueError(
                f"time dilation must be >= 1 (slower than the card), got {self.dilation}"
            )

    @property
    def compression(self) -> float:
        """``c``: card tokens per served token."""
        return self.card.max_output / self.cap

    @property
    def kv_tokens(self) -> int:
        """KV capacity of a served instance: the card's, in served tokens."""
        return int(self.card.kv_tokens / self.compression)

    @property
    def step_base_ms(self) -> float:
        return self.card.step_base_s * self.dilation * 1e3

    @property
    def step_us_per_token(self) -> float:
        return self.card.step_per_token_s * self.compression * self.dilation * 1e6

    @property
    def prefill_us_per_token(self) -> float:
        """Prefill, and recompute after preemption, per served token: the card's per token."""
        return self.card.prefill_per_token_s * self.dilation * 1e6

    @property
    def transfer_us_per_token(self) -> float:
        """A KV pull per served token: the card's bytes per token over its link."""
        bits = self.card.kv_bytes_per_token * 8
        return bits / (self.card.link_gbps * 1e9) * self.dilation * 1e6

    @property
    def slo_ttft_ms(self) -> float:
        return self.card.slo_ttft_s * self.dilation * 1e3

    @property
    def slo_tpot_ms(self) -> float:
        return self.card.slo_tpot_s * self.dilation * 1e3

    def describe(self) -> dict[str, Any]:
        """What every result of the regime prints beside its numbers."""
        return {
            "card": "DeepSeek-R1-Distill-Qwen-7B W8A8 on RTX 4090D (paper §5.3; star simulate's defaults)",
            "compression": round(self.compression, 3),
            "dilation": self.dilation,
            "kv_tokens": self.kv_tokens,
            "step_ms": f"{self.step_base_ms:g} + {self.step_us_per_token:.3g} us x KV tokens",
            "prefill_us_per_token": round(self.prefill_us_per_token, 3),
            "transfer_us_per_token": round(self.transfer_us_per_token, 3),
            "slo_ms": (self.slo_ttft_ms, self.slo_tpot_ms),
        }
