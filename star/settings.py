"""One settings root for every STAR process.

A frozen dataclass per area (redis, bus, scheduler, worker, proxy, predictor,
simulator, log), loaded once at start-up from, in increasing precedence:

1. the defaults below,
2. a TOML file (``--config PATH`` or ``$STAR_CONFIG``), one table per area,
3. ``STAR_<AREA>_<KEY>`` environment variables (``STAR_SCHEDULER_INTERVAL_S=0.5``),
4. command-line flags (``--set scheduler.interval_s=0.5`` or a command's own flags).

Everything is validated here, with errors that name the key, quote the bad value
and say where it came from; nothing deeper in the code reads the environment.
``Settings.sources`` remembers where each value came from (``star config show``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import SplitResult, unquote, urlsplit

from star.redact import MASK, redact_url, url_secrets
from star.rules import Check, Rule, fraction, non_negative, one_of, port, positive

ENV_PREFIX = "STAR_"
CONFIG_ENV = "STAR_CONFIG"


class SettingsError(ValueError):
    """A configuration value is missing, unknown or invalid."""


# -- validators: each returns an error message or None ---------------------


def redis_url(value: Any) -> str | None:
    scheme = urlsplit(value).scheme
    if scheme not in {"redis", "rediss", "unix"}:
        return "must be a redis://, rediss:// or unix:// URL"
    return None


# -- Redis Sentinel addresses (redis.sentinels; star.redis_sentinel connects) --

SENTINEL_PORT = 26379


@dataclass(frozen=True, slots=True)
class SentinelAddress:
    """One entry of ``redis.sentinels``."""

    host: str
    port: int
    tls: bool | None  # None: a bare host:port, TLS as redis.url says
    username: str | None = None
    password: str | None = None


def parse_sentinel(entry: str) -> SentinelAddress:
    """Read one ``redis.sentinels`` entry; :class:`ValueError` (password masked) if it is not one."""
    text = entry.strip()
    shown = repr(redact_url(bare_userinfo(text)))
    form = "a sentinel is host, host:port or a redis:// or rediss:// URL"
    parts: SplitResult
    if "://" in text:
        parts = urlsplit(text)
        if parts.scheme not in ("redis", "rediss"):
            raise ValueError(f"{shown}: {form}")
        tls: bool | None = parts.scheme == "rediss"
    else:
        parts = urlsplit("//" + text)
        tls = None
        if parts.username is not None:
            raise ValueError(
                f"{shown}: credentials need the URL form, redis://user:password@host:port"
            )
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(
            f"{shown}: a sentinel is named by host and port only (no database or parameters)"
        )
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0:  # not a number, out of range, or 0 (never "the default")
        raise ValueError(f"{shown}: the port must be a number in 1..65535")
    if not parts.hostname:
        raise ValueError(f"{shown}: {form}")
    return SentinelAddress(
        host=parts.hostname,
        port=SENTINEL_PORT if port is None else port,
        tls=tls,
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None,
    )


def non_empty(value: Any) -> str | None:
    return None if value else "must not be empty"


def sentinel_list(value: Any) -> str | None:
    for entry in value:
        try:
            parse_sentinel(entry)
        except ValueError as exc:
            return str(exc)
    return None


def planner_mode(value: Any) -> str | None:
    from star.planner.modes import Mode

    try:
        Mode.parse(value)
    except ValueError as exc:
        return str(exc)
    return None


def migrations(value: Any) -> str | None:
    if value == "auto" or (isinstance(value, int) and value >= 1):
        return None
    return 'must be "auto" or an integer >= 1'


def cluster_secret(value: Any) -> str | None:
    if value and len(value) < 16:
        return "must be empty or at least 16 characters (e.g. the output of `openssl rand -hex 32`)"
    return None


def _opt(default: Any, help: str, check: Check | None = None, secret: bool = False) -> Any:
    # A secret stays out of the dataclass repr, so a logged settings object cannot show it.
    return field(default=default, repr=not secret, metadata={"help": help, "check": check, "secret": secret})


# Choices are declared once, as Literal types: a field of such a type is checked
# against them (its rule's check is one_of its words) and `star simulate` offers them.
DispatchPolicy = Literal["round-robin", "current-load", "predicted"]
DispatchCharge = Literal["expected", "prompt"]  # star.planner.dispatch.booking says what each books
Role = Literal["prefill", "decode"]
LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["auto", "json", "console"]
DISPATCH_POLICIES: tuple[str, ...] = typing.get_args(DispatchPolicy)
DISPATCH_CHARGES: tuple[str, ...] = typing.get_args(DispatchCharge)

# The one check of a P->D policy (star.planner.dispatch says what each does): the
# configured ones below, and the one a scheduler publishes, which a proxy follows.
dispatch_policy = one_of(*DISPATCH_POLICIES)


# -- the areas ----------------------------------------------------------------


@dataclass(frozen=True)
class RedisSettings:
    """Connection to the Redis server that carries the event bus."""

    def __repr__(self) -> str:
        # The URL may carry a password (the password field itself is repr=False).
        shown = (f"{f.name}={redact_url(repr(getattr(self, f.name)))}" for f in dataclasses.fields(self) if f.repr)
        return f"RedisSettings({', '.join(shown)})"

    url: str = _opt(
        "redis://127.0.0.1:6379/0",
        "redis://, rediss:// (TLS) or unix:// URL; may carry user:password",
        redis_url,
    )
    username: str = _opt("", "ACL user (overrides the URL's)")
    password: str = _opt("", "password (overrides the URL's)", secret=True)
    tls_ca_file: str = _opt("", "rediss:// only: PEM file of the CA that signed the server's certificate (empty = the system's trust store)")
    tls_cert_file: str = _opt("", "rediss:// only: PEM client certificate, for a server that checks clients (tls-auth-clients)")
    tls_key_file: str = _opt("", "rediss:// only: PEM private key of tls_cert_file (empty = in tls_cert_file)")
    connect_timeout_s: float = _opt(2.0, "TCP connect timeout", positive)
    socket_timeout_s: float = _opt(5.0, "timeout of one command; also bounds a blocking read (its block is capped at half of this)", positive)
    backoff_base_s: float = _opt(0.05, "first reconnect delay; doubles per attempt", positive)
    backoff_max_s: float = _opt(2.0, "cap on one reconnect delay", positive)
    reconnect_timeout_s: float = _opt(
        60.0,
        "one bus call retries this long before it fails: a one-shot command (star inspect, star migrate) "
        "then exits with an error; the services log it and keep retrying",
        positive,
    )
    sentinels: tuple[str, ...] = _opt(
        (),
        "Redis Sentinel addresses: host:port (port 26379 if left out) or redis:// / rediss:// URLs, which "
        "may carry user:password; a TOML list, comma-separated in env/flags. Empty: redis.url is the server. "
        "Set: STAR connects to the master these Sentinels name for redis.service_name and asks them again "
        "on every reconnect; redis.url then gives only the master's scheme (rediss:// = TLS), database and "
        "credentials (docs/operations.md, Redis Sentinel)",
        sentinel_list,
    )
    service_name: str = _opt("mymaster", "the master's name in the Sentinels' configuration (sentinel monitor NAME ...)", non_empty)
    sentinel_password: str = _opt("", "password of the Sentinels (requirepass/ACL of the sentinel processes; overrides a sentinel URL's)", secret=True)


@dataclass(frozen=True)
class BusSettings:
    """Streams of the event bus (docs/design.md §4)."""

    prefix: str = _opt("star", "key prefix, so several clusters can share one Redis")
    maxlen_reports: int = _opt(50_000, "approximate MAXLEN of <prefix>:reports", positive)
    maxlen_decisions: int = _opt(100_000, "approximate MAXLEN of <prefix>:decisions", positive)
    maxlen_events: int = _opt(100_000, "approximate MAXLEN of <prefix>:events", positive)
    maxlen_dead: int = _opt(10_000, "approximate MAXLEN of the dead-letter stream <prefix>:dead", positive)
    block_ms: int = _opt(1000, "how long one blocking read waits for new entries", positive)
    read_count: int = _opt(256, "entries fetched per read", positive)
    claim_idle_ms: int = _opt(
        30_000, "a pending entry idle this long is reclaimed by another consumer (XAUTOCLAIM)", positive
    )


@dataclass(frozen=True)
class SchedulerSettings:
    """The rescheduler (paper §5, docs/design.md §3)."""

    interval_s: float = _opt(0.25, "planner tick interval", positive)
    mode: str = _opt("predicted", "no-migration, current, predicted, oracle (true lengths, known for requests sent with ignore_eos and max_tokens; others count as unknown) or bins:K", planner_mode)
    dispatch: DispatchPolicy = _opt("current-load", "P->D dispatch policy the leader publishes with the load view (<prefix>:dispatch); the proxies follow it while it is fresh")  # noqa: RUF009 (a field)
    theta: float = _opt(0.1, "classification threshold: overloaded if w_i > (1+theta) * mean", non_negative)
    horizon: int = _opt(64, "H: future grid points tau_1..tau_H", non_negative)
    delta: int = _opt(32, "decode steps between grid points", positive)
    beta_decay: float = _opt(0.95, "beta_j proportional to beta_decay**j (then normalised)", fraction)
    min_gain: float = _opt(0.0, "epsilon: migrate only if the variance drops by more", non_negative)
    max_migrations: int | Literal["auto"] = _opt("auto", "M: migrations decided per tick, each instance in at most one: auto (up to one per overloaded instance, each lowering the variance) or an integer (1 is the paper's rule)", migrations)
    transfer_budget_s: float = _opt(0.0, "KV a tick's moves after the first may carry in all, in seconds of bandwidth_gbps (0 = no budget)", non_negative)
    bins_scale_tokens: int = _opt(0, "bins:K edges are the paper's 32K-token edges x bins_scale_tokens/32768 (0 = worker.max_model_len)", non_negative)
    bandwidth_gbps: float = _opt(25.0, "KV transfer bandwidth assumed in C_mig", positive)
    handoff_latency_s: float = _opt(0.025, "fixed handoff cost added to C_mig", non_negative)
    staleness_s: float = _opt(3.0, "an instance whose reports stop this long is excluded", positive)
    decision_timeout_s: float = _opt(15.0, "a decision with no outcome by then is expired", positive)
    lock_ttl_s: float = _opt(1.5, "leader lock TTL; a standby takes over within about this", positive)
    group: str = _opt("scheduler", "consumer group on <prefix>:reports")
    metrics_host: str = _opt("127.0.0.1", "address of the Prometheus /metrics endpoint")
    metrics_port: int = _opt(9464, "port of /metrics (0 = disabled)", port)
    gc_gen0_threshold: int = _opt(50_000, "allocations between the garbage collector's young collections in the scheduler process (Python's default 700; 0 = leave the interpreter's setting). The view holds ~64 request objects per instance and replaces them with every report, so at 700 the collector runs thousands of times a second and promotes them into full collections; 50,000 costs a few MB of cycles collected later (docs/scheduler-at-scale.md)", non_negative)


@dataclass(frozen=True)
class WorkerSettings:
    """One worker process wrapping one vLLM engine."""

    role: Role = _opt("decode", "prefill or decode")  # noqa: RUF009 (a field)
    model: str = _opt("", "model path or name (empty = the bundled tiny demo model)")
    instance: str = _opt("", "instance id on the bus (empty = <role>-<host>-<port>)")
    host: str = _opt("127.0.0.1", "address of the internal token protocol")
    port: int = _opt(0, "port of the internal token protocol (0 = pick a free one)", port)
    report_every_steps: int = _opt(20, "k: report (and predict) every k decode steps", positive)
    report_interval_s: float = _opt(1.0, "report at least this often", positive)
    kv_cache_space_gib: float = _opt(1.0, "VLLM_CPU_KVCACHE_SPACE on CPU machines", positive)
    gpu_memory_utilization: float = _opt(0.3, "vLLM gpu_memory_utilization", fraction)
    max_model_len: int = _opt(4096, "vLLM max_model_len", positive)
    cpu_threads: int = _opt(0, "OpenMP threads of a CPU engine (0 = vLLM's default, every core; star up gives each engine its share)", non_negative)
    engine_args: tuple[str, ...] = _opt((), "extra vLLM engine arguments, KEY=VALUE")
    drain_timeout_s: float = _opt(30.0, "on SIGTERM, wait this long for running requests", positive)
    orphan_grace_s: float = _opt(30.0, "a request a client may resume (proxy.resume_grace_s) whose proxy connection went away decodes on this long, its tokens kept, for another proxy to take over (a resume on any proxy), then is aborted and its KV freed (0 = abort at once, as before)", non_negative)
    true_continuation: bool = _opt(True, "a migrated request continues on its target as a true continuation: original prompt, sampling and budgets, the tokens generated so far as its output tokens (penalties, min_tokens, bad_words, stop token ids and seeded sampling continue exactly, so such requests migrate); false = as a new request whose prompt is the old prompt plus the generated tokens, budgets reduced, and those requests are refused migration. Set it the same on every worker")
    device_step_ms: float = _opt(0.0, "emulated device timing (decode role): pad every step to device_step_ms + device_us_per_token * KV tokens in the batch + device_prefill_us_per_token * tokens prefilled (0 = off, real timing; docs/e2e.md)", non_negative)
    device_us_per_token: float = _opt(0.0, "emulated device: microseconds per token in the batch's KV", non_negative)
    device_prefill_us_per_token: float = _opt(0.0, "emulated device: microseconds per token prefilled in a step", non_negative)
    device_transfer_us_per_token: float = _opt(0.0, "emulated device: a KV pull (P->D or D->D) completes no sooner than this many microseconds per token after it starts, the link's bytes / bandwidth (0 = as fast as NIXL moves it here)", non_negative)


@dataclass(frozen=True)
class ProxySettings:
    """The OpenAI-compatible HTTP/SSE front end."""

    host: str = _opt("127.0.0.1", "listen address")
    port: int = _opt(8000, "listen port", port)
    api_key: str = _opt("", "bearer token clients must send, checked when the request head arrives (empty = no auth; the proxy warns when bound beyond loopback without one). With a key, a keyless GET /health gets only {\"ok\": ...}", secret=True)
    protect_metrics: bool = _opt(False, "/metrics and /health need the api_key too (no effect while api_key is empty)")
    max_header_bytes: int = _opt(16_384, "larger request heads get 431", positive)
    max_body_bytes: int = _opt(4 * 1024 * 1024, "larger bodies get 413", positive)
    max_streams: int = _opt(2048, "concurrent requests; more get 429", positive)
    max_connections: int = _opt(4096, "open client connections (idle keep-alive ones too); a connection beyond it gets 503 too_many_connections and is closed. Keep it above max_streams", positive)
    idle_timeout_s: float = _opt(75.0, "close a connection, new or kept alive, that sends no byte of a request this long", positive)
    head_timeout_s: float = _opt(30.0, "a request head must be complete this long after its first byte, or 408 and close (slow-header clients)", positive)
    body_timeout_s: float = _opt(60.0, "a request body must be complete this long after its head, or 408 and close (slow-body clients)", positive)
    dispatch: DispatchPolicy = _opt("current-load", "P->D policy while no scheduler publishes one (a leader's scheduler.dispatch wins)")  # noqa: RUF009 (a field)
    dispatch_charge: DispatchCharge = _opt("expected", "what a current-load dispatch books on its decode instance until the next load view: expected (the prompt plus the mean output length of the requests this proxy saw finish: no herd onto one instance between views) or prompt (the prompt alone)")  # noqa: RUF009 (a field)
    prefill_fallback: bool = _opt(True, "while no prefill instance answers (none up or reachable, or the chosen one went away mid-prefill), a request runs whole (prefill included) on the decode instance the dispatch policy picks (false: those requests get 503)")
    drain_timeout_s: float = _opt(30.0, "on SIGTERM, wait this long for open streams", positive)
    resume_grace_s: float = _opt(30.0, "a stream whose client went away goes on decoding this long (its tokens kept) for the client to resume it (GET /v1/streams/{event id}), then is aborted and its KV freed; a finished one is kept as long for a client that missed its end (0 = abort at once on disconnect)", non_negative)
    write_stall_timeout_s: float = _opt(60.0, "cut a stream whose client leaves the proxy's write buffer for it full this long (a client that stopped reading)", positive)
    reasoning_parser: str = _opt("", "vLLM's --reasoning-parser for the served model (e.g. deepseek_r1): chat responses carry `reasoning` split from the text by vLLM's own parser, streamed and not, and the workers' engines get it too, so structured outputs bind from where the reasoning ends (empty = off; the proxy host needs vllm installed, and a name vLLM does not know or the model's tokenizer cannot serve is refused at start)")
    tool_call_parser: str = _opt("", "vLLM's --tool-call-parser for the served model (e.g. hermes): with enable_auto_tool_choice, chat `tools` with tool_choice auto, required or a named function are served through vLLM's own parser (empty = only tool_choice none)")
    enable_auto_tool_choice: bool = _opt(False, "vLLM's --enable-auto-tool-choice: load tool_call_parser and serve tool_choice auto, required and named (forced choices are decoded under structured outputs built from the tools' parameters); needs tool_call_parser")


@dataclass(frozen=True)
class ClusterSettings:
    """What every process of one cluster shares."""

    secret: str = _opt("", "shared secret of the internal token protocol: proxy and workers prove it to each other (HMAC challenge) before a worker says Hello or takes a request; required for a worker bound beyond loopback (empty = no authentication)", cluster_secret, secret=True)
    keyring: str = _opt("", "a role's bus keyring file (`star config keyring` writes one per role): the bus is signed and checked with it instead of keys derived from secret, so a worker's or proxy's process cannot sign a decision, a load view or a policy (empty = derive every role's keys from secret, as `star up` does)")
    liveness_timeout_s: float = _opt(2.0, "drop a token-protocol connection (proxy and worker ends) with nothing received this long: the proxy recovers its streams elsewhere, the worker aborts them; a Ping goes out after a quarter of it without a frame (0 = off)", non_negative)


@dataclass(frozen=True)
class PredictorSettings:
    """The length predictor (paper §4, docs/design.md §6)."""

    checkpoint: str = _opt("", "predictor checkpoint (empty = the one shipped with the model, if any)")
    every_k: int = _opt(20, "predict every k decode steps (paper Table 5)", positive)
    hidden_sizes: tuple[int, ...] = _opt(
        (2048, 512, 64),
        "MLP hidden widths `star predictor train` fits (its --hidden overrides; a checkpoint keeps its own)",
        lambda v: None if v and all(w >= 1 for w in v) else "must be one or more widths >= 1",
    )


@dataclass(frozen=True)
class SimulatorSettings:
    """Defaults of ``star simulate``."""

    duration_s: float = _opt(2000.0, "simulated seconds per run", positive)
    rate_per_8: float = _opt(0.4, "request rate per 8 decode instances (paper §6.3: 0.3 per 2+6)", positive)
    bandwidth_gbps: float = _opt(25.0, "D->D KV transfer bandwidth (paper §6.3)", positive)
    tick_s: float = _opt(1.0, "scheduler tick in simulated time", positive)


@dataclass(frozen=True)
class LogSettings:
    """structlog output."""

    level: LogLevel = _opt("info", "debug, info, warning or error")  # noqa: RUF009 (a field)
    format: LogFormat = _opt("auto", "auto (console on a TTY, JSON otherwise), json or console")  # noqa: RUF009 (a field)


@dataclass(frozen=True)
class Settings:
    """The whole configuration; ``sources`` maps ``area.key`` to where it came from."""

    redis: RedisSettings = field(default_factory=RedisSettings)
    bus: BusSettings = field(default_factory=BusSettings)
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    worker: WorkerSettings = field(default_factory=WorkerSettings)
    proxy: ProxySettings = field(default_factory=ProxySettings)
    cluster: ClusterSettings = field(default_factory=ClusterSettings)
    predictor: PredictorSettings = field(default_factory=PredictorSettings)
    simulator: SimulatorSettings = field(default_factory=SimulatorSettings)
    log: LogSettings = field(default_factory=LogSettings)
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    def items(self) -> Iterator[tuple[str, Any, str, dataclasses.Field[Any]]]:
        """Yield ``(area.key, value, source, field)`` for every setting."""
        for area in AREAS:
            section = getattr(self, area)
            for f in dataclasses.fields(section):
                key = f"{area}.{f.name}"
                yield key, getattr(section, f.name), self.sources.get(key, "default"), f


AREAS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Settings) if f.name != "sources")
_AREA_TYPES: dict[str, type[Any]] = {
    f.name: typing.get_type_hints(Settings)[f.name] for f in dataclasses.fields(Settings) if f.name != "sources"
}


# -- coercion -------------------------------------------------------------------


def _field_types(area: str) -> dict[str, Any]:
    return typing.get_type_hints(_AREA_TYPES[area])


def _rules() -> dict[str, Rule]:
    out: dict[str, Rule] = {}
    for area in AREAS:
        hints = _field_types(area)
        for f in dataclasses.fields(_AREA_TYPES[area]):
            tp = hints[f.name]
            check: Check | None = f.metadata.get("check")
            if check is None and typing.get_origin(tp) is Literal:
                check = one_of(*typing.get_args(tp))
            key = f"{area}.{f.name}"
            out[key] = Rule(key, tp, check, f.default, f.metadata.get("help", ""))
    return out


RULES: Mapping[str, Rule] = types.MappingProxyType(_rules())
"""Every setting's :class:`Rule`, by ``area.key``."""


