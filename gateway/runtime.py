"""Process-level tuning of the serving process: the garbage collector.

Policy: once the gateway is up, everything allocated so far (config, compiled routes,
the admission ledger, imported modules) is moved out of the collector's reach
(``gc.freeze``), and the youngest generation is collected every 50,000 net container
allocations instead of CPython's 700.

Why: a request allocates a few hundred short-lived containers (the parsed body, the
context, aiohttp's request and response objects), nearly all freed by reference
counting, not by the cyclic collector. At CPython's default a young collection ran every
few requests, and each older collection walked every long-lived object; under load that
was a fifth of the process's CPU (bench/results/profile_after.txt: ~20% more requests/s
with the thresholds below, paired rounds). The cost is memory: cyclic garbage (an
exception's traceback, a cancelled task) waits longer to be freed, bounded by the
threshold.
"""

from __future__ import annotations

import gc

GEN0_THRESHOLD = 50_000


def tune_gc(gen0: int = GEN0_THRESHOLD) -> None:
    """Freeze what exists now and collect the young generation less often."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0, max(gen1, 50), max(gen2, 100))
