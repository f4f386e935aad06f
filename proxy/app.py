"""The proxy's HTTP application: routes, auth, metrics, OpenAI <-> Backend.

``ProxyApp`` is the :data:`proxy.http.Handler`; :func:`create_server` puts it
behind an :class:`~proxy.http.HttpServer`::

    app = ProxyApp(backend, [ModelCard.load(path, name)], settings.proxy)
    server = create_server(app, settings.proxy)
    await server.start()          # or: await server.serve()
    ...
    await server.shutdown()       # stop intake, drain, cancel stragglers

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``, ``GET /metrics``,
and ``GET`` / ``DELETE /v1/streams/{event id}`` (resume or cancel a stream:
:mod:`proxy.resume`).
With ``settings.api_key`` set, ``/v1/*`` needs ``Authorization: Bearer <key>``
(checked as soon as the request head arrives, before the body is read), and
so do ``/health`` and ``/metrics`` with ``settings.protect_metrics``; without
it, ``/health`` answers a keyless probe with ``{"ok": ...}`` alone (the
instance list is for key holders). Errors with status 500 and up carry a fixed
message and the request id; what went wrong (instances, addresses, exception
text) goes to the log line of that request id.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import secrets
import time
from bisect import bisect_left
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable
from urllib.parse import unquote

import structlog
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from proxy import beam, chat_tools, resume
from proxy.adopt import abandon
from proxy.backend import Backend, BackendError, GenerationRequest, TokenBatch
from proxy.decode_run import Found
from proxy.fanout import FanIn, child_ids, children, drop_if_cut
from proxy.http import (
    HttpError,
    HttpServer,
    InStreamError,
    Request,
    Response,
    StreamingResponse,
    internal_error,
    new_request_id,
)
from proxy.openai import (
    ParsedRequest,
    Relay,
    error_stream,
    find_model,
    model_payload,
    models_payload,
    parse_chat,
    parse_completion,
)
from proxy.parsing import Parsing
from proxy.stream_context import prompt_logprobs_of
from proxy.tokenizer import ModelCard
from star.settings import ProxySettings

log = structlog.get_logger()

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MODELS = "/v1/models"
STREAMS = "/v1/streams/"
_KNOWN_PATHS = frozenset({COMPLETIONS, CHAT, MODELS, "/health", "/metrics"})
_PROBES = frozenset({"/health", "/metrics"})
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)

Parser = Callable[[bytes, dict[str, ModelCard]], ParsedRequest]


class FastHistogram:
    """A histogram for the per-token path: plain counts, exported at scrape time.

    prometheus-client's Histogram takes a lock and walks its buckets in Python
    on every observation; the event loop is single-threaded, so a bisect and
    two additions are enough.
    """

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Count one observation (a value equal to a bound falls in that bucket)."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def family(self, name: str, documentation: str) -> HistogramMetricFamily:
        """The Prometheus metric family, with cumulative buckets as the format wants."""
        buckets, total = [], 0
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            total += count
            buckets.append((bound, total))
        return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=self.sum)


class ProxyMetrics:
    """Prometheus metrics of one proxy (own registry, so tests can make several).

    Per-request metrics use prometheus-client directly; the per-token ones
    (tokens relayed, TTFT, inter-token time) are plain numbers collected at
    scrape time, to keep the relay loop cheap.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "star_proxy_requests",
            "HTTP responses by route and status",
            ["route", "status"],
            registry=r,
        )
        self.active = Gauge(
            "star_proxy_active_streams", "generation requests in flight", registry=r
        )
        self.tokens = 0
        self.ttft = FastHistogram(_TTFT_BUCKETS)
        self.itl = FastHistogram(_ITL_BUCKETS)
        r.register(self)

    def collect(self) -> Iterator[Metric]:
        """Custom-collector hook: the per-token metrics."""
        yield CounterMetricFamily(
            "star_proxy_tokens_relayed", "generated tokens relayed to clients", value=self.tokens
        )
        yield self.ttft.family("star_proxy_ttft_seconds", "request complete to first token relayed")
        yield self.itl.family(
            "star_proxy_inter_token_seconds", "time between successive token batches"
        )

    def observe_response(self, path: str, status: int) -> None:
        """:data:`proxy.http.Observer` hook: count every response by route and status."""
        if path in _KNOWN_PATHS:
            route = path
        elif path.startswith(MODELS):
            route = MODELS
        else:
            route = STREAMS[:-1] if path.startswith(STREAMS) else "other"
        self.requests.labels(route, str(status)).inc()