def setting_arg(key: str) -> Callable[[str], Any]:
    """An argparse ``type`` that parses and checks a flag by setting ``key``'s rule."""
    import argparse

    rule = RULES[key]

    def parse(text: str) -> Any:
        try:
            return rule.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{key}: {exc}, got {text!r}") from None

    parse.__name__ = key
    return parse


def add_setting_flag(
    parser: Any,
    flag: str,
    key: str,
    *,
    metavar: str | None = None,
    from_settings: bool = False,
    note: str = "",
    **kwargs: Any,
) -> None:
    """Add ``flag`` to an argparse ``parser``, mirroring setting ``key``: its type,
    check, choices and help come from the settings, its default is the setting's
    default. With ``from_settings`` the flag defaults to None and the command fills
    it from :func:`load_settings` (so the file and STAR_* environment apply).
    ``note`` is said after the setting's help: what the flag adds to it.
    """
    rule = RULES[key]
    shown = render(rule.default, False)
    if shown != '""':  # an empty default stays visible as ""
        shown = shown.strip('"')
    if isinstance(rule.default, float):
        shown = f"{rule.default:g}"
    if from_settings:
        default, tail = None, f"default: {key} = {shown}"
    else:
        default, tail = rule.default, f"as {key}; default %(default)s"
    if typing.get_origin(rule.tp) is Literal:
        kwargs["choices"] = typing.get_args(rule.tp)
    said = f"{rule.help}. {note}" if note else rule.help
    parser.add_argument(
        flag,
        type=setting_arg(key),
        default=default,
        metavar=metavar,
        help=f"{said.replace('%', '%%')} ({tail})",
        **kwargs,
    )


