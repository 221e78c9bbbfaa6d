"""The ``kvgate`` command.

Subcommands are registered in `SUBCOMMANDS` as ``name -> "module:function"`` and imported
only when chosen, so ``kvgate serve`` never imports the demo (and its load generators),
and a new subcommand is one line. Each function takes the remaining argv and returns an
exit status.

The gateway (`gateway`, `admission`, `routing`) installs and runs alone: the simulator
(`enginesim`), the load tools (`loadtests`) and the demo harness that drives both
(`kvgate_demo`) live outside it, are never imported by it, and come with the extras
``kvgate[sim]`` and ``kvgate[load]`` (a production image carries none of them). A
subcommand whose module is missing says which extra to install and exits 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the commands import what they run when they run it
    from gateway.config import GatewayConfig

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("gateway.cli:serve_main", "run the gateway"),
    "hash-key": (
        "gateway.cli:hash_key_main",
        "print the SHA-256 of an API key read from stdin, for tenants[].keys_sha256 "
        "(--new: make a key)",
    ),
    "demo": ("kvgate_demo.demo:main", "run the demo (simulated replicas, load through kvgate)"),
    # Locust patches the process with gevent: only these two commands import it.
    "sweep": ("loadtests.sweep:main", "find a target's ceiling: a concurrency staircase"),
    "showcase": (
        "kvgate_demo.showcase:main",
        "the sweep straight at a simulated replica, then through kvgate",
    ),
}


# Top-level packages outside the gateway, and the extra that brings each (with the
# third-party packages it needs).
_EXTRA_OF = {
    "enginesim": "sim",
    "loadtests": "load",
    "kvgate_demo": "sim,load",
    "locust": "load",
    "gevent": "load",
    "openai": "load",
    "matplotlib": "load",
}


class MissingExtra(RuntimeError):
    """A subcommand needs a package this installation does not have."""


def _resolve(target: str) -> Callable[[Sequence[str]], int | None]:
    module, _, func = target.partition(":")
    try:
        return getattr(importlib.import_module(module), func)
    except ModuleNotFoundError as e:
        top = (e.name or "").partition(".")[0]
        if top not in _EXTRA_OF:
            raise
        raise MissingExtra(
            f"this command needs {top!r}, which this installation lacks: install "
            f"'kvgate[{_EXTRA_OF[top]}]', or run it from the repository "
            "(bash scripts/setup.sh installs everything)"
        ) from e


def serve_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvgate serve", description="Run the kvgate gateway.")
    parser.add_argument("--config", "-c", help="YAML config (docs/configuration.md)", default=None)
    parser.add_argument(
        "--check",
        action="store_true",
        help="validate the config as serve does, print what serve would refuse, and exit",
    )
    parser.add_argument(
        "--probe",
        action="store_true",
        help="with --check: contact each replica once and print what kvgate learns from it "
        "(exit 1 when one is not ready)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="gateway processes on one port (SO_REUSEPORT); more than one needs the "
        "redis state backend (state.backend: redis)",
    )
    args = parser.parse_args(list(argv))
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if args.probe and not args.check:
        parser.error("--probe goes with --check")

    from gateway.checks import exposure_warning, serve_problems
    from gateway.config import ConfigError, expand_data_parallel, load_config
    from gateway.logging import configure_logging

    try:
        config = load_config(args.config)
    except ConfigError as e:
        print(f"kvgate: {e}", file=sys.stderr)
        return 2
    # One validation for both: --check passes exactly what serve accepts.
    problems = serve_problems(config, args.workers)
    if problems:
        where = f"{args.config}: " if args.config else ""
        print(f"kvgate: {where}invalid configuration:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    if args.check:
        if (warning := exposure_warning(config)) is not None:
            print(f"kvgate: warning: {warning}", file=sys.stderr)
        n = len(expand_data_parallel(config.replicas))
        groups = f", {len(config.replica_groups)} DNS groups" if config.replica_groups else ""
        print(f"kvgate: config OK ({n} replicas{groups})")
        if not args.probe:
            return 0
        from gateway.checks import probe_report

        lines: list[str] = []
        status = asyncio.run(probe_report(config, lines))
        print("\n".join(lines))
        return status
    if args.workers > 1:
        return _supervise(list(argv), args.workers)
    configure_logging(config.logging.level, access=config.logging.access_log)
    worker = os.environ.get(_WORKER_ENV) is not None
    if worker and not _die_with_supervisor():
        return 1
    workers = int(os.environ.get(_WORKERS_ENV, "1") or 1) if worker else 1

    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a declared dependency
        uvloop = None  # type: ignore[assignment]  # None: the module is missing
    runner = uvloop.run if uvloop is not None else asyncio.run
    try:
        runner(_serve(config, reuse_port=worker, workers=workers, path=args.config))
    except KeyboardInterrupt:
        pass
    except ConfigError as e:  # raised while building the app (e.g. a tokenizer file)
        print(f"kvgate: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(
            f"kvgate: cannot listen on {config.listen.host}:{config.listen.port}: {e}",
            file=sys.stderr,
        )
        return 1
    return 0


def hash_key_main(argv: Sequence[str]) -> int:
    """``kvgate hash-key``: the digest to put in ``tenants[].keys_sha256``.

    The key is read from stdin (one line), never from the command line, where it would
    show in the process list and the shell history. ``--new`` makes a random key
    (256 bits) and prints it once, with its digest: give the key to the tenant and keep
    only the digest."""
    parser = argparse.ArgumentParser(
        prog="kvgate hash-key",
        description="Print the hex SHA-256 of an API key read from stdin (tenants[].keys_sha256).",
    )
    parser.add_argument("--new", action="store_true", help="make a new random key and hash it")
    args = parser.parse_args(list(argv))

    import secrets

    from admission.tenants import hash_key

    if args.new:
        key = "sk-kvg-" + secrets.token_urlsafe(32)
        print(f"key:    {key}")
        print(f"sha256: {hash_key(key)}")
        return 0
    line = sys.stdin.readline().rstrip("\r\n")
    if not line:
        print("kvgate hash-key: no key on stdin", file=sys.stderr)
        return 2
    print(hash_key(line))
    return 0


_WORKER_ENV = "KVGATE_WORKER"  # set by the supervisor in each worker: its index
_WORKERS_ENV = "KVGATE_WORKERS"  # and the number of workers


_SUPERVISOR_ENV = "KVGATE_SUPERVISOR_PID"


def _die_with_supervisor() -> bool:
    """A worker gets SIGTERM when its supervisor dies, even by SIGKILL (Linux
    ``PR_SET_PDEATHSIG``), so no worker outlives it holding the port. False when the
    supervisor is already gone."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    expected = os.environ.get(_SUPERVISOR_ENV)
    return expected is None or str(os.getppid()) == expected


