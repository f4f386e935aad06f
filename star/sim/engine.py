"""The discrete-event cluster simulator (paper §6.3, "Simulation on large scale").

Paper §6.3: "we use event-driven simulation to model request arrivals, decode
execution, and migration events. The execution time of each decode iteration
is derived from real system measurements, while the migration overhead is
calculated based on KV cache size and network bandwidth." And: "The simulator
follows the same scheduling and migration logic as the real system" -- here
literally: every tick calls :func:`star.planner.plan` and every P->D dispatch
calls :func:`star.planner.dispatch.choose_decode`, the functions the live
scheduler runs.

What is modelled, per request: Poisson (or traced) arrival; FIFO prefill on
the prefill instance that frees up first, ``p0 + p1 x prompt`` seconds, which
emits the first token; P->D dispatch by the configured policy on the load
view the scheduler published at its last tick plus what was dispatched since
(the proxy reads ``star:load``, DESIGN §4); a KV transfer of
``(prompt + 1) x bytes/token / bandwidth + latency``; then continuous
batching on the decode instance until the last token.

A decode instance iterates back to back while it has running requests; one
iteration takes ``a + b x tokens in the batch`` (:mod:`star.sim.decode`).
Its KV holds the running requests' tokens plus KV held for migrations in
either direction, and must leave room for one more token per request before
each iteration. When it would not, the newest running request is preempted
(vLLM: ``self.running.pop()``, freed, put at the front of the waiting queue)
and later readmitted, paying a recompute of all its tokens at prefill speed
on the first iteration after readmission. Waiting requests are admitted FIFO
when they fit.

Migration (paper §5.4): the request leaves the source's batch at the next
iteration boundary, its KV stays held on the source and is allocated on the
target, and after ``tokens x bytes/token / bandwidth + latency`` it joins the
target's batch; it decodes on neither side meanwhile. Other requests keep
decoding ("the paused request's KV cache is transferred to the target
instance without blocking the execution of other requests"). Like the live
scheduler (``scheduler/view.py``), the planner sees a request in flight booked
on its target, busy, and both instances in flight.

Speed: between two state changes of an instance its batch is fixed, so the
number of iterations done by any time is a square root away; an instance
event (a request finishes, the KV fills up) is scheduled directly at the
iteration boundary where it happens. Per-tick work over all instances is
vectorised with numpy (:mod:`star.sim.snapshot`). The planner is called only
when its own classification, on the workers' traces computed with the
planner's trace math and weights, finds an overloaded instance that could
take part in a migration; ``SimConfig.gate=False`` calls it on every tick.
"""

from __future__ import annotations

import math
import time
from array import array
from collections import deque
from collections.abc import Callable
from functools import lru_cache

import numpy as np
import numpy.typing as npt

from star.planner import Instance, ModeKind, Request
from star.planner.arrays import plan_arrays
from star.planner.dispatch import choose_decode, least_loaded
from star.planner.trace import grid, weights
from star.sim.config import SimConfig
from star.sim.decode import duration, steps_until
from star.sim.events import EventQueue, Kind
from star.sim.metrics import RequestLog, Series, SimResult, summarise
from star.sim.predictor import NoiseState, PriorMedian, noisy_estimate
from star.sim.snapshot import Snapshot
from star.sim.workload import Workload, poisson_arrivals, synthetic

FloatArray = npt.NDArray[np.float64]

# Relative slack of the planner gate: call the planner even when the nearest
# instance is this close below the overload bound (rounding differences).
_GATE_SLACK = 1e-6


@lru_cache(maxsize=4)
def _prior(name: str, max_output: int) -> PriorMedian:
    # The predictor's uninformed answer is learnt from the dataset, not the run:
    # a fixed large sample of the same synthetic distribution.
    return PriorMedian(synthetic(name, 200_000, np.random.default_rng(0)).output_tokens, max_output)