def _quoted(value: Any, f: dataclasses.Field[Any]) -> str:
    """A value as an error message quotes it: a secret masked, a URL without its password."""
    if f.metadata.get("secret") and value:
        return repr(MASK)
    if isinstance(value, tuple):  # a list of addresses: user:password@host, no scheme, too
        value = tuple(bare_userinfo(v) if isinstance(v, str) else v for v in value)
    return redact_url(repr(value))


def bare_userinfo(text: str) -> str:
    """``user:password@host`` (an address without a scheme) as ``***@host``."""
    if "://" in text or "@" not in text:
        return text
    return f"{MASK}@{text.rpartition('@')[2]}"


def secret_values(settings: Settings) -> list[str]:
    """Every secret the settings hold, in the forms a log line or an error could show it."""
    out: set[str] = set()
    for _key, value, _source, f in settings.items():
        if isinstance(value, tuple):  # a list of URLs (redis.sentinels)
            for item in value:
                if isinstance(item, str):
                    out.update(url_secrets(item))
            continue
        if not isinstance(value, str) or not value:
            continue
        if f.metadata.get("secret"):
            out.add(value)
        out.update(url_secrets(value))
    return sorted(out)


def _describe(source: str) -> str:
    return f" (from {source})" if source != "default" else ""


# -- loading -------------------------------------------------------------------


