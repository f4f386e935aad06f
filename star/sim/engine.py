"""The discrete-event cluster simulator (paper §6.3, "Simulation on large scale").

:class:`Simulator` models Poisson or traced arrivals, FIFO prefill, P->D
dispatch and KV transfer, continuous batching with vLLM-style preemption,
and migrations that pause a request between source and target. It runs the
live code's decisions: every tick calls :func:`star.planner.core.decide`
and every dispatch the proxies' :func:`star.planner.dispatch.choose_on_view`
(``predicted``: :func:`~star.planner.dispatch.choose_decode`); a move in
flight is booked by :mod:`star.planner.flight`. Instance events are
scheduled at the exact iteration boundary (:mod:`star.sim.decode`), and
the planner is skipped on ticks its own classification would leave idle
(``SimConfig.gate``). The model, its defaults and speed: docs/simulator.md.
"""

from __future__ import annotations

import heapq
import math
import time
from array import array
from collections.abc import Callable
from functools import lru_cache

import numpy as np
import numpy.typing as npt

from star.planner import Instance, ModeKind, Request
from star.planner.core import decide
from star.planner.dispatch import OutputMean, booking, choose_decode, choose_on_view
from star.planner.trace import grid, weights
from star.sim.config import SimConfig
from star.sim.decode import duration, steps_until
from star.sim.events import EventQueue, Kind
from star.sim.metrics import RequestLog, Series, SimResult, summarise
from star.sim.predictor import NoiseState, PriorMedian, noisy_estimate
from star.sim.snapshot import Snapshot
from star.sim.state import FleetState, RequestState
from star.sim.workload import Workload, poisson_arrivals, synthetic

FloatArray = npt.NDArray[np.float64]

# Relative slack of the planner gate: call the planner even when the nearest
# instance is this close below the overload bound (rounding differences).
_GATE_SLACK = 1e-6

_add = np.add.reduce

# Event kinds as plain ints, the heap's second key.
_WAKE, _MIGRATED, _JOIN, _PREFILLED, _ARRIVAL, _TICK = (int(k) for k in Kind)


@lru_cache(maxsize=4)
def _prior(name: str, max_output: int) -> PriorMedian:
    # The predictor's uninformed answer is learnt from the dataset, not the run:
    # a fixed large sample of the same synthetic distribution.
    return PriorMedian(synthetic(name, 200_000, np.random.default_rng(0)).output_tokens, max_output)


