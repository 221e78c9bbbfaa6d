"""Process-level tuning of the serving process: the garbage collector.

Policy: once the gateway is up, everything allocated so far (config, compiled routes,
the admission ledger, imported modules) is moved out of the collector's reach
(``gc.freeze``), and the youngest generation is collected every 50,000 net container
allocations instead of CPython's 700.

Why: a request allocates a few hundred short-lived containers (the parsed body, the
context, aiohttp's request and response objects), nearly all freed by reference
counting, not by the cyclic collector. At CPython's default a young collection ran every
few requests, and each older collection walked every long-lived object; the tuned
process serves more requests a second (measured: docs/benchmarks-cost.md). The cost is
memory: cyclic garbage (an exception's traceback, a cancelled task) waits longer to be
freed, bounded by the threshold.
"""

from __future__ import annotations

import gc
import os

GEN0_THRESHOLD = 50_000


def tune_gc(gen0: int | None = None) -> None:
    """Freeze what exists now and collect the young generation less often.
    ``KVGATE_GC_GEN0`` overrides the threshold; 0 leaves the collector as CPython set it."""
    if gen0 is None:
        gen0 = int(os.environ.get("KVGATE_GC_GEN0", GEN0_THRESHOLD))
    if gen0 <= 0:
        return
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0, max(gen1, 50), max(gen2, 100))
