"""vLLM extensions for the D->D release (docs/design.md §5.1), registered through vLLM's own config.

:class:`StarScheduler` (``scheduler_cls``) reads an abort of
``"star-release:<internal id>"`` as "release this request": at the end of its
next running step it finishes it with the KV held and one last output
carrying the connector's ``kv_transfer_params``. :class:`StarNixlConnector`
keeps the blocks of a released request only (until NIXL's read notification,
``decoder_kv_blocks_ttl`` at most). Both run in the engine-core process; why
and how is in ``docs/vllm-notes.md`` §4.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from workers.continuation import resume_tokens
from workers.nixl_auth import SECRET_ENV, secure_nixl_side_channel
from workers.pacing import PulledKvPacer
from workers.parent import end_with_parent

RELEASE_PREFIX = "star-release:"
"""An aborted id ``RELEASE_PREFIX + internal_id [+ "|" + migration]`` asks for a release."""

RELEASE_KEY = "star_release"
"""Key of ``kv_transfer_params`` marking a released request (value: the migration id)."""


def release_id(internal_id: str, migration: str) -> str:
    """The id to abort to release ``internal_id`` for ``migration``."""
    return f"{RELEASE_PREFIX}{internal_id}|{migration}"


def parse_release_id(marked: str) -> tuple[str, str] | None:
    """``(internal_id, migration)`` of a marked id, None for a plain one."""
    if not marked.startswith(RELEASE_PREFIX):
        return None
    body = marked[len(RELEASE_PREFIX) :]
    internal, _, migration = body.rpartition("|")
    if not internal:
        internal, migration = body, ""
    return internal, migration


class StarScheduler(Scheduler):
    """vLLM's scheduler plus the release of a running request at a step boundary.

    A continuation (a request with ``extra_args[RESUME_KEY]``, docs/design.md
    §5.2) enters with those tokens as its output tokens, as a request
    preempted after generating them would be: its budgets and stop checks
    count them, and it computes (or pulls) prompt + outputs but the last
    before it samples on. It runs in the engine-core process, and also ends
    that process when the worker that started it is gone (:func:`end_with_parent`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.star_pending: dict[str, str] = {}  # internal id -> migration id
        self.star_grammar: dict[str, list[int]] = {}  # continuations whose grammar awaits replay
        self.star_failed: set[str] = set()  # continuations whose grammar rejected the replay
        end_with_parent()

    def add_request(self, request: Request) -> None:
        tokens = resume_tokens(request.sampling_params)
        if tokens and request.request_id not in self.requests and not request.num_output_tokens:
            request.append_output_token_ids(tokens)
            # vLLM asserts a first prefill's cache hit stays within the prompt;
            # a continuation's runs past it (local prefix cache or the pull).
            request.prefill_stats = None
            if request.use_structured_output:
                # Its grammar compiles meanwhile; it is advanced over them before its first mask.
                self.star_grammar[request.request_id] = tokens
        super().add_request(request)

    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> Any:
        if self.star_grammar:
            self._star_replay_grammars()
        return super().get_grammar_bitmask(scheduler_output)

    def _star_replay_grammars(self) -> None:
        """Advance each continuation's compiled grammar over the tokens it generated before.

        vLLM calls this right after ``schedule()``, which promotes a request
        whose grammar is ready and may schedule it in the same step: replayed
        here, its first mask is the one after those tokens. A grammar that
        rejects them (it cannot, for tokens generated under the same one) ends
        the request in error at the end of the step.
        """
        for rid, tokens in list(self.star_grammar.items()):
            request = self.requests.get(rid)
            if request is None or request.is_finished():
                del self.star_grammar[rid]
                continue
            structured = request.structured_output_request
            grammar = structured.grammar if structured is not None else None
            if grammar is None or isinstance(grammar, Exception):
                continue  # still compiling (vLLM reports a failed compile itself)
            del self.star_grammar[rid]
            if not self.structured_output_manager.accept_tokens(request, tokens):
                self.star_failed.add(rid)

    def finish_requests(
        self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus
    ) -> list[Request]:
        if request_ids is None or finished_status != RequestStatus.FINISHED_ABORTED:
            return super().finish_requests(request_ids, finished_status)
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        plain: list[str] = []
        for rid in ids:
            marked = parse_release_id(rid)
            if marked is None:
                plain.append(rid)
            elif marked[0] in self.requests:
                self.star_pending[marked[0]] = marked[1]
            # An unknown id: the request already ended; its stream says so.
        if plain:
            for rid in plain:
                self.star_pending.pop(rid, None)  # a real abort wins over a release
            return super().finish_requests(plain, finished_status)
        return []

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self.star_pending:
            self._star_release(outputs)
        if self.star_failed:
            self._star_fail(outputs)
        return outputs

    def _star_fail(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        """End every continuation whose grammar rejected its replay (``finish_reason`` error)."""
        for rid in list(self.star_failed):
            self.star_failed.discard(rid)
            for request in super().finish_requests(rid, RequestStatus.FINISHED_ERROR):
                self._star_output(outputs, request, None)

    def _star_release(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        """Release every pending request that is running now (this is a step boundary)."""
        for rid, migration in list(self.star_pending.items()):
            request = self.requests.get(rid)
            if request is None or request.is_finished():
                del self.star_pending[rid]  # it finished on its own: nothing to release
                continue
            if (
                request.status != RequestStatus.RUNNING
                or request.num_output_tokens == 0
                or request.num_computed_tokens < request.num_tokens - 1
            ):
                # Waiting (KV pull, preempted) or prefilling (a continuation's
                # outputs count before they are computed): release once it decodes.
                continue
            del self.star_pending[rid]
            self.running = [r for r in self.running if r is not request]
            if isinstance(self.connector, StarNixlConnector):
                self.connector.track_release(rid)
            request.kv_transfer_params = {RELEASE_KEY: migration}
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            kv_params, _ = self._free_request(request)
            if kv_params is not None:
                kv_params[RELEASE_KEY] = migration
                kv_params["star_num_tokens"] = request.num_tokens
            self._star_output(outputs, request, kv_params)

    @staticmethod
    def _star_output(
        outputs: dict[int, EngineCoreOutputs], request: Request, kv_params: Any
    ) -> None:
        """Add the last output of ``request``, ended here, to this step's ``outputs``."""
        final = EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=[],
            finish_reason=request.get_finished_reason(),
            events=request.take_events(),
            kv_transfer_params=kv_params,
            trace_headers=request.trace_headers,
        )
        eco = outputs.get(request.client_index)
        if eco is None:
            outputs[request.client_index] = EngineCoreOutputs(outputs=[final])
        else:
            eco.outputs.append(final)


def is_release(params: dict[str, Any]) -> bool:
    """Whether ``kv_transfer_params`` are the marker :class:`StarScheduler` sets on a release."""
    return RELEASE_KEY in params and "remote_block_ids" not in params


def readback_tried(params: dict[str, Any] | None) -> bool:
    """Whether a D->D target already tried its one pull of the source's blocks.

    vLLM marks the turn-2 readback ``_remote_blocks_processed`` when it
    queues the read. A read that failed (source gone, NIXL error, or declined
    because the source's hold expired) sends the request back to the waiting
    queue with no KV, and vLLM 0.32 then asks the connector again: it would
    answer "load asynchronously" for a read it never issues a second time,
    and the request would wait for remote KV forever.
    """
    return bool(
        params and params.get("do_remote_decode") and params.get("_remote_blocks_processed")
    )


TRANSFER_ENV = "STAR_DEVICE_TRANSFER_US_PER_TOKEN"
"""Emulated device timing: a KV pull completes no sooner than this many us per token after it starts."""

PROGRESS_DELAY_ENV = "STAR_NIXL_PROGRESS_DELAY_US"
DEFAULT_PROGRESS_DELAY_US = 1000


def pace_nixl_progress_thread(delay_us: int) -> None:
    """Have NIXL agents created from now on sleep ``delay_us`` between progress calls.

    nixl's Python agent hard-codes ``pthrDelay = 0``: its progress thread polls
    UCX without pause, and an *idle* engine burned 0.6-0.8 of a core on it
    (0.01 without the KV connector) -- three idle engines kept a 2-core
    machine at a load average of 20-50. vLLM polls transfers itself every
    engine step, so a short pause in the background thread costs a transfer
    at most ``delay_us``. 0 keeps nixl's busy polling.
    """
    from nixl import _api

    base = getattr(_api.nixlBind, "_star_base_config", _api.nixlBind.nixlAgentConfig)
    if delay_us <= 0:
        _api.nixlBind.nixlAgentConfig = base
        return

    class PacedAgentConfig(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:
            return int(base.pthrDelay.__get__(self))

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:
            base.pthrDelay.__set__(self, max(int(value), delay_us))

    _api.nixlBind._star_base_config = base
    _api.nixlBind.nixlAgentConfig = PacedAgentConfig


@contextlib.contextmanager
def keep_cpu_affinity() -> Iterator[None]:
    """Restore the calling thread's CPU affinity after the block.

    On a CPU device vLLM 0.32's NIXL worker "reserves" the last core of each
    NUMA node for KV transfers with ``os.sched_setaffinity(0, ...)`` -- which
    pins the *calling* thread: the one that then runs the model, the
    scheduler and, with the ``uni`` executor, the whole engine core. Every
    engine on a host ended up on the same core (core 1 of 2 here) while the
    others sat idle, and the tap's small matrix products waited on OpenMP
    threads sharing that core. The pin is undone; NIXL's own threads are
    started by its agent and are not affected either way.
    """
    if not hasattr(os, "sched_getaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    try:
        yield
    finally:
        if os.sched_getaffinity(0) != before:
            os.sched_setaffinity(0, before)


class StarNixlConnector(NixlPullConnector):
    """vLLM's NIXL (pull) connector; only a released request holds its blocks on a decode node.

    Also paces NIXL's progress thread (:func:`pace_nixl_progress_thread`,
    ``STAR_NIXL_PROGRESS_DELAY_US``, default 1000) before vLLM creates the agent,
    and undoes the CPU pin vLLM's NIXL worker puts on the thread creating it
    (:func:`keep_cpu_affinity`), and, with ``cluster.secret`` in its environment,
    puts NIXL's side channel under CURVE (:func:`workers.nixl_auth.secure_nixl_side_channel`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        secure_nixl_side_channel(os.environ.get(SECRET_ENV, ""))
        pace_nixl_progress_thread(
            int(os.environ.get(PROGRESS_DELAY_ENV, DEFAULT_PROGRESS_DELAY_US))
        )
        with keep_cpu_affinity():
            super().__init__(*args, **kwargs)
        self.star_pull = PulledKvPacer(
            float(os.environ.get(TRANSFER_ENV) or 0.0) / 1e6,
            int(self._vllm_config.cache_config.block_size),
        )

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self.star_pull.per_token_s > 0:
            self.star_pull.started(getattr(self._connector_metadata, "reqs_to_recv", {}))
        super().start_load_kv(forward_context, **kwargs)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = super().get_transfer_results(finished_req_ids)
        if self.star_pull.per_token_s > 0:
            results.finished_recving = self.star_pull.finished(
                results.finished_recving, results.failed_recving
            )
        return results

    def track_release(self, request_id: str) -> None:
        """Have the worker side track a released request's blocks (lease, read notification).

        vLLM's NIXL worker honours a send lease only for requests announced in
        ``reqs_in_batch``, which it fills for prefill-node requests; a decode
        request released here must be announced too, or the target's read
        notification is dropped as "unrecognized" and the blocks never free.
        """
        assert self.connector_scheduler is not None
        self.connector_scheduler._reqs_in_batch.add(request_id)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if readback_tried(request.kv_transfer_params):
            # ABORTED pull (docs/design.md §5.4): recompute prompt + generated tokens here.
            return 0, False
        if resume_tokens(request.sampling_params):
            return self._continuation_match(request, num_computed_tokens)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def _continuation_match(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """What a continuation pulls from its source: every token but the last (P + N - 1).

        vLLM's pull stops at the prompt (``min(remote_num_tokens,
        num_prompt_tokens)``); a continuation's prompt is the original one and
        its generated tokens are outputs, which would be recomputed. The same
        rule otherwise: only a complete D->D readback, none under
        ``kv_recompute_threshold`` tokens.
        """
        sched = self.connector_scheduler
        assert sched is not None
        params = request.kv_transfer_params
        keys = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
        if not (
            params
            and params.get("do_remote_decode")
            and params.get("remote_block_ids")
            and all(k in params for k in keys)
        ):
            return 0, False
        remote = int(params.get("remote_num_tokens") or 0)
        count = min(remote, request.num_tokens - 1) - num_computed_tokens
        threshold = sched.kv_recompute_threshold
        if count <= 0 or (threshold > 0 and count < threshold):
            return 0, False
        return count, True

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        sched = self.connector_scheduler
        assert sched is not None
        params = request.kv_transfer_params
        if not sched.is_bidirectional_kv_xfer_enabled or not params or is_release(params):
            # A prefill node (vLLM's P->D) or a release: vLLM holds the blocks.
            return sched.request_finished(request, block_ids)
        if params.get("do_remote_prefill"):
            # A P->D decode request that never pulled: vLLM tells the prefill to free.
            return sched.request_finished(request, block_ids)
        if params.get("do_remote_decode") and not params.get("_remote_blocks_processed"):
            # A D->D target that ended before its pull was scheduled: tell the
            # source to free its blocks now (an empty read notifies it).
            sched._reqs_need_recv[request.request_id] = (request, [], (), False)
            params["_remote_blocks_processed"] = True
        # A decode request that ended: free its blocks now.
        sched._stop_heartbeat(request.request_id)
        sched._reqs_not_processed.add(request.request_id)
        return False, None
