"""Fuzzing what a worker makes of a Generate frame's sampling map.

A Generate frame that decodes (:mod:`star.wire` checks only that ``sampling``
is a map with string keys) reaches :func:`workers.engine_config.sampling_params`:
whatever its values, the worker gets vLLM ``SamplingParams`` or a
:class:`~workers.protocol.BadRequest` (an Error frame to the proxy), never
another exception that would take the stream down as an internal error.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from star.wire import Generate, decode, encode
from tests.fuzz.common import FUZZ, Tally, run_fuzz
from tests.fuzz.strategies import ANY_VALUE
from workers.protocol import BadRequest, GenerateRequest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # vLLM's import-time warnings are not this test's
    from vllm import SamplingParams

    from workers.engine_config import sampling_params

FIELDS = sorted(SamplingParams.__struct_fields__)
# Values of the right kind, so a map gets past the first check now and then.
PLAUSIBLE = (
    st.integers(-2, 64)
    | st.floats(-3, 3, allow_nan=False)
    | st.booleans()
    | st.lists(st.text(max_size=4), max_size=3)
    | st.lists(st.integers(0, 600), max_size=3)
)


@st.composite
def sampling_map(draw: st.DrawFn) -> dict[str, Any]:
    names = draw(st.lists(st.sampled_from(FIELDS) | st.text(max_size=8), max_size=6, unique=True))
    return {n: draw(PLAUSIBLE | ANY_VALUE) for n in names}


def _run(sampling: dict[str, Any], role: str, continued: int) -> str:
    frame = Generate(
        stream=1,
        request_id="r",
        prompt_token_ids=[1, 2, 3],
        sampling=sampling,
        continued=continued,
    )
    msg = decode(encode(frame))  # as the worker receives it
    assert isinstance(msg, Generate)
    try:
        params = sampling_params(GenerateRequest.from_frame(msg), role)
    except BadRequest:
        return "BadRequest"
    assert isinstance(params, SamplingParams)
    return "SamplingParams"


@pytest.mark.filterwarnings("ignore")
def test_sampling_maps_give_params_or_bad_request() -> None:
    tally = Tally("worker sampling_params from Generate frames")

    @FUZZ
    @given(sampling_map(), st.sampled_from(["prefill", "decode"]), st.integers(0, 3))
    def check(sampling: dict[str, Any], role: str, continued: int) -> None:
        tally.run(lambda: _run(sampling, role, continued))

    run_fuzz(tally, check)
