"""Who used the 2 cores during a contender, and who waited for them.

On this machine the engine, the API server in front of it, kvgate and the clients share
two cores, so a contender that burns CPU slows the engine it is measured on. Per
process: CPU seconds (utime + stime, all threads) and run-queue wait (the seconds its
threads were runnable but not running, from /proc/<pid>/task/<tid>/schedstat), taken
between two snapshots. Linux only; a process that is gone reads as nothing.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def _usage(pid: int) -> tuple[float, float]:
    """(cpu seconds, run-queue wait seconds) of every thread of `pid` so far."""
    cpu = wait = 0.0
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()
        cpu = (int(fields[11]) + int(fields[12])) / TICK  # utime, stime
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError):
                wait += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[1])
    return cpu, wait / 1e9


def snapshot(groups: dict[str, list[int]]) -> dict[str, tuple[float, float]]:
    """Per named group of PIDs, the summed (cpu s, wait s) so far."""
    out = {}
    for name, pids in groups.items():
        usages = [_usage(p) for p in pids]
        out[name] = (sum(u[0] for u in usages), sum(u[1] for u in usages))
    return out


def spent(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]], wall_s: float
) -> dict[str, dict[str, float]]:
    """Per group, the CPU seconds and run-queue wait seconds between the snapshots, and
    the cores it used on average (CPU seconds over `wall_s`)."""
    out = {}
    for name, (cpu, wait) in after.items():
        cpu0, wait0 = before.get(name, (0.0, 0.0))
        out[name] = {
            "cpu_s": round(cpu - cpu0, 1),
            "wait_s": round(wait - wait0, 1),
            "cores": round((cpu - cpu0) / wall_s, 2),
        }
    return out