class _Timing:
    """Per-request token timing feeding the TTFT and inter-token histograms."""

    __slots__ = ("arrival", "first", "last", "metrics")

    def __init__(self, metrics: ProxyMetrics, arrival: float) -> None:
        self.metrics = metrics
        self.arrival = arrival
        self.first = 0.0
        self.last = 0.0

    def batch(self, batch: TokenBatch) -> None:
        if not batch.token_ids:
            return
        now = time.monotonic()
        m = self.metrics
        if self.first == 0.0:
            self.first = now
            m.ttft.observe(now - self.arrival)
        else:
            m.itl.observe(now - self.last)
        self.last = now
        m.tokens += len(batch.token_ids)


class ProxyApp:
    """Routes requests; generation requests go through :class:`Relay` to the backend."""

    def __init__(
        self,
        backend: Backend,
        models: Sequence[ModelCard],
        settings: ProxySettings,
        *,
        metrics: ProxyMetrics | None = None,
        secret: str = "",
    ) -> None:
        """``secret``: ``cluster.secret``, the key of stream ids (any proxy resumes them)."""
        if not models:
            raise ValueError("ProxyApp needs at least one model")
        self.backend = backend
        self.models = {card.name: _with_parsers(card, settings) for card in models}
        self.settings = settings
        self.metrics = metrics or ProxyMetrics()
        self.active = 0  # generation requests in flight (the gauge, readable)
        self._key = settings.api_key.encode()
        self.parsing = Parsing(self.models)
        self.streams = resume.Streams(resume.Tagger(secret), settings.resume_grace_s)

    async def __call__(self, request: Request) -> Response | StreamingResponse:
        """Handle one request (the :data:`proxy.http.Handler`)."""
        path = request.path
        self.check_head(request)
        if path == COMPLETIONS:
            _method(request, "POST")
            return await self._generate(request, parse_completion)
        if path == CHAT:
            _method(request, "POST")
            return await self._generate(request, parse_chat)
        if path == MODELS:
            _method(request, "GET")
            return Response.json(models_payload(list(self.models.values())))
        if path.startswith(MODELS + "/"):
            _method(request, "GET")
            return Response.json(model_payload(find_model(self.models, path[len(MODELS) + 1 :])))
        if path.startswith(STREAMS):
            stream_id = unquote(path[len(STREAMS) :])
            if request.method == "DELETE":
                return self._cancel_stream(stream_id)
            _method(request, "GET")
            return await self._resume(request, stream_id)
        if path == "/health":
            _method(request, "GET")
            return self._health(request)
        if path == "/metrics":
            _method(request, "GET")
            return Response(200, generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST)
        raise HttpError(404, f"no route for {request.method} {path}", code="not_found")

    def check_head(self, request: Request) -> None:
        """The API key, where a route needs it (the server's head check: 401 before the body)."""
        path = request.path
        if path.startswith("/v1/") or (self.settings.protect_metrics and path in _PROBES):
            self._authorize(request)

    def _authorize(self, request: Request) -> None:
        if not self._key:
            return
        header = request.header("authorization") or ""
        scheme, _, token = header.partition(" ")
        challenge = [("www-authenticate", "Bearer")]
        if scheme.lower() != "bearer" or not token.strip():
            raise HttpError(
                401,
                "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
                headers=challenge,
            )
        if not hmac.compare_digest(token.strip().encode(), self._key):
            raise HttpError(
                401, "Incorrect API key provided.", code="invalid_api_key", headers=challenge
            )

    def _health(self, request: Request) -> Response:
        try:
            status = dict(self.backend.health())
        except Exception as exc:  # a health probe must answer, not crash
            request_id = new_request_id()
            log.warning("health_failed", error=str(exc), request_id=request_id)
            status = {"ok": False, "error": f"health check failed (request id {request_id})"}
        ok = bool(status.get("ok", True))
        code = 200 if ok else 503
        if self._key:
            try:
                self._authorize(request)
            except HttpError:  # a load balancer's probe: up or not, no instance list
                return Response.json({"ok": ok}, code)
        status["ok"] = ok
        status["active_streams"] = self.active
        return Response.json(status, code)

    # -- generation -------------------------------------------------------------

    async def _generate(self, request: Request, parse: Parser) -> Response | StreamingResponse:
        try:
            parsed = await self.parsing.parse(parse, request.body)  # large bodies off the loop
        except InStreamError as exc:  # as vLLM's server: 200, the error as the one event
            log.info("request_failed_in_stream", error=exc.message, param=exc.param)
            return StreamingResponse(_one(error_stream(exc)))
        if parsed.beam is not None:
            try:
                streamed, whole = await self._beam(parsed)
            except BackendError as exc:
                raise _http_error(exc, parsed.gen.request_id) from None
            if whole is None:
                return StreamingResponse(_one(streamed))
            return Response.json(whole)
        gen = parsed.gen
        relay = Relay(parsed)
        timing = _Timing(self.metrics, gen.arrival_s)
        self.active += 1
        self.metrics.active.inc()
        stream: AsyncIterator[TokenBatch] | None = None
        handed_over = False
        try:
            if self._resumable(parsed) and self.streams.tagger.shared:
                # Any proxy of the cluster can take it over from its worker (proxy.adopt).
                context = resume.context_of(parsed, relay.created)
                parsed = dataclasses.replace(parsed, gen=dataclasses.replace(gen, context=context))
            stream = self._open(parsed)
            if not gen.stream:
                await self._collect(relay, stream, timing)
                self._done(relay, timing, "finished")
                return Response.json(relay.response())
            # Wait for the first batch before sending 200, so that a request the
            # backend refuses outright gets a real HTTP error status.
            try:
                first = await anext(stream)
            except StopAsyncIteration:
                raise HttpError(
                    502, "upstream ended the stream before any token", code="upstream_error"
                ) from None
            if self._resumable(parsed):
                ids = wants_event_ids(request)
                response = self._held(parsed, relay, stream, first, timing, ids)
            else:
                response = StreamingResponse(self._relay(relay, stream, first, timing))
            # Run the body to its first (empty) yield: only a started generator
            # runs its cleanup when the server closes it, whatever happens next.
            await anext(response.body)
            handed_over = True
            return response
        except BackendError as exc:
            self._done(relay, timing, "failed", error=exc.message)
            raise _http_error(exc, gen.request_id) from None
        except (RuntimeError, ValueError) as exc:  # the backend broke the stream contract
            self._done(relay, timing, "failed", error=str(exc))
            raise _upstream_error(gen.request_id) from None
        except HttpError as exc:
            self._done(relay, timing, "failed", error=exc.message)
            raise
        except Exception as exc:  # a bug: the traceback to the log, the request id to the client
            self._done(relay, timing, "failed", error=repr(exc))
            log.exception("generate_failed", request_id=gen.request_id)
            raise internal_error(gen.request_id) from None
        except BaseException:
            self._done(relay, timing, "cancelled")
            raise
        finally:
            if not handed_over and stream is not None:
                await _aclose(stream)

    def _held(
        self,
        parsed: ParsedRequest,
        relay: Relay,
        stream: AsyncIterator[TokenBatch],
        first: TokenBatch,
        timing: _Timing,
        ids: bool = True,
    ) -> StreamingResponse:
        """A stream whose every event has its id, held for a resume (proxy.resume).

        ``ids``: the client asked for SSE (:func:`wants_event_ids`); without it
        the events carry no ``id:`` line, and the stream is resumable only from
        its start (``x-star-stream-id``).

        With ``resume_grace_s`` the server detaches a client that goes away
        instead of cancelling its request.
        """
        held = self.streams.hold(parsed, relay.created)

        def on_end(outcome: str, error: BaseException | None) -> None:
            self._done(relay, timing, outcome, error=None if error is None else repr(error))

        reader = resume.Reader(relay, resume.Position(), self.streams.tagger, ids)
        body = resume.drive(held, reader, stream, first, timing.batch, self._error_event, on_end)
        start = self.streams.tagger.format(held.request_id, [resume.Position()] * len(held.choices))
        detach = held.detach_driver if self.streams.grace_s > 0 else None
        return StreamingResponse(body, headers=[("x-star-stream-id", start)], detach=detach)

    @staticmethod
    def _resumable(parsed: ParsedRequest) -> bool:
        """Streamed: its events carry ids (proxy.resume)."""
        return parsed.gen.stream

    def _error_event(self, relay: Relay, exc: BaseException) -> bytes:
        """The in-band error of a stream whose headers are out (logged here, once)."""
        request_id = relay.req.request_id
        if isinstance(exc, BackendError):
            return relay.error_event(_http_error(exc, request_id))
        if isinstance(exc, RuntimeError | ValueError):  # the backend broke the stream contract
            return relay.error_event(_upstream_error(request_id))
        log.error("relay_failed", request_id=request_id, error=repr(exc))
        return relay.error_event(internal_error(request_id))

    async def _resume(self, request: Request, path_id: str) -> StreamingResponse:
        """``GET /v1/streams/{id}``: the stream after the id (or ``Last-Event-ID``)."""
        event = self.streams.parse(path_id, request.header("last-event-id"))
        since = event.positions
        held = self.streams.live.get(event.request_id)
        if held is None:
            return await self._adopt(event)
        resume.check_positions(held, event.positions)
        relay = Relay(held.parsed, created=held.created)
        reader = resume.Reader(relay, event.positions, self.streams.tagger)
        rid = held.request_id

        def on_end(outcome: str, error: BaseException | None) -> None:
            log.info(
                "stream_resume_ended",
                outcome=outcome,
                request_id=rid,
                since_tokens=sum(p.tokens for p in since),
                since_chars=sum(p.chars for p in since),
                completion_tokens=relay.completion_tokens,
                error=None if error is None else repr(error),
            )

        body = resume.follow(held, reader, self._error_event, on_end)
        await anext(body)
        return StreamingResponse(body)

    async def _adopt(self, event: resume.EventId) -> StreamingResponse:
        """A stream another proxy ran: taken over from the workers of its choices (proxy.adopt)."""
        backend = self.backend
        if not isinstance(backend, Adopter) or not self.streams.tagger.shared:
            raise resume.not_found(event.request_id, self.streams.grace_s)
        rid, count = event.request_id, len(event.positions)
        answers = await asyncio.gather(
            *(backend.attach_stream(i) for i in child_ids(rid, count)), return_exceptions=True
        )
        founds = [a for a in answers if isinstance(a, Found)]
        try:
            for a in answers:
                if isinstance(a, BaseException):
                    raise a
            if not founds:
                raise resume.not_found(rid, self.streams.grace_s)
            picked = [a if isinstance(a, Found) else None for a in answers]
            parsed, created, firsts = _adopted(rid, picked, event.positions, self.models)
        except BaseException:
            await asyncio.gather(*map(abandon, founds))  # no client can have the rest
            raise
        relay = Relay(parsed, created=created)
        timing = _Timing(self.metrics, parsed.gen.arrival_s)
        self.active += 1
        self.metrics.active.inc()
        held = self.streams.hold(parsed, created)
        for log_, (_, known) in zip(held.choices, firsts, strict=True):
            if log_.scores is not None:
                log_.scores.known_from = known

        def on_end(outcome: str, error: BaseException | None) -> None:
            self._done(relay, timing, outcome, error=None if error is None else repr(error))

        reader = resume.Reader(relay, event.positions, self.streams.tagger)
        sources = []
        for k, (req, found) in enumerate(zip(children(parsed), picked, strict=True)):
            if found is None:  # its proxy died before it reached a decode worker: run it again
                log.info("stream_choice_restarted", request_id=rid, choice=k)
                sources.append(self.backend.generate(req))
            else:
                sources.append(backend.serve_attached(req, found))
        batches = [batch for batch, _ in firsts if batch is not None]
        source = sources[0] if count == 1 else FanIn(sources, ahead=batches[1:])
        body = resume.drive(
            held, reader, source, batches[0], timing.batch, self._error_event, on_end, len(batches)
        )
        await anext(body)
        detach = held.detach_driver if self.streams.grace_s > 0 else None
        return StreamingResponse(body, detach=detach)

    def _cancel_stream(self, path_id: str) -> Response:
        """``DELETE /v1/streams/{id}``: abort the request now (its KV is freed)."""
        held, _ = self.streams.find(path_id, None)
        self.streams.forget(held)
        log.info("stream_deleted", request_id=held.request_id)
        return Response.json({"id": held.request_id, "object": "stream", "deleted": True})

    def close(self) -> None:
        """Abort every held stream (after the server has drained)."""
        self.streams.close()

    async def _beam(self, parsed: ParsedRequest) -> tuple[bytes, dict[str, Any] | None]:
        """A beam search (proxy.beam): one-token requests through the fleet, each prompt's
        own search, its beams the choices, as vLLM 0.32's server answers it: a stream's
        whole SSE body (each beam's text at once, as vLLM streams a chat's), or the
        response (None, b"" the other)."""
        gen, params = parsed.gen, parsed.beam
        assert params is not None
        card = parsed.card
        eos = card.tokenizer.token_to_id(card.special_tokens.get("eos_token") or "")

        async def step(tokens: list[int]) -> TokenBatch:
            req = dataclasses.replace(
                gen,
                request_id=f"{gen.request_id}-beam-{secrets.token_hex(6)}",
                prompt_token_ids=tokens,
                sampling=params.sampling(),
                stop=(),
                stream=False,
                include_usage=False,
                migratable=False,
                context=b"",
            )
            return merged([b async for b in self.backend.generate(req)])

        prompts = parsed.batch
        found = await asyncio.gather(
            *(
                beam.search(p, params.within(card.max_model_len - len(p)), eos, step)
                for p in prompts
            )
        )
        # As the relay writes a response, with vLLM's beam texts (each beam decoded
        # alone, its end token left out) and no stop strings or logprobs.
        shown = dataclasses.replace(
            parsed,
            gen=dataclasses.replace(gen, stop=()),
            text=dataclasses.replace(
                parsed.text, min_tokens=0, logprobs=None, prompt_logprobs=None
            ),
        )
        relay = Relay(shown)
        streamed, texts = b"", []
        for p, beams in enumerate(found):
            for i, b in enumerate(beams):
                index, tokens = p * params.width + i, beam.generated(b, len(prompts[p]))
                streamed += relay.feed(TokenBatch(tokens, index=index))
                finish = TokenBatch([], b.finish_reason or "length", b.stop_reason, index=index)  # type: ignore[arg-type]
                streamed += relay.feed(finish)
                text_ids = (
                    tokens[:-1]
                    if tokens and tokens[-1] == eos and not params.ignore_eos
                    else tokens
                )
                skip = parsed.text.skip_special_tokens
                texts.append(card.tokenizer.decode(text_ids, skip_special_tokens=skip))
        log.info("request_finished", request_id=gen.request_id, beam_width=params.width)
        if gen.stream:
            return streamed + relay.end(), None
        out = relay.response()
        for choice, text in zip(out["choices"], texts, strict=True):
            if "message" in choice:
                choice["message"]["content"] = text
            else:
                choice["text"] = text
        return b"", out

    def _open(self, parsed: ParsedRequest) -> AsyncIterator[TokenBatch]:
        """The backend's stream for the request: one upstream request per choice."""
        reqs = children(parsed)
        if len(reqs) == 1:
            return self.backend.generate(reqs[0])
        return FanIn([self.backend.generate(r) for r in reqs])

    async def _collect(
        self, relay: Relay, stream: AsyncIterator[TokenBatch], timing: _Timing
    ) -> None:
        async for batch in stream:
            timing.batch(batch)
            relay.feed(batch)
            if relay.cut:
                break  # a stop string matched: closing the stream aborts upstream
            await drop_if_cut(relay, stream, batch)

    async def _relay(
        self, relay: Relay, stream: AsyncIterator[TokenBatch], first: TokenBatch, timing: _Timing
    ) -> AsyncIterator[bytes]:
        """The SSE body: one chunk per batch, then usage and [DONE]."""
        outcome, error = "cancelled", None
        try:
            yield b""
            batch: TokenBatch | None = first
            while batch is not None:
                timing.batch(batch)
                out = relay.feed(batch)
                if out:
                    yield out
                if relay.cut:
                    break  # a stop string matched: closing the stream aborts upstream
                await drop_if_cut(relay, stream, batch)
                batch = await anext(stream, None)
            outcome = "finished"
            yield relay.end()
        except BackendError as exc:
            outcome, error = "failed", exc.message
            yield relay.error_event(_http_error(exc, relay.req.request_id))
        except (RuntimeError, ValueError) as exc:
            outcome, error = "failed", str(exc)
            yield relay.error_event(_upstream_error(relay.req.request_id))
        except Exception as exc:
            # Headers are out: tell the client in-band, log the bug here, once.
            log.exception("relay_failed", request_id=relay.req.request_id)
            outcome, error = "failed", repr(exc)
            yield relay.error_event(internal_error(relay.req.request_id))
        finally:
            await _aclose(stream)
            self._done(relay, timing, outcome, error=error)

    def _done(self, relay: Relay, timing: _Timing, outcome: str, error: str | None = None) -> None:
        """The canonical line for one generation request (and the gauge)."""
        self.active -= 1
        self.metrics.active.dec()
        gen = relay.req
        fields: dict[str, Any] = {
            "request_id": gen.request_id,
            "kind": gen.kind,
            "stream": gen.stream,
            "prompt_tokens": relay.prompt_tokens,
            "choices": len(relay.choices),
            "completion_tokens": relay.completion_tokens,
            "finish_reason": [c.finish_reason for c in relay.choices],
            "migratable": gen.migratable,
            "duration_ms": round((time.monotonic() - gen.arrival_s) * 1000, 2),
        }
        if timing.first:
            fields["ttft_ms"] = round((timing.first - gen.arrival_s) * 1000, 2)
        if error is not None:
            log.warning("request_" + outcome, error=error, **fields)
        else:
            log.info("request_" + outcome, **fields)


