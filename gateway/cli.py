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
import importlib
import signal
import sys
from collections.abc import Callable, Sequence

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("gateway.cli:serve_main", "run the gateway"),
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
    parser.add_argument("--config", "-c", help="YAML config file (see README)", default=None)
    parser.add_argument("--check", action="store_true", help="validate the config and exit")
    args = parser.parse_args(list(argv))

    from gateway.config import ConfigError, load_config
    from gateway.logging import configure_logging

    try:
        config = load_config(args.config)
    except ConfigError as e:
        print(f"kvgate: {e}", file=sys.stderr)
        return 2
    if args.check:
        from gateway.tokenizers import load_token_counters

        try:
            load_token_counters(config.tokenizers)
        except ConfigError as e:
            print(f"kvgate: {e}", file=sys.stderr)
            return 2
        print(f"kvgate: config OK ({len(config.replicas)} replicas)")
        return 0
    if not config.replicas:
        print(
            "kvgate: invalid configuration:\n  replicas: at least one replica is required",
            file=sys.stderr,
        )
        return 2
    configure_logging(config.logging.level, access=config.logging.access_log)

    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a declared dependency
        uvloop = None  # type: ignore[assignment]
    runner = uvloop.run if uvloop is not None else asyncio.run
    try:
        runner(_serve(config))
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


async def _serve(config) -> None:  # type: ignore[no-untyped-def]
    from gateway.app import Gateway

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
    gw = Gateway(config)
    await gw.start()
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