class Simulator:
    """One run of the cluster for a :class:`SimConfig` (and optionally a file workload).

    ``Simulator(config).run()`` returns a :class:`SimResult`; the instance is
    single-use. Its state is :attr:`fleet` (per decode instance) and
    :attr:`requests` (per request), :mod:`star.sim.state`.
    """

    def __init__(self, config: SimConfig, workload: Workload | None = None) -> None:
        self.cfg = config
        self.params = config.planner_params()
        self.mode = self.params.mode
        seeds = np.random.SeedSequence(config.seed).spawn(3)
        lengths_rng, arrivals_rng, noise_rng = (np.random.default_rng(s) for s in seeds)
        self.requests = RequestState.new(*self._draw_requests(workload, lengths_rng, arrivals_rng))
        self.noise = NoiseState(self.requests.size, noise_rng)
        if workload is not None:
            self.prior = PriorMedian(workload.output_tokens, config.max_output_tokens)
        else:
            self.prior = _prior(config.workload, config.max_output_tokens)

        # Step-time model; predictions are amortised over the k steps they cover.
        self.step_base_s = config.step_base_s + (
            config.predict_latency_s / config.predict_every if config.uses_predictor else 0.0
        )
        self.step_per_token_s = config.step_per_token_s
        self.capacity = config.kv_capacity_tokens
        self.waste = config.block_waste_tokens
        self.recompute_s_per_token = config.prefill_per_token_s
        self.bytes_per_token = config.bytes_per_token
        self.bandwidth = config.bandwidth_bytes_per_s
        self.fleet = FleetState.empty(
            config.decode_instances, config.kv_capacity_tokens, config.bytes_per_token
        )
        # Prefill instances as a heap of (free at, index): O(log P) per arrival.
        self.prefill_free = [(0.0, p) for p in range(config.prefills)]

        self.events = EventQueue()
        self.series = Series()
        self.migration_times: list[float] = []
        self.preemption_times: list[float] = []
        self.tokens_generated = 0
        self.rejected = 0
        self.planner_calls = 0
        self.ticks = 0
        self.round_robin = 0  # dispatches so far (round-robin's cursor)
        self.open = 0  # arrived, not finished, not rejected
        self.completions = 0  # finish events (each request exactly once)
        self.view: list[Instance] = []
        self.view_load: FloatArray | None = None
        # current-load dispatch: output lengths finished (what cfg.dispatch_charge
        # "expected" books), their mean as of the last view, and the herd: new
        # requests per instance since the last view, and per view the most one took.
        self.outputs = OutputMean()
        self.view_mean_output = 0.0
        self.view_hits = np.zeros(config.decode_instances, dtype=np.int64)
        self.herd: list[int] = []
        self.beta = weights(self.params)
        self.tau = grid(self.params)

    # -- setup ---------------------------------------------------------------

    def _draw_requests(
        self,
        workload: Workload | None,
        lengths_rng: np.random.Generator,
        arrivals_rng: np.random.Generator,
    ) -> tuple[FloatArray, npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Arrival times, prompt and output lengths of every request of the run."""
        cfg = self.cfg
        if workload is not None and workload.arrival_s is not None:
            keep = workload.arrival_s < cfg.duration_s
            return (
                workload.arrival_s[keep].astype(np.float64),
                workload.prompt_tokens[keep].astype(np.int64),
                workload.output_tokens[keep].astype(np.int64),
            )
        arrival = poisson_arrivals(cfg.rate, cfg.duration_s, arrivals_rng)
        n = arrival.size
        if workload is None:
            drawn = synthetic(cfg.workload, max(n, 1), lengths_rng)
            return arrival, drawn.prompt_tokens[:n], drawn.output_tokens[:n]
        pick = lengths_rng.integers(0, len(workload), n)
        return (
            arrival,
            workload.prompt_tokens[pick].astype(np.int64),
            workload.output_tokens[pick].astype(np.int64),
        )

    # -- the run ---------------------------------------------------------------

    def run(self, progress: Callable[[float], None] | None = None) -> SimResult:
        """Simulate until ``duration_s`` (or until drained) and summarise."""
        from star.sim.kernels import warm  # numba: imported by runs, not by the CLI

        warm()  # compiled or loaded from disk before the clock starts
        wall = time.perf_counter()
        cpu = time.process_time()
        cfg = self.cfg
        end = cfg.duration_s
        if self.requests.size:
            self.events.push(float(self.requests.arrival[0]), _ARRIVAL, 0)
        self.events.push(0.0, _TICK)
        handlers = [
            self._on_wake,
            self._on_migrated,
            self._on_join,
            self._on_prefilled,
            self._on_arrival,
            self._on_tick,
        ]
        assert [int(k) for k in Kind] == list(range(len(handlers)))
        reported = 0.0
        heap = self.events.heap
        version = self.fleet.version
        pop = heapq.heappop
        drain = cfg.drain
        while heap:
            now, kind, _, a, b = pop(heap)
            if now > end and not drain:
                break
            if kind == _WAKE and b != version[a]:
                continue  # the instance changed since: a later WAKE replaces this one
            handlers[kind](now, a, b)
            if progress is not None and kind == _TICK and now - reported >= 10.0:
                progress(min(now, end) - reported)
                reported = min(now, end)
        if progress is not None and reported < end:
            progress(end - reported)
        return self._result(time.perf_counter() - wall, time.process_time() - cpu)

    # -- decode instance mechanics ------------------------------------------------

    def _advance(self, i: int, m: int) -> None:
        """Run ``m`` iterations of instance i's current batch and retire finished requests."""
        if m <= 0:
            return
        f = self.fleet
        k = f.batch[i]
        s = f.steps[i]
        load = f.tokens_base_sum[i] + k * s
        # duration(m, ...), written out (m > 0): the hottest line of the engine.
        f.at[i] += (
            f.extra_s[i]
            + m * self.step_base_s
            + self.step_per_token_s * (m * load + k * m * (m - 1) / 2.0)
        )
        f.extra_s[i] = 0.0
        s += m
        f.steps[i] = s
        self.tokens_generated += k * m
        if s < f.first_finish[i]:
            return
        now = f.at[i]
        req = self.requests
        finish_step = req.finish_step
        tokens_base = req.tokens_base
        keep: list[int] = []
        retired = 0
        for r in f.running[i]:
            if finish_step[r] <= s:
                req.finish[r] = now
                self.outputs.add(int(req.output[r]))
                retired += 1
                f.tokens_base_sum[i] -= int(tokens_base[r])
                req.instance[r] = -1
            else:
                keep.append(r)
        self.open -= retired
        self.completions += retired
        f.running[i] = array("q", keep)
        f.batch[i] = len(keep)
        f.first_finish[i] = min([finish_step[r] for r in keep]) if keep else 0

    def _sync(self, i: int, now: float) -> None:
        """Bring instance i to its first iteration boundary at or after ``now``."""
        f = self.fleet
        k = f.batch[i]
        if k == 0:
            if f.at[i] < now:
                f.at[i] = now
            return
        elapsed = now - f.at[i]
        if elapsed <= 0.0:
            return  # at a boundary at or after now already (steps_until: 0)
        load = f.tokens_base_sum[i] + k * f.steps[i]
        m = steps_until(
            elapsed,
            load,
            k,
            self.step_base_s,
            self.step_per_token_s,
            f.extra_s[i],
            f.steps_to_event[i],
        )
        self._advance(i, m)

    def _admit(self, i: int, r: int) -> None:
        f = self.fleet
        req = self.requests
        s = f.steps[i]
        tb = req.held_tokens[r] - s
        gb = req.held_generated[r] - s
        req.tokens_base[r] = tb
        req.generated_base[r] = gb
        fin = int(req.output[r]) - gb
        req.finish_step[r] = fin
        k = f.batch[i]
        if k == 0 or fin < f.first_finish[i]:
            f.first_finish[i] = fin
        f.running[i].append(r)
        f.tokens_base_sum[i] += tb
        f.batch[i] = k + 1
        req.instance[r] = i

    def _settle(self, i: int) -> None:
        """After a change at instance i's boundary: preempt, admit, schedule its next event."""
        f = self.fleet
        req = self.requests
        cap = self.capacity
        s = f.steps[i]
        load = f.tokens_base_sum[i] + f.batch[i] * s
        reserved = f.reserved[i]
        per = 1 + self.waste  # per running request: the next token, and its last block's rest
        # Room for one more token per running request, else preempt the newest.
        while f.batch[i] > 0 and load + reserved + f.batch[i] * per > cap:
            r = f.running[i].pop()
            tokens = int(req.tokens_base[r]) + s
            req.held_tokens[r] = tokens
            req.held_generated[r] = int(req.generated_base[r]) + s
            f.tokens_base_sum[i] -= int(req.tokens_base[r])
            f.batch[i] -= 1
            load -= tokens
            req.recompute[r] = True
            f.waiting[i].appendleft(r)
            req.preemptions[r] += 1
            self.preemption_times.append(f.at[i])
            if f.batch[i]:
                f.first_finish[i] = min(req.finish_step[x] for x in f.running[i])
        waiting = f.waiting[i]
        while waiting:
            r = waiting[0]
            need = req.held_tokens[r]
            if load + reserved + need + (f.batch[i] + 1) * per > cap:
                break
            waiting.popleft()
            self._admit(i, r)
            load += need
            if req.recompute[r]:
                req.recompute[r] = False
                f.extra_s[i] += need * self.recompute_s_per_token
        version = f.version[i] + 1
        f.version[i] = version
        k = f.batch[i]
        if k == 0:
            f.steps_to_event[i] = 0
            return
        m = min(f.first_finish[i] - s, (cap - reserved - load - k * self.waste) // k)
        f.steps_to_event[i] = m
        at = f.at[i] + duration(m, load, k, self.step_base_s, self.step_per_token_s, f.extra_s[i])
        self.events.push(at, _WAKE, i, version)

    # -- event handlers ------------------------------------------------------------

    def _on_wake(self, now: float, i: int, version: int) -> None:
        # Stale WAKEs (another version) are dropped by the run loop.
        self._advance(i, self.fleet.steps_to_event[i])
        self._settle(i)

    def _on_arrival(self, now: float, r: int, _: int) -> None:
        req = self.requests
        nxt = r + 1
        if nxt < req.size:
            self.events.push(float(req.arrival[nxt]), _ARRIVAL, nxt)
        prompt = int(req.prompt[r])
        # vLLM rejects what can never fit (max_model_len); with blocks a request also
        # holds its last block's rest, else alone on an instance it preempts itself forever.
        if prompt + int(req.output[r]) + 1 + self.waste > self.capacity:
            self.rejected += 1
            return
        self.open += 1
        free = self.prefill_free
        at, p = free[0]  # the first that frees up (ties: the lowest index)
        done = max(now, at) + self.cfg.prefill_base_s + self.cfg.prefill_per_token_s * prompt
        heapq.heapreplace(free, (done, p))
        self.events.push(done, _PREFILLED, r, p)

    def _on_prefilled(self, now: float, r: int, _: int) -> None:
        req = self.requests
        req.ttft_s[r] = now - float(req.arrival[r])
        self.tokens_generated += 1
        if int(req.output[r]) <= 1:
            req.finish[r] = now
            self.outputs.add(int(req.output[r]))
            self.open -= 1
            self.completions += 1
            return
        prompt = int(req.prompt[r])
        i = self._dispatch(r, now)
        req.instance[r] = i
        req.held_tokens[r] = prompt + 1
        req.held_generated[r] = 1
        transfer = (prompt + 1) * self.bytes_per_token / self.bandwidth + self.cfg.handoff_latency_s
        self.events.push(now + transfer, _JOIN, r, i)

    def _on_join(self, now: float, r: int, i: int) -> None:
        self._sync(i, now)
        self.fleet.waiting[i].append(r)
        self._settle(i)

    def _on_migrated(self, now: float, r: int, src: int) -> None:
        f = self.fleet
        req = self.requests
        dst = req.instance[r]
        tokens = req.held_tokens[r]
        self._sync(src, now)
        f.reserved[src] -= tokens
        self._settle(src)
        self._sync(dst, now)
        f.reserved[dst] -= tokens
        f.incoming[dst].remove(r)
        req.source[r] = -1
        req.migrations[r] += 1
        # Its KV is already allocated on dst: it joins the batch directly.
        self._admit(dst, r)
        self._settle(dst)

    def _migrate(self, r: int, src: int, dst: int, remaining: float, now: float) -> bool:
        """Start moving request r from src to dst; False if it is no longer there.

        ``remaining`` is the R-hat the planner decided with; the request is
        booked on dst with it until it arrives.
        """
        f = self.fleet
        req = self.requests
        self._sync(src, now)
        running = f.running[src]
        if r not in running:
            self._settle(src)  # it finished at that boundary
            return False
        running.remove(r)
        s = f.steps[src]
        tokens = int(req.tokens_base[r]) + s
        req.held_tokens[r] = tokens
        req.held_generated[r] = int(req.generated_base[r]) + s
        f.tokens_base_sum[src] -= int(req.tokens_base[r])
        f.batch[src] -= 1
        if f.batch[src]:
            finish_step = req.finish_step
            f.first_finish[src] = min([finish_step[x] for x in running])
        f.reserved[src] += tokens
        start = f.at[src]
        self._settle(src)
        self._sync(dst, now)
        f.reserved[dst] += tokens
        f.incoming[dst].append(r)
        req.source[r] = src
        req.held_prediction[r] = remaining if math.isfinite(remaining) else None
        req.instance[r] = dst
        self._settle(dst)
        took = tokens * self.bytes_per_token / self.bandwidth + self.cfg.move_latency_s
        self.events.push(max(start, now) + took, _MIGRATED, r, src)
        self.migration_times.append(now)
        return True

    # -- the scheduler tick -----------------------------------------------------------

    def _on_tick(self, now: float, _a: int, _b: int) -> None:
        self.ticks += 1
        snap = Snapshot(self, now)
        self._sample(now, snap)
        if self.mode.kind is not ModeKind.NO_MIGRATION:
            traces = snap.traces
            if self._worth_planning(traces, snap.in_flight):
                self.planner_calls += 1
                given = self.mode.kind is ModeKind.PREDICTED
                arrays, rows = snap.arrays(with_traces=given)
                moves = decide(arrays, self.params)
                if moves.rows.size:
                    # The published view has the moves booked: the tokens in flight
                    # before them plus each move's (whole numbers: exact in any order).
                    booked = snap.booked.copy()
                    held = self.requests.held_tokens
                    for q, src, dst, rem in zip(
                        rows[moves.rows].tolist(),
                        moves.sources.tolist(),
                        moves.targets.tolist(),
                        moves.remaining.tolist(),
                        strict=True,
                    ):
                        if self._migrate(q, src, dst, rem, now):
                            booked[dst] += held[q]
                    snap = Snapshot(self, now)
                    snap.booked = booked
        self._refresh_view(snap)
        nxt = now + self.cfg.tick_s
        if nxt <= self.cfg.duration_s or (self.cfg.drain and self.open > 0):
            self.events.push(nxt, _TICK)

    def _sample(self, now: float, snap: Snapshot) -> None:
        loads = snap.loads
        step_ms = (self.step_base_s + self.step_per_token_s * loads) * 1e3
        used = (loads + self.fleet.views["reserved"] + snap.batch * self.waste) / self.capacity
        s = self.series
        s.t.append(now)
        # step_ms.var(), spelt out as numpy computes it (without its wrappers).
        dev = step_ms - _add(step_ms) / step_ms.size
        s.exec_var_ms2.append(float(_add(dev * dev) / step_ms.size))
        s.kv_max.append(float(used.max()))
        s.kv_mean.append(float(used.sum()) / used.size)  # = used.mean(), without its wrapper
        s.running.append(int(snap.batch.sum()))
        s.waiting.append(sum(map(len, self.fleet.waiting)))

    def _worth_planning(self, traces: FloatArray, in_flight: npt.NDArray[np.bool_]) -> bool:
        """Whether Algorithm 1 could find an overloaded source and a target now.

        The planner's first step (line 6: "if O is not empty") on the same
        traces: it is skipped when no instance outside a migration is
        overloaded or none could receive.
        """
        if not self.cfg.gate:
            return True
        work = traces @ self.beta
        bound = (1.0 + self.params.theta) * (float(work.sum()) / work.size)  # = work.mean()
        free = ~in_flight
        over = work > bound * (1.0 - _GATE_SLACK)
        under = traces[:, 0] < bound * (1.0 + _GATE_SLACK)
        return bool((over & free).any()) and bool((under & free).any())

    # -- P->D dispatch --------------------------------------------------------------

    def _refresh_view(self, snap: Snapshot) -> None:
        """The load view the scheduler publishes each tick (``star:load``).

        ``current-load`` reads one number per instance, its token load (the
        view's ``tokens``, in-flight moves booked on the target), kept here as
        an array; ``predicted`` needs every request's R-hat, so its view is
        the planner's full input. Both grow with what the proxy dispatched
        since, until the next tick replaces them.
        """
        if self.cfg.dispatch == "predicted":
            self.view = snap.instances()
        else:
            self.view_load = snap.loads + snap.booked
            self.herd.append(int(self.view_hits.max()))
            self.view_hits[:] = 0
            self.view_mean_output = self.outputs.mean

    def _dispatch(self, r: int, now: float) -> int:
        """P->D dispatch on the current load view: ``round-robin`` and
        ``current-load`` by :func:`choose_on_view`, the proxies' rule;
        ``predicted`` by :func:`choose_decode` on the planner's full input."""
        policy = self.cfg.dispatch
        req = self.requests
        fleet = self.fleet
        tokens = int(req.prompt[r]) + 1
        if policy == "round-robin":  # loads are not read
            idle = np.zeros(len(fleet.ids))
            i = choose_on_view(policy, idle, fleet.capacity, tokens, self.round_robin)
            self.round_robin += 1
            return i
        if policy == "current-load":
            if self.view_load is None:
                self._refresh_view(Snapshot(self, now))
            load = self.view_load
            assert load is not None
            i = choose_on_view(policy, load, fleet.capacity, tokens, self.round_robin)
            load[i] += booking(tokens, self.cfg.dispatch_charge, self.view_mean_output)
            self.view_hits[i] += 1
            return i
        if not self.view:
            self._refresh_view(Snapshot(self, now))
        predicted = self._first_prediction(r)
        chosen = choose_decode(policy, self.view, tokens, predicted, self.params, self.round_robin)
        i = fleet.index[chosen]
        inst = self.view[i]
        added = Request(req.ids[r], tokens, predicted, int(req.output[r]) - 1, 1)
        self.view[i] = Instance(
            inst.id,
            (*inst.requests, added),
            inst.capacity_tokens,
            inst.bytes_per_token,
            inst.step_time_s,
            inst.in_flight,
            inst.busy,
        )
        return i

    def _first_prediction(self, r: int) -> float:
        """R-hat from the prompt alone (the prefill instance's prediction, g = 0)."""
        total = float(self.requests.output[r])
        if self.cfg.predictor == "oracle":
            return total - 1.0
        idx = np.array([r], dtype=np.int64)
        z = self.noise.advance(idx, np.zeros(1, dtype=np.int64))
        est = noisy_estimate([total], [0], z, self.prior, self.cfg.max_output_tokens)
        return max(1.0, float(est[0]) - 1.0)

    # -- results ----------------------------------------------------------------------

    def _result(self, wall_s: float, cpu_s: float) -> SimResult:
        cfg = self.cfg
        req = self.requests
        f = self.fleet
        generated = np.zeros(req.size, dtype=np.int64)
        for r in range(req.size):
            i = req.instance[r]
            if np.isfinite(req.finish[r]):
                generated[r] = req.output[r]
            elif np.isnan(req.ttft_s[r]):
                generated[r] = 0
            elif i >= 0 and r in f.running[i]:
                generated[r] = int(req.generated_base[r]) + f.steps[i]
            else:
                generated[r] = req.held_generated[r]
        log = RequestLog(
            arrival=req.arrival,
            prompt=req.prompt,
            output=req.output,
            ttft_s=req.ttft_s,
            finish=req.finish,
            preemptions=req.preemptions,
            migrations=req.migrations,
            generated=generated,
        )
        series = self.series.arrays()
        row: dict[str, object] = {
            "mode": cfg.mode,
            "instances": cfg.decode_instances,
            "seed": cfg.seed,
        }
        summary = summarise(
            log,
            series,
            duration_s=cfg.duration_s,
            warmup_s=cfg.warmup_s,
            ttft_slo_s=cfg.ttft_slo_s,
            tpot_slo_s=cfg.tpot_slo_s,
        )
        row.update(summary)
        migrations = int(req.migrations.sum())
        row.update(
            {
                "preemptions": len(self.preemption_times),
                # Preemptions of requests that had been moved: the newest
                # admitted request is preempted first, so a move into a
                # target that then fills shows up here (a lower bound).
                "preemptions_of_moved": int(req.preemptions[req.migrations > 0].sum()),
                "migrations": migrations,
                "migrations_per_finished": migrations / max(1, int(summary["finished"])),
                "sim_seconds": cfg.duration_s,
                "wall_seconds": wall_s,
                "cpu_seconds": cpu_s,
                "arrived": int(req.size),
                "rejected": self.rejected,
                "planner_calls": self.planner_calls,
                "ticks": self.ticks,
                "dispatch": cfg.dispatch,
                "dispatch_charge": cfg.dispatch_charge,
                # the most new requests one instance took between two views:
                # mean over views, and the largest
                "herd_mean": float(np.mean(self.herd)) if self.herd else 0.0,
                "herd_max": max(self.herd, default=0),
                "rate_rps": cfg.rate,
                "prefill_instances": cfg.prefills,
            }
        )
        return SimResult(
            row=row,
            series=series,
            migration_times=np.asarray(self.migration_times, dtype=np.float64),
            preemption_times=np.asarray(self.preemption_times, dtype=np.float64),
            requests=log,
        )


def simulate(
    config: SimConfig,
    workload: Workload | None = None,
    progress: Callable[[float], None] | None = None,
) -> SimResult:
    """Run one simulation (see :class:`Simulator`)."""
    return Simulator(config, workload).run(progress)
