"""Load shapes: seed 001's geometric concurrency staircase, and a mixed workload.

Both are abstract here so that importing this module does not hand Locust a shape;
the locustfile exports the one ``KVGATE_SHAPE`` names. Parameters come from the
locustfile's options (``--steps``, ``--hold``, ``--phases``), or from the constructor.
"""

from __future__ import annotations

from collections.abc import Sequence

from locust import LoadTestShape

from loadtests.users import USER_CLASSES, OpenAIUser


def parse_steps(spec: str) -> list[int]:
    """``1,2,4,8`` -> [1, 2, 4, 8]; ``x64`` -> 1, 2, 4, ... 64 (doubling)."""
    spec = spec.strip()
    if spec.startswith("x"):
        top = int(spec[1:])
        if top < 1:
            raise ValueError(f"{spec!r}: the top step must be at least 1")
        steps = [1]
        while steps[-1] * 2 <= top:
            steps.append(steps[-1] * 2)
        if steps[-1] != top:
            steps.append(top)
        return steps
    steps = [int(x) for x in spec.split(",") if x.strip()]
    if not steps or any(s < 1 for s in steps) or steps != sorted(set(steps)):
        raise ValueError(f"{spec!r}: steps are increasing positive integers, e.g. 1,2,4,8")
    return steps


class StaircaseShape(LoadTestShape):
    """Concurrency 1, 2, 4, 8, ... users, `hold_s` seconds at each step, then stop.

    Users start at once at each step (the spawn rate is the step's size per second), so a
    step's concurrency holds for nearly all of its time.
    """

    abstract = True

    def __init__(self, steps: Sequence[int] | None = None, hold_s: float | None = None) -> None:
        super().__init__()
        self._steps = list(steps) if steps is not None else None
        self._hold = hold_s

    def _options(self) -> tuple[list[int], float]:
        opts = self.runner.environment.parsed_options if self.runner is not None else None
        steps = self._steps or parse_steps(getattr(opts, "steps", "1,2,4,8,16,32,64"))
        hold = self._hold or float(getattr(opts, "hold", 60.0))
        return steps, hold

    def schedule(self) -> list[tuple[int, float, float]]:
        """(users, start, end) of every step, in seconds from the start."""
        steps, hold = self._options()
        return [(c, i * hold, (i + 1) * hold) for i, c in enumerate(steps)]

    def tick(self) -> tuple[int, float] | None:
        t = self.get_run_time()
        for users, start, end in self.schedule():
            if start <= t < end:
                return users, float(max(users, 1))
        return None


DEFAULT_PHASES = "8:chat+coding,24:batch-json,32:agentic"


def parse_phases(spec: str) -> list[tuple[int, list[type[OpenAIUser]]]]:
    """``8:chat+coding,32:all`` -> [(8, [ChatUser, CodingUser]), (32, all four)]: the
    users after each phase, and the classes the phase's new users come from."""
    phases = []
    for part in spec.split(","):
        users, _, names = part.strip().partition(":")
        chosen = list(USER_CLASSES) if names.strip() == "all" else names.split("+")
        unknown = [n for n in chosen if n.strip() not in USER_CLASSES]
        if not users.strip().isdigit() or int(users) < 1 or unknown or not chosen:
            raise ValueError(
                f"{part!r}: a phase is USERS:CLASS+CLASS with classes among "
                f"{', '.join(USER_CLASSES)} or all"
            )
        phases.append((int(users), [USER_CLASSES[n.strip()] for n in chosen]))
    return phases


class MixedShape(LoadTestShape):
    """Phases of mixed traffic, `hold_s` seconds each. A phase names the total users and
    the classes its new users come from (split by the classes' weights); users of earlier
    phases keep running, as Locust's shapes work. The default: interactive chat and
    coding (8 users), a batch job landing on them (16 batch-json users more), then agent
    sessions joining (8 more)."""

    abstract = True

    def __init__(
        self,
        phases: Sequence[tuple[int, list[type[OpenAIUser]]]] | None = None,
        hold_s: float | None = None,
    ) -> None:
        super().__init__()
        self._phases = list(phases) if phases is not None else None
        self._hold = hold_s

    def tick(self) -> tuple[int, float, list[type[OpenAIUser]]] | None:
        opts = self.runner.environment.parsed_options if self.runner is not None else None
        phases = self._phases or parse_phases(getattr(opts, "phases", DEFAULT_PHASES))
        hold = self._hold or float(getattr(opts, "hold", 60.0))
        i = int(self.get_run_time() // hold)
        if i >= len(phases):
            return None
        users, classes = phases[i]
        return users, float(users), classes