def _supervise(argv: list[str], workers: int) -> int:
    """Run `workers` gateway processes on one port (SO_REUSEPORT: the kernel spreads
    connections over them) and stay until they end.

    Each worker is ``kvgate serve`` with the same arguments (less ``--workers``), told its
    index and the worker count through the environment; they share state through Redis.
    SIGTERM and SIGINT are forwarded to every worker (each drains as a single process
    does); a worker dies with the supervisor, even one killed by SIGKILL (Linux). A
    worker that exits on its own takes the others down (SIGTERM) and the
    supervisor exits with its status, so an orchestrator restarts the whole set instead
    of serving on with less capacity than it thinks. Returns the first non-zero status
    of a worker, else 0.
    """
    args: list[str] = []
    skip = False
    for a in argv:  # drop --workers N / --workers=N
        if skip:
            skip = False
            continue
        if a == "--workers":
            skip = True
            continue
        if a.startswith("--workers="):
            continue
        args.append(a)
    procs: list[subprocess.Popen[bytes]] = []
    stopping = False

    def forward(sig: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)

    def hangup(sig: int, _frame: object) -> None:  # each worker reloads its config
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGHUP, hangup)
    for i in range(workers):
        env = {
            **os.environ,
            _WORKER_ENV: str(i),
            _WORKERS_ENV: str(workers),
            _SUPERVISOR_ENV: str(os.getpid()),
        }
        procs.append(
            subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", *args], env=env)
        )
    status = 0
    while any(p.poll() is None for p in procs):
        for p in procs:
            code = p.poll()
            if code is not None and code != 0 and status == 0:
                status = code
            if code is not None and not stopping:
                print(
                    f"kvgate: worker {p.pid} exited ({code}); stopping the others",
                    file=sys.stderr,
                )
                stopping = True
                status = status or code or 1
                for q in procs:
                    if q.poll() is None:
                        q.send_signal(signal.SIGTERM)
        time.sleep(0.1)
    for p in procs:
        code = p.wait()
        if code != 0 and status == 0:
            status = code
    return status if status >= 0 else 128 - status


async def _serve(
    config: GatewayConfig, *, reuse_port: bool = False, workers: int = 1, path: str | None = None
) -> None:
    from gateway.app import Gateway
    from gateway.runtime import tune_gc

    # SIGTERM: graceful (shutdown.drain_grace_s for running requests). SIGINT, or a
    # second SIGTERM: fast (queued and running requests are answered at once).
    stop = asyncio.Event()
    fast = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set() or sig == signal.SIGINT:
            fast.set()
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    gw = Gateway(config, reuse_port=reuse_port, workers_hint=workers, config_path=path)
    reloads: set[asyncio.Task[bool]] = set()

    def on_hangup() -> None:  # SIGHUP: reload the config (gateway/reload.py)
        task = loop.create_task(gw.reload("SIGHUP"))
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    loop.add_signal_handler(signal.SIGHUP, on_hangup)
    await gw.start()
    tune_gc()  # gateway/runtime.py: collect young objects less often once it is up
    try:
        await stop.wait()
    finally:
        await gw.shutdown(0.0 if fast.is_set() else None, fast=fast)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="kvgate",
        description="KV-aware, admission-controlling OpenAI-compatible gateway.",
        epilog="subcommands: " + "; ".join(f"{k}: {v[1]}" for k, v in SUBCOMMANDS.items()),
    )
    parser.add_argument("command", choices=sorted(SUBCOMMANDS))
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    if argv[0] not in SUBCOMMANDS:
        parser.error(f"unknown command {argv[0]!r}")
    try:
        command = _resolve(SUBCOMMANDS[argv[0]][0])
    except MissingExtra as e:
        print(f"kvgate {argv[0]}: {e}", file=sys.stderr)
        return 2
    rc = command(argv[1:])
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
