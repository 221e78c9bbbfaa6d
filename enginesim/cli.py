"""`enginesim`: run a simulated LLM engine replica from the command line.

    enginesim serve --profile tiny --port 8001 [--host 127.0.0.1] [--speed 1.0]
                    [--flavor vllm|sglang|llamacpp] [--seed 0]
                    [--speculative | --no-speculative]
                    [--kv-unified | --no-kv-unified] [--cache-ram MIB] [--kv-cache-metrics]
                                                                     (llamacpp only)
                    [--fault MODE [--fault-status N] [--fault-factor X] [--fault-after-tokens N]
                    [--fault-delay-s S]]
                    [--lora-modules NAME=PATH|JSON ...]                (vllm only)
    enginesim profiles

`--flavor llamacpp` (or a profile with `flavor: llamacpp`, such as `llamacpp-tiny`) serves
llama.cpp's llama-server: slots, `/props`, `/slots`, `llamacpp:` metrics, no preemption.
Its KV layout is per slot unless `--kv-unified` (or the profile's `kv_unified: true`) makes
it one pool shared by all slots. `--cache-ram` sizes llama-server's host-RAM prompt
cache (MiB; 0 turns it off, -1 no limit; default 8,192, as llama-server's).
`--kv-cache-metrics` adds the two KV gauges that llama-server builds before May 2025
exported (`llamacpp:kv_cache_usage_ratio`, `llamacpp:kv_cache_tokens`).

`--lora-modules` serves LoRA adapters as vLLM's flag of that name does: each
`name=path` (or `{"name": ..., "path": ..., "base_model_name": ...}`) is a model of its
own in `/v1/models` (`parent` its base) that requests may name (`enginesim.lora`).

The server runs on uvloop. SIGINT and SIGTERM stop it cleanly; the `crash` fault ends the
process with exit status 1, as a crashing engine would.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence

from enginesim.faults import FaultConfig, FaultConfigError, FaultMode, make_fault
from enginesim.lora import LoraModule, parse_lora_module


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _lora_module(text: str) -> LoraModule:
    try:
        return parse_lora_module(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="enginesim",
        description=(
            "A simulated vLLM/SGLang/llama.cpp replica speaking the OpenAI API on a virtual clock."
        ),
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve one simulated replica over HTTP")
    serve.add_argument("--profile", required=True, help="bundled profile name or YAML path")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    serve.add_argument(
        "--speed",
        type=_positive_float,
        default=1.0,
        help="virtual seconds per wall second (20 runs the engine 20x faster)",
    )
    serve.add_argument("--flavor", choices=["vllm", "sglang", "llamacpp"], default=None,
                       help="engine imitated (default: the profile's)")  # fmt: skip
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument(
        "--speculative",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="force speculative decoding on or off (default: as the profile says)",
    )
    serve.add_argument(
        "--kv-unified",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="llamacpp: one KV pool shared by all slots instead of n_ctx / slots each "
        "(default: as the profile says)",
    )
    serve.add_argument(
        "--cache-ram",
        type=int,
        default=None,
        metavar="MIB",
        help="llamacpp: host-RAM prompt cache size, 0 off, -1 no limit (default: the profile's)",
    )
    serve.add_argument(
        "--kv-cache-metrics",
        action="store_true",
        help="llamacpp: also export llamacpp:kv_cache_usage_ratio and kv_cache_tokens, "
        "as llama-server builds before May 2025 did",
    )
    serve.add_argument(
        "--fault",
        choices=[m.value for m in FaultMode],
        default=None,
        help="start with this fault injected (changeable at runtime via POST /admin/faults)",
    )
    serve.add_argument("--fault-status", type=int, default=None, help="HTTP status for 'error'")
    serve.add_argument("--fault-factor", type=float, default=None, help="slowdown for 'slow'")
    serve.add_argument(
        "--fault-after-tokens",
        type=int,
        default=None,
        help="tokens before 'drop' closes a connection / before 'crash' happens",
    )
    serve.add_argument(
        "--fault-delay-s", type=float, default=None, help="how late 'slow_metrics' answers"
    )
    serve.add_argument(
        "--lora-modules",
        type=_lora_module,
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="vllm: serve LoRA adapters as models (name=path, or vLLM's JSON form)",
    )
    serve.add_argument("--log-level", default="INFO")

    sub.add_parser("profiles", help="list the bundled profiles")
    return parser


async def _serve(args: argparse.Namespace, fault: FaultConfig | None) -> int:
    from enginesim.llamacpp import LlamaCppCore
    from enginesim.server import EngineServer

    server = EngineServer(
        args.profile,
        host=args.host,
        port=args.port,
        speed=args.speed,
        flavor=args.flavor,
        seed=args.seed,
        speculative=args.speculative,
        fault=fault,
        exit_on_crash=True,
        kv_unified=args.kv_unified,
        kv_cache_metrics=args.kv_cache_metrics,
        cache_ram_mib=args.cache_ram,
        lora_modules=args.lora_modules,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await server.start()
    p = server.profile
    core = server.core
    if isinstance(core, LlamaCppCore):
        logging.getLogger("enginesim").info(
            "enginesim serving %s (profile %s, flavor llamacpp, n_ctx %d, %d slots of %d "
            "cells, kv_unified %s, speed %gx) on %s",
            server.model_name, p.name, core.n_ctx, core.n_slots, core.slot_n_ctx,
            core.kv_unified, args.speed, server.url,
        )  # fmt: skip
    else:
        logging.getLogger("enginesim").info(
            "enginesim serving %s (profile %s, flavor %s, pool %d tokens = %d blocks x %d, "
            "max_model_len %d, speed %gx) on %s",
            server.model_name, p.name, server.flavor, p.num_gpu_blocks * p.block_size,
            p.num_gpu_blocks, p.block_size, p.max_model_len, args.speed, server.url,
        )  # fmt: skip
    # A line a supervising script can wait for, with the port actually bound.
    print(f"enginesim ready {server.url}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "profiles":
        from enginesim.profiles import list_profiles

        for name in list_profiles():
            print(name)
        return 0

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    fault = None
    if args.fault is not None:
        try:
            fault = make_fault(
                args.fault,
                status=args.fault_status,
                factor=args.fault_factor,
                after_tokens=args.fault_after_tokens,
                delay_s=args.fault_delay_s,
            )
        except FaultConfigError as exc:
            parser.error(f"--fault-{(exc.param or 'mode').replace('_', '-')}: {exc}")
    elif any(
        v is not None
        for v in (args.fault_status, args.fault_factor, args.fault_after_tokens, args.fault_delay_s)
    ):
        parser.error(
            "--fault-status/--fault-factor/--fault-after-tokens/--fault-delay-s need --fault"
        )

    from enginesim.profiles import ProfileError, load_profile
    from enginesim.types import Flavor

    try:
        args.profile = load_profile(args.profile)
    except ProfileError as exc:
        parser.error(str(exc))
    flavor = Flavor(args.flavor) if args.flavor else args.profile.flavor
    if flavor is Flavor.LLAMACPP:
        if args.speculative:
            parser.error("--speculative: the llamacpp flavor does not model speculative decoding")
        args.speculative = False
        if args.cache_ram is not None and args.cache_ram < -1:
            parser.error("--cache-ram: must be -1 (no limit), 0 (off) or a size in MiB")
    elif args.kv_unified is not None or args.kv_cache_metrics or args.cache_ram is not None:
        parser.error("--kv-unified, --cache-ram and --kv-cache-metrics need the llamacpp flavor")
    if args.lora_modules:
        from enginesim.lora import lora_table

        if flavor is not Flavor.VLLM:
            parser.error("--lora-modules: the simulator serves LoRA adapters as vLLM does")
        try:
            lora_table(args.lora_modules, args.profile.served_model_name)
        except ValueError as exc:
            parser.error(f"--lora-modules: {exc}")

    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a declared dependency
        return asyncio.run(_serve(args, fault))
    return uvloop.run(_serve(args, fault))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
