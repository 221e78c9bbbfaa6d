"""kvgate's Locust file: four OpenAI-speaking users, and optionally a load shape.

Web UI (pick users and rates in the browser at http://127.0.0.1:8089)::

    locust -f loadtests/locustfile.py --host http://127.0.0.1:8080

Headless, one class, fixed users::

    locust -f loadtests/locustfile.py --host http://127.0.0.1:8080 --headless \\
        -u 8 -r 8 -t 2m BatchJsonUser

Headless with a shape (``KVGATE_SHAPE=staircase`` or ``mixed``)::

    KVGATE_SHAPE=staircase locust -f loadtests/locustfile.py --host URL --headless \\
        --steps 1,2,4,8,16 --hold 60 BatchJsonUser

The users are in `loadtests.users`, the shapes in `loadtests.shapes`; the options they
read (``--model``, ``--timeout``, ``--prompt-tokens``, ``--prompt-file``...) are listed by
``locust -f loadtests/locustfile.py --help``.
"""

from __future__ import annotations

import os

from locust import events

from loadtests.users import AgenticUser, BatchJsonUser, ChatUser, CodingUser, add_arguments

__all__ = ["AgenticUser", "BatchJsonUser", "ChatUser", "CodingUser"]


@events.init_command_line_parser.add_listener
def _options(parser) -> None:  # type: ignore[no-untyped-def]
    add_arguments(parser)


_SHAPE = os.environ.get("KVGATE_SHAPE", "").strip().lower()
if _SHAPE == "staircase":
    from loadtests.shapes import StaircaseShape

    class Staircase(StaircaseShape):
        abstract = False

elif _SHAPE == "mixed":
    from loadtests.shapes import MixedShape

    class Mixed(MixedShape):
        abstract = False

elif _SHAPE:
    raise SystemExit(f"KVGATE_SHAPE={_SHAPE!r}: expected staircase or mixed")
