"""``star up``: a whole local cluster in one command (the embedded default).

Redis at the configured URL or, if none answers, a private ``redis-server``
(with ``redis.sentinels``: the master they name, which must answer);
1 prefill + 3 decode workers on the tiny demo model; the scheduler; the proxy
on 127.0.0.1:8000. Every process runs in its own session so that stopping
(Ctrl-C, SIGTERM, or any process dying) kills whole process groups: vLLM's
engine-core children included, nothing is left behind; a ``star up`` killed
outright (SIGKILL) takes them along too (``PR_SET_PDEATHSIG``). A cluster
already live on the same Redis and prefix is refused, named, rather than
joined. Logs go to one file per process under the run directory; a process
that dies is reported by its one-line cause and stops the cluster, except the
proxy: one that dies unexpectedly is started again on the same port (a few
times in a row, with growing pauses, each said on stderr), so a client whose
stream it cut resumes it there (``docs/operations.md``, "Resuming a stream"). The fleet itself is
:class:`star.fleet.LocalCluster`; this module parses the flags and reports.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

from star.cli.common import CliError, add_settings_args, guarded, settings_from_args
from star.fleet import (
    SECRET_ENV,
    ClusterError,
    LocalCluster,
    Terminated,
    on_sigterm_raise,
    refuse_a_second_cluster,
    restore_sigterm,
)
from star.redact import redact_url
from star.redis_sentinel import describe
from star.settings import add_setting_flag


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "up",
        help="start a local cluster: redis, prefill + decode workers, scheduler, proxy",
        description=(
            "Start a complete local STAR cluster and keep it running until Ctrl-C: "
            "Redis (the configured one, or a private redis-server if none answers; with "
            "redis.sentinels the master those Sentinels name, followed across a failover), "
            "prefill and decode vLLM workers on the tiny demo model, the scheduler and "
            "the OpenAI-compatible proxy. Prints how to stream a request once it is ready."
        ),
        epilog=(
            "examples: star up --decode 2 --port 8080; on a Sentinel-watched Redis: "
            "star up --set redis.sentinels=10.0.0.1,10.0.0.2 --set redis.service_name=star"
        ),
    )
    parser.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    parser.add_argument("--decode", type=int, default=3, help="decode workers (default 3)")
    parser.add_argument("--model", help="model directory (default: the tiny demo model)")
    # Overrides of two settings: parsed and checked by their rules, the file and STAR_* below them.
    add_setting_flag(parser, "--port", "proxy.port", metavar="PORT", from_settings=True)
    add_setting_flag(parser, "--mode", "scheduler.mode", metavar="MODE", from_settings=True)
    parser.add_argument("--run-dir", help="where logs go (default: a new temporary directory)")
    parser.add_argument(
        "--ready-timeout", type=float, default=600.0, help="seconds to wait for readiness"
    )
    add_settings_args(parser)
    parser.set_defaults(func=guarded(run))


def run(args: argparse.Namespace) -> int:
    if args.prefill < 1 or args.decode < 1:
        raise CliError("--prefill and --decode must be at least 1")
    settings = settings_from_args(args, {"proxy.port": args.port, "scheduler.mode": args.mode})
    env = dict(os.environ)
    if getattr(args, "config", None):
        env["STAR_CONFIG"] = str(Path(args.config).resolve())
    for item in args.set_:
        key, _, value = item.partition("=")
        env["STAR_" + key.replace(".", "_").upper()] = value
    if args.mode:
        env["STAR_SCHEDULER_MODE"] = args.mode
    if settings.cluster.secret:  # from a config file too: LocalCluster keeps it
        env[SECRET_ENV] = settings.cluster.secret
    model = args.model or settings.worker.model or None
    # With redis.sentinels: the master they name must answer now (no private
    # Redis is started in its place), and every child follows it.
    refuse_a_second_cluster(settings)
    cluster = LocalCluster(
        settings.redis.url,
        port=settings.proxy.port,
        prefill=args.prefill,
        decode=args.decode,
        model=model,
        run_dir=Path(args.run_dir) if args.run_dir else None,
        env=env,
        restart_proxy=True,
        notify=lambda message: print(f"star up: {message}", file=sys.stderr, flush=True),
        sentinels=settings.redis.sentinels,
        service_name=settings.redis.service_name,
    )
    port = cluster.port

    previous = on_sigterm_raise()
    try:
        cluster.start()
        if settings.redis.sentinels:
            print(f"star up: on the {describe(settings.redis)} (followed across a failover)")
        elif cluster.private_redis:
            print(
                f"star up: no Redis at {redact_url(settings.redis.url)}; started a private one at "
                f"{cluster.plain_redis_url} (password in {cluster.redis_password_file})"
            )
        print(
            f"star up: starting {args.prefill} prefill + {args.decode} decode workers, scheduler, proxy (logs: {cluster.run_dir})"
        )
        try:
            took = cluster.wait_ready(
                args.ready_timeout,
                lambda s: print(f"star up: waiting for engines to load ({s:.0f}s)...", flush=True),
            )
        except ClusterError as exc:
            print(f"star up: {exc}", file=sys.stderr)
            return 1

        name = "star-tiny" if not model else model
        star = cluster.find_hint(settings.bus.prefix) + "star"
        print(
            f"\nstar up: ready in {took:.0f}s — proxy on http://127.0.0.1:{port}\n\n"
            f"  curl -N http://127.0.0.1:{port}/v1/completions -H 'Content-Type: application/json' \\\n"
            f'       -d \'{{"model": "{name}", "prompt": "give me a long list of animals starting with owl.", "max_tokens": 64, "stream": true}}\'\n\n'
            f"  {star} status                 # instances, load, running requests\n"
            f"  {star} inspect decisions -f   # migrations as they are decided\n\n"
            f"Ctrl-C stops everything.",
            flush=True,
        )
        while True:
            try:
                cluster.check()
            except ClusterError as exc:
                print(f"star up: stopping the cluster: {exc}", file=sys.stderr)
                return 1
            time.sleep(0.5)
    except (KeyboardInterrupt, Terminated):
        print("\nstar up: stopping...", flush=True)
        return 0
    finally:
        restore_sigterm(previous)
        with contextlib.suppress(KeyboardInterrupt, Terminated):
            cluster.stop()
        print(f"star up: stopped (logs kept in {cluster.run_dir})", flush=True)