class Simulator:
    """One run of the cluster for a :class:`SimConfig` (and optionally a file workload).

    ``Simulator(config).run()`` returns a :class:`SimResult`; the instance is
    single-use.
    """

    def __init__(self, config: SimConfig, workload: Workload | None = None) -> None:
        self.cfg = config
        self.params = config.planner_params()
        self.mode = self.params.mode
        seeds = np.random.SeedSequence(config.seed).spawn(3)
        lengths_rng, arrivals_rng, noise_rng = (np.random.default_rng(s) for s in seeds)
        self._build_requests(workload, lengths_rng, arrivals_rng)
        n_req = self.arrival.size
        self.noise = NoiseState(n_req, noise_rng)
        if workload is not None:
            self.prior = PriorMedian(workload.output_tokens, config.max_output_tokens)
        else:
            self.prior = _prior(config.workload, config.max_output_tokens)

        # Step-time model; predictions are amortised over the k steps they cover.
        self.a = config.step_base_s + (
            config.predict_latency_s / config.predict_every if config.uses_predictor else 0.0
        )
        self.b = config.step_per_token_s
        self.cap = config.kv_capacity_tokens
        self.recompute_s = config.prefill_per_token_s
        self.bpt = config.bytes_per_token
        self.bw = config.bandwidth_bytes_per_s
        self.cap_array = np.full(config.decode_instances, float(self.cap))
        self.bpt_array = np.full(config.decode_instances, float(self.bpt))
        self.all_instances = np.ones(config.decode_instances, dtype=np.bool_)

        # Per request. tbase/gbase: tokens and generated = base + instance step.
        self.ttft = np.full(n_req, np.nan)
        self.finish = np.full(n_req, np.nan)
        self.tbase = np.zeros(n_req, dtype=np.int64)
        self.gbase = np.zeros(n_req, dtype=np.int64)
        self.held = [0] * n_req  # tokens in KV while not in a batch
        self.gen_held = [0] * n_req  # generated tokens while not in a batch
        self.sfin = [0] * n_req  # instance step at which it finishes
        self.where = [-1] * n_req  # decode instance (target while migrating)
        self.recompute = [False] * n_req
        self.pred_held: list[float | None] = [None] * n_req  # R-hat booked while migrating
        self.n_preempt = np.zeros(n_req, dtype=np.int64)
        self.n_migrate = np.zeros(n_req, dtype=np.int64)
        self.ids = [str(i) for i in range(n_req)]

        # Per decode instance (Python lists: scalar access on the hot path).
        n = config.decode_instances
        self.n = n
        self.inst_ids = [f"d{i}" for i in range(n)]
        self.index = {iid: i for i, iid in enumerate(self.inst_ids)}
        # Typed arrays: fast scalar access in event handlers, and numpy views
        # of them (np.frombuffer, no copy) for the vectorised tick.
        self.S = array("q", bytes(8 * n))  # iterations done up to t0
        self.t0 = array("d", bytes(8 * n))  # time of the iteration boundary the state is at
        self.k = array("q", bytes(8 * n))  # running requests
        self.tbsum = array("q", bytes(8 * n))  # sum of tbase over running: L = tbsum + k * S
        self.reserved = array("q", bytes(8 * n))  # KV held for migrations in or out
        self.extra = array("d", bytes(8 * n))  # one-off cost of the next iteration (recompute)
        self.mnext = array("q", bytes(8 * n))  # iterations to the next internal event (0: idle)
        self.finmin = array("q", bytes(8 * n))  # smallest sfin over running
        self.version = array("q", bytes(8 * n))  # invalidates stale WAKE events
        self.inflight = array("q", bytes(8 * n))  # migrations this instance takes part in
        self.running: list[list[int]] = [[] for _ in range(n)]
        self.waiting: list[deque[int]] = [deque() for _ in range(n)]
        self.incoming: list[list[int]] = [[] for _ in range(n)]  # migrating in
        self.prefill_free = [0.0] * config.prefills

        self.q = EventQueue()
        self.series = Series()
        self.migration_times: list[float] = []
        self.preemption_times: list[float] = []
        self.tokens_generated = 0
        self.rejected = 0
        self.planner_calls = 0
        self.ticks = 0
        self.rr = 0
        self.open = 0  # arrived, not finished, not rejected
        self.completions = 0  # finish events (each request exactly once)
        self.view: list[Instance] = []
        self.view_load: FloatArray | None = None
        self.beta = weights(self.params)
        self.tau = grid(self.params)

    # -- setup ---------------------------------------------------------------

    def _build_requests(
        self,
        workload: Workload | None,
        lengths_rng: np.random.Generator,
        arrivals_rng: np.random.Generator,
    ) -> None:
        cfg = self.cfg
        if workload is not None and workload.arrival_s is not None:
            keep = workload.arrival_s < cfg.duration_s
            self.arrival = workload.arrival_s[keep].astype(np.float64)
            self.prompt = workload.prompt_tokens[keep].astype(np.int64)
            self.output = workload.output_tokens[keep].astype(np.int64)
            return
        self.arrival = poisson_arrivals(cfg.rate, cfg.duration_s, arrivals_rng)
        n = self.arrival.size
        if workload is None:
            drawn = synthetic(cfg.workload, max(n, 1), lengths_rng)
            self.prompt, self.output = drawn.prompt_tokens[:n], drawn.output_tokens[:n]
        else:
            pick = lengths_rng.integers(0, len(workload), n)
            self.prompt = workload.prompt_tokens[pick].astype(np.int64)
            self.output = workload.output_tokens[pick].astype(np.int64)

    # -- the run ---------------------------------------------------------------

    def run(self, progress: Callable[[float], None] | None = None) -> SimResult:
        """Simulate until ``duration_s`` (or until drained) and summarise."""
        from star.sim.kernels import warm  # numba: imported by runs, not by the CLI

        warm()  # compiled or loaded from disk before the clock starts
        wall = time.perf_counter()
        cpu = time.process_time()
        cfg = self.cfg
        end = cfg.duration_s
        if self.arrival.size:
            self.q.push(float(self.arrival[0]), Kind.ARRIVAL, 0)
        self.q.push(0.0, Kind.TICK)
        handlers = {
            Kind.WAKE: self._on_wake,
            Kind.MIGRATED: self._on_migrated,
            Kind.JOIN: self._on_join,
            Kind.PREFILLED: self._on_prefilled,
            Kind.ARRIVAL: self._on_arrival,
            Kind.TICK: self._on_tick,
        }
        reported = 0.0
        q = self.q
        while len(q):
            ev = q.pop()
            if ev.time > end and not cfg.drain:
                break
            handlers[ev.kind](ev.time, ev.a, ev.b)
            if progress is not None and ev.kind is Kind.TICK and ev.time - reported >= 10.0:
                progress(min(ev.time, end) - reported)
                reported = min(ev.time, end)
        if progress is not None and reported < end:
            progress(end - reported)
        return self._result(time.perf_counter() - wall, time.process_time() - cpu)

    # -- decode instance mechanics ------------------------------------------------

    def _advance(self, i: int, m: int) -> None:
        """Run ``m`` iterations of instance i's current batch and retire finished requests."""
        if m <= 0:
            return
        k = self.k[i]
        s = self.S[i]
        load = self.tbsum[i] + k * s
        self.t0[i] += duration(m, load, k, self.a, self.b, self.extra[i])
        self.extra[i] = 0.0
        s += m
        self.S[i] = s
        self.tokens_generated += k * m
        if s < self.finmin[i]:
            return
        now = self.t0[i]
        sfin = self.sfin
        keep: list[int] = []
        for r in self.running[i]:
            if sfin[r] <= s:
                self.finish[r] = now
                self.open -= 1
                self.completions += 1
                self.tbsum[i] -= int(self.tbase[r])
                self.where[r] = -1
            else:
                keep.append(r)
        self.running[i] = keep
        self.k[i] = len(keep)
        self.finmin[i] = min((sfin[r] for r in keep), default=0)

    def _sync(self, i: int, now: float) -> None:
        """Bring instance i to its first iteration boundary at or after ``now``."""
        k = self.k[i]
        if k == 0:
            if self.t0[i] < now:
                self.t0[i] = now
            return
        load = self.tbsum[i] + k * self.S[i]
        m = steps_until(now - self.t0[i], load, k, self.a, self.b, self.extra[i], self.mnext[i])
        self._advance(i, m)

    def _admit(self, i: int, r: int) -> None:
        s = self.S[i]
        tb = self.held[r] - s
        gb = self.gen_held[r] - s
        self.tbase[r] = tb
        self.gbase[r] = gb
        fin = int(self.output[r]) - gb
        self.sfin[r] = fin
        if self.k[i] == 0 or fin < self.finmin[i]:
            self.finmin[i] = fin
        self.running[i].append(r)
        self.tbsum[i] += tb
        self.k[i] += 1
        self.where[r] = i

    def _settle(self, i: int) -> None:
        """After a change at instance i's boundary: preempt, admit, schedule its next event."""
        cap = self.cap
        s = self.S[i]
        load = self.tbsum[i] + self.k[i] * s
        reserved = self.reserved[i]
        # Room for one more token per running request, else preempt the newest.
        while self.k[i] > 0 and load + reserved + self.k[i] > cap:
            r = self.running[i].pop()
            tokens = int(self.tbase[r]) + s
            self.held[r] = tokens
            self.gen_held[r] = int(self.gbase[r]) + s
            self.tbsum[i] -= int(self.tbase[r])
            self.k[i] -= 1
            load -= tokens
            self.recompute[r] = True
            self.waiting[i].appendleft(r)
            self.n_preempt[r] += 1
            self.preemption_times.append(self.t0[i])
            if self.k[i]:
                self.finmin[i] = min(self.sfin[x] for x in self.running[i])
        waiting = self.waiting[i]
        while waiting:
            r = waiting[0]
            need = self.held[r]
            if load + reserved + need + self.k[i] + 1 > cap:
                break
            waiting.popleft()
            self._admit(i, r)
            load += need
            if self.recompute[r]:
                self.recompute[r] = False
                self.extra[i] += need * self.recompute_s
        self.version[i] += 1
        k = self.k[i]
        if k == 0:
            self.mnext[i] = 0
            return
        m = min(self.finmin[i] - s, (cap - reserved - load) // k)
        self.mnext[i] = m
        at = self.t0[i] + duration(m, load, k, self.a, self.b, self.extra[i])
        self.q.push(at, Kind.WAKE, i, self.version[i])

    # -- event handlers ------------------------------------------------------------

    def _on_wake(self, now: float, i: int, version: int) -> None:
        if version != self.version[i]:
            return
        self._advance(i, self.mnext[i])
        self._settle(i)

    def _on_arrival(self, now: float, r: int, _: int) -> None:
        nxt = r + 1
        if nxt < self.arrival.size:
            self.q.push(float(self.arrival[nxt]), Kind.ARRIVAL, nxt)
        prompt = int(self.prompt[r])
        if prompt + int(self.output[r]) + 1 > self.cap:
            self.rejected += 1  # vLLM rejects what can never fit (max_model_len)
            return
        self.open += 1
        free = self.prefill_free
        p = min(range(len(free)), key=free.__getitem__)
        done = max(now, free[p]) + self.cfg.prefill_base_s + self.cfg.prefill_per_token_s * prompt
        free[p] = done
        self.q.push(done, Kind.PREFILLED, r, p)

    def _on_prefilled(self, now: float, r: int, _: int) -> None:
        self.ttft[r] = now - float(self.arrival[r])
        self.tokens_generated += 1
        if int(self.output[r]) <= 1:
            self.finish[r] = now
            self.open -= 1
            self.completions += 1
            return
        prompt = int(self.prompt[r])
        i = self._dispatch(r, now)
        self.where[r] = i
        self.held[r] = prompt + 1
        self.gen_held[r] = 1
        transfer = (prompt + 1) * self.bpt / self.bw + self.cfg.handoff_latency_s
        self.q.push(now + transfer, Kind.JOIN, r, i)

    def _on_join(self, now: float, r: int, i: int) -> None:
        self._sync(i, now)
        self.waiting[i].append(r)
        self._settle(i)

    def _on_migrated(self, now: float, r: int, src: int) -> None:
        dst = self.where[r]
        tokens = self.held[r]
        self._sync(src, now)
        self.reserved[src] -= tokens
        self.inflight[src] -= 1
        self._settle(src)
        self._sync(dst, now)
        self.reserved[dst] -= tokens
        self.inflight[dst] -= 1
        self.incoming[dst].remove(r)
        self.n_migrate[r] += 1
        # Its KV is already allocated on dst: it joins the batch directly.
        self._admit(dst, r)
        self._settle(dst)

    def _migrate(self, r: int, src: int, dst: int, remaining: float, now: float) -> bool:
        """Start moving request r from src to dst; False if it is no longer there.

        ``remaining`` is the R-hat the planner decided with; the request is
        booked on dst with it until it arrives.
        """
        self._sync(src, now)
        running = self.running[src]
        if r not in running:
            self._settle(src)  # it finished at that boundary
            return False
        running.remove(r)
        s = self.S[src]
        tokens = int(self.tbase[r]) + s
        self.held[r] = tokens
        self.gen_held[r] = int(self.gbase[r]) + s
        self.tbsum[src] -= int(self.tbase[r])
        self.k[src] -= 1
        if self.k[src]:
            self.finmin[src] = min(self.sfin[x] for x in running)
        self.reserved[src] += tokens
        self.inflight[src] += 1
        start = self.t0[src]
        self._settle(src)
        self._sync(dst, now)
        self.reserved[dst] += tokens
        self.inflight[dst] += 1
        self.incoming[dst].append(r)
        self.pred_held[r] = remaining if math.isfinite(remaining) else None
        self.where[r] = dst
        self._settle(dst)
        took = tokens * self.bpt / self.bw + self.cfg.handoff_latency_s
        self.q.push(max(start, now) + took, Kind.MIGRATED, r, src)
        self.migration_times.append(now)
        return True

    # -- the scheduler tick -----------------------------------------------------------

    def _on_tick(self, now: float, _a: int, _b: int) -> None:
        self.ticks += 1
        snap = Snapshot(self, now)
        self._sample(now, snap)
        if self.mode.kind is not ModeKind.NO_MIGRATION:
            traces = snap.traces
            if self._worth_planning(traces):
                self.planner_calls += 1
                given = self.mode.kind is ModeKind.PREDICTED
                arrays, rows = snap.arrays(with_traces=given)
                decided = plan_arrays(arrays, self.params)
                for q, src, dst, rem in zip(
                    decided.rows.tolist(),
                    decided.sources.tolist(),
                    decided.targets.tolist(),
                    decided.remaining.tolist(),
                    strict=True,
                ):
                    self._migrate(int(rows[q]), src, dst, rem, now)
                if decided.rows.size:  # the published view has the moves booked
                    snap = Snapshot(self, now)
        self._refresh_view(snap)
        nxt = now + self.cfg.tick_s
        if nxt <= self.cfg.duration_s or (self.cfg.drain and self.open > 0):
            self.q.push(nxt, Kind.TICK)

    def _sample(self, now: float, snap: Snapshot) -> None:
        loads = snap.loads
        step_ms = (self.a + self.b * loads) * 1e3
        used = (loads + np.frombuffer(self.reserved, dtype=np.int64)) / self.cap
        s = self.series
        s.t.append(now)
        s.exec_var_ms2.append(float(step_ms.var()))
        s.kv_max.append(float(used.max()))
        s.kv_mean.append(float(used.mean()))
        s.running.append(int(snap.batch.sum()))
        s.waiting.append(sum(map(len, self.waiting)))

    def _worth_planning(self, traces: FloatArray) -> bool:
        """Whether Algorithm 1 could find an overloaded source and a target now.

        The planner's first step (line 6: "if O is not empty") on the same
        traces: it is skipped when no instance outside a migration is
        overloaded or none could receive.
        """
        if not self.cfg.gate:
            return True
        work = traces @ self.beta
        bound = (1.0 + self.params.theta) * float(work.mean())
        free = np.frombuffer(self.inflight, dtype=np.int64) == 0
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

    def _dispatch(self, r: int, now: float) -> int:
        """P->D dispatch on the current load view (:func:`choose_decode`, or for
        ``current-load`` its array form :func:`least_loaded`)."""
        policy = self.cfg.dispatch
        prompt = int(self.prompt[r])
        tokens = prompt + 1
        if policy == "round-robin":
            if not self.view:  # loads are not read: one fixed list of instances
                self.view = [Instance(iid, (), self.cap, self.bpt) for iid in self.inst_ids]
            i = self.index[choose_decode(policy, self.view, tokens, None, self.params, self.rr)]
            self.rr += 1
            return i
        if policy == "current-load":
            if self.view_load is None:
                self._refresh_view(Snapshot(self, now))
            load = self.view_load
            assert load is not None
            i = least_loaded(load, self.cap_array, tokens)
            load[i] += tokens
            return i
        if not self.view:
            self._refresh_view(Snapshot(self, now))
        predicted = self._first_prediction(r)
        chosen = choose_decode(policy, self.view, tokens, predicted, self.params, self.rr)
        i = self.index[chosen]
        inst = self.view[i]
        added = Request(self.ids[r], tokens, predicted, int(self.output[r]) - 1, 1)
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
        total = float(self.output[r])
        if self.cfg.predictor == "oracle":
            return total - 1.0
        idx = np.array([r], dtype=np.int64)
        z = self.noise.advance(idx, np.zeros(1, dtype=np.int64))
        est = noisy_estimate([total], [0], z, self.prior, self.cfg.max_output_tokens)
        return max(1.0, float(est[0]) - 1.0)

    # -- results ----------------------------------------------------------------------

    def _result(self, wall_s: float, cpu_s: float) -> SimResult:
        cfg = self.cfg
        generated = np.zeros(self.arrival.size, dtype=np.int64)
        for r in range(self.arrival.size):
            if np.isfinite(self.finish[r]):
                generated[r] = self.output[r]
            elif np.isnan(self.ttft[r]):
                generated[r] = 0
            elif self.where[r] >= 0 and r in self.running[self.where[r]]:
                generated[r] = int(self.gbase[r]) + self.S[self.where[r]]
            else:
                generated[r] = self.gen_held[r]
        log = RequestLog(
            arrival=self.arrival,
            prompt=self.prompt,
            output=self.output,
            ttft_s=self.ttft,
            finish=self.finish,
            preemptions=self.n_preempt,
            migrations=self.n_migrate,
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
        migrations = int(self.n_migrate.sum())
        row.update(
            {
                "preemptions": len(self.preemption_times),
                "migrations": migrations,
                "migrations_per_finished": migrations / max(1, int(summary["finished"])),
                "sim_seconds": cfg.duration_s,
                "wall_seconds": wall_s,
                "cpu_seconds": cpu_s,
                "arrived": int(self.arrival.size),
                "rejected": self.rejected,
                "planner_calls": self.planner_calls,
                "ticks": self.ticks,
                "dispatch": cfg.dispatch,
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