def env_key(key: str) -> str:
    """``scheduler.interval_s`` -> ``STAR_SCHEDULER_INTERVAL_S``."""
    return ENV_PREFIX + key.replace(".", "_").upper()


def _from_env(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    out: dict[str, tuple[Any, str]] = {}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX) or name == CONFIG_ENV:
            continue
        rest = name[len(ENV_PREFIX) :].lower()
        area, _, key = rest.partition("_")
        if area not in AREAS:
            continue  # not ours (STAR_ is a short prefix); see `star config show`
        if key not in _field_types(area):
            known = ", ".join(env_key(f"{area}.{k}") for k in _field_types(area))
            # The value is not quoted: a misspelt secret's variable would show the secret.
            raise SettingsError(f"unknown environment variable {name}; {area} takes {known}")
        out[f"{area}.{key}"] = (raw, f"env {name}")
    return out


def _from_toml(path: Path) -> dict[str, tuple[Any, str]]:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SettingsError(f"config file {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
    out: dict[str, tuple[Any, str]] = {}
    for area, table in data.items():
        if area not in AREAS:
            raise SettingsError(f"{path}: unknown section [{area}]; expected one of {', '.join(AREAS)}")
        if not isinstance(table, dict):
            raise SettingsError(f"{path}: [{area}] must be a table")
        for key, value in table.items():
            if key not in _field_types(area):
                raise SettingsError(
                    f"{path}: unknown key {area}.{key}; [{area}] takes {', '.join(_field_types(area))}"
                )
            out[f"{area}.{key}"] = (value, f"file {path}")
    return out


def parse_assignment(text: str) -> tuple[str, str]:
    """Split a ``--set area.key=value`` flag."""
    key, sep, value = text.partition("=")
    if not sep or "." not in key:
        raise SettingsError(f"--set expects AREA.KEY=VALUE, got {key.strip()!r}{'=...' if sep else ''}")
    return key.strip(), value


def load_settings(
    config: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Build the settings tree from defaults, TOML file, environment and flags.

    ``overrides`` maps ``area.key`` to a value from the command line (strings
    are parsed like environment values; ``None`` means "flag not given").
    """
    env = os.environ if env is None else env
    path = config if config is not None else env.get(CONFIG_ENV) or None
    layered: dict[str, tuple[Any, str]] = {}
    if path:
        layered.update(_from_toml(Path(path)))
    layered.update(_from_env(env))
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        area, _, name = key.partition(".")
        if area not in AREAS or name not in _field_types(area):
            raise SettingsError(f"unknown setting {key!r}; see `star config show` for the keys")
        layered[key] = (value, "flag")

    sections: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for area in AREAS:
        cls = _AREA_TYPES[area]
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            key = f"{area}.{f.name}"
            if key in layered:
                raw, source = layered[key]
                try:
                    value = RULES[key].convert(raw, from_text=not source.startswith("file"))
                except ValueError as exc:
                    raise SettingsError(
                        f"{key}: invalid value {_quoted(raw, f)}{_describe(source)}: {redact_url(str(exc))}"
                    ) from None
                kwargs[f.name] = value
                sources[key] = source
            check = RULES[key].check
            current = kwargs.get(f.name, f.default)
            if check is not None and current is not None:
                problem = check(current)
                if problem:
                    src = sources.get(key, "default")
                    raise SettingsError(f"{key}: {problem}, got {_quoted(current, f)}{_describe(src)}")
        sections[area] = cls(**kwargs)
    return Settings(**sections, sources=sources)


def render(value: Any, secret: bool) -> str:
    """A value as `star config show` prints it (secrets masked, URL passwords too)."""
    if secret and value:
        return json.dumps(MASK)
    if isinstance(value, tuple):
        return json.dumps([redact_url(v) if isinstance(v, str) else v for v in value])
    if isinstance(value, str):
        return json.dumps(redact_url(value))
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def as_dict(settings: Settings, mask_secrets: bool = True) -> dict[str, dict[str, Any]]:
    """The settings as nested plain data (JSON/TOML friendly)."""
    out: dict[str, dict[str, Any]] = {area: {} for area in AREAS}
    for key, value, _source, f in settings.items():
        area, name = key.split(".", 1)
        if mask_secrets and f.metadata.get("secret") and value:
            value = MASK
        elif mask_secrets and isinstance(value, str):
            value = redact_url(value)
        elif mask_secrets and isinstance(value, tuple):
            value = tuple(redact_url(v) if isinstance(v, str) else v for v in value)
        out[area][name] = list(value) if isinstance(value, tuple) else value
    return out