def _adopted(
    request_id: str,
    founds: Sequence[Found | None],
    since: resume.Positions,
    models: Mapping[str, ModelCard],
) -> tuple[ParsedRequest, int, list[tuple[TokenBatch | None, int]]]:
    """The request whose choices' workers answered ``founds`` (in choice order; None:
    no worker holds that choice), its ``created``, and each choice's first batch (None
    for one no worker holds: it runs again) with the index of its first token with
    logprobs; HttpError if they do not make the stream a client at ``since`` resumes."""
    context = next(f for f in founds if f is not None).attached.context
    prompts, n = resume.fan_of(context)
    resume.check_choices(request_id, len(since), prompts * n)
    known = {k // n: f.attached.prompt_token_ids for k, f in enumerate(founds) if f is not None}
    batch = resume.prompts_of(request_id, context, known)
    parsed, created = resume.request_of(context, batch, models)
    firsts: list[tuple[TokenBatch | None, int]] = []
    for k, (found, at) in enumerate(zip(founds, since, strict=True)):
        if found is None:
            resume.check_unstarted(request_id, at, k)
            firsts.append((None, 0))
            continue
        first, known_from = resume.adopted_batch(found.attached, parsed.text.logprobs)
        resume.check_position(request_id, known_from, at, k)
        first.index = k
        if parsed.text.prompt_logprobs is not None:  # echo with logprobs
            real = prompt_logprobs_of(found.attached.context) or found.attached.prompt or None
            prompt = found.attached.prompt_token_ids
            first.prompt = real or resume.prompt_stand_in(request_id, prompt, at, k)
        firsts.append((first, known_from))
    return parsed, created, firsts


@runtime_checkable
class Adopter(Protocol):
    """A backend that can take over a stream another proxy ran (:class:`proxy.cluster.ClusterBackend`)."""

    async def attach_stream(self, request_id: str) -> Found | None: ...

    def serve_attached(self, req: GenerationRequest, found: Found) -> AsyncIterator[TokenBatch]: ...


async def _one(chunk: bytes) -> AsyncIterator[bytes]:
    yield chunk


def _method(request: Request, allowed: str) -> None:
    if request.method != allowed:
        raise HttpError(
            405,
            f"method {request.method} not allowed on {request.path}",
            code="method_not_allowed",
            headers=[("allow", allowed)],
        )


def _http_error(exc: BackendError, request_id: str) -> HttpError:
    """What the client sees of a backend failure (the request's log line has the rest)."""
    if exc.status < 500:
        message = exc.message if exc.public is None else exc.public
    elif exc.status == 503:
        message = (
            f"no inference instance can take the request now, retry later (request id {request_id})"
        )
    else:
        message = f"the inference backend failed the request (request id {request_id})"
    return HttpError(exc.status, message, type=exc.error_type, code=exc.code)


def _upstream_error(request_id: str) -> HttpError:
    return HttpError(
        502,
        f"the inference backend failed the request (request id {request_id})",
        code="upstream_error",
    )


async def _aclose(stream: AsyncIterator[Any]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


def _with_parsers(card: ModelCard, settings: ProxySettings) -> ModelCard:
    """``card`` with the proxy's reasoning and tool-call parsers (checked: they must load)."""
    if settings.reasoning_parser or settings.tool_call_parser or settings.enable_auto_tool_choice:
        card = dataclasses.replace(
            card,
            reasoning_parser=settings.reasoning_parser,
            tool_call_parser=settings.tool_call_parser,
            enable_auto_tool_choice=settings.enable_auto_tool_choice,
        )
    chat_tools.check(card)
    return card


def create_server(app: ProxyApp, settings: ProxySettings, **kwargs: Any) -> HttpServer:
    """An :class:`HttpServer` running ``app``; health and metrics skip the stream limit."""
    return HttpServer(
        app,
        settings,
        exempt_paths=("/health", "/metrics"),
        head_check=app.check_head,
        observer=app.metrics.observe_response,
        **kwargs,
    )


def wants_event_ids(request: Request) -> bool:
    """Whether a stream's events carry SSE ``id:`` lines: the client asked for
    ``text/event-stream`` (as EventSource does, or ``curl -H 'Accept:
    text/event-stream'``) or sent a ``Last-Event-ID``. Not by default: vLLM's
    ``vllm bench serve`` client, like other line parsers of OpenAI streams,
    takes every event for ``data: <json>`` and fails on an ``id:`` line."""
    accept = (request.header("accept") or "").lower()
    return "text/event-stream" in accept or request.header("last-event-id") is not None


def merged(batches: list[TokenBatch]) -> TokenBatch:
    """One request's batches as one (a beam search step's token and its logprobs)."""
    out = TokenBatch([], logprobs=[], top_ids=[], top_logprobs=[])
    for b in batches:
        out.token_ids += b.token_ids
        out.logprobs += b.logprobs or []  # type: ignore[operator]
        out.top_ids += b.top_ids or []  # type: ignore[operator]
        out.top_logprobs += b.top_logprobs or []  # type: ignore[operator]
        out.finish_reason, out.stop_reason = b.finish_reason, b.stop_reason
    return out
