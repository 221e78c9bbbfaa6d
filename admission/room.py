"""Deadline room: how many requests a replica may run without slowing one it runs past
its client's deadline (sans-IO).

A running request whose client's budget bounds its whole response (a stated timeout, or
the patience learned for clients that state none: `Reservation.due`) has a predicted rest
of service: the replica's upper estimate of its service at the load it serves at
(admission/learned/service.py), less the time it has run. Service stretches with the load by the
learned share ``k`` of a proportional growth (`ServiceModel.elasticity`), so at a load of
``L'`` instead of ``L`` the rest becomes ``rest * (1 + k * (L' / L - 1))``, which ends in
the time left while ``L' <= L * (1 + (left / rest - 1) / k)``. The room is the least of
these bounds over the replica's running requests.

Admission takes another request to the replica only while ``running + 1 <= room``
(`Ledger.fits_now`), whatever the learned limit allows (admission/learned/limit.py); the
load and the running count are the whole replica's, every gateway process's requests there.
A request already predicted late counts too: the replica takes nothing more until enough
of its batch has finished for that request to make its time, or it ends. A last retry out
of time to start is taken all the same, as it is past the learned limit: shed, it fails
for sure, while the room rests on an upper estimate.

Why: the learned limit judges windows of completions, after the fact, and a window's
slowest is whichever long answer it happened to hold. The requests a batch loses are its
longest ones started at a load that leaves them no time: on `kvgate demo`'s job (45 s
timeouts, outputs of 40-200 tokens) a 200-token answer takes about 45 s at the limit of 9
the windows settle on, and one started there, or during slow start on a service predicted
from the first few completions, timed out while the limit held or grew. Held by this room,
the job lost 4 requests of 73,800 over 100 workload seeds in virtual time, against 22
(bench/first_wave_vt.py; docs/admission.md, "Deadlines"), for a few more losses on the
real vLLM's flatter service (SDK 66 -> 69, plain 50 -> 53 of 18,000).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Protocol

from admission.learned.service import ServiceModel


class Running(Protocol):
    """What the room reads of a running request (admission.ledger.Reservation)."""

    due: float  # when its client gives up on it (inf: its budget does not bound it)
    admitted_at: float
    prompt_tokens: int
    output_tokens: int


def deadline_room(
    service: ServiceModel, load: int, running: Iterable[Running], now: float
) -> float:
    """The most requests the replica may run with every one of `running` still predicted
    to end before its client gives up (module docstring); inf when none is bounded, before
    any service was seen, or where service does not grow with the load."""
    if not len(service):
        return math.inf
    k = service.elasticity()
    if k <= 0:
        return math.inf
    plane = service.plane(load)
    assert plane is not None
    room = math.inf
    for res in running:
        left = res.due - now
        rest = plane.at(res.prompt_tokens, res.output_tokens) - (now - res.admitted_at)
        if left <= 0 or rest <= 0:
            continue  # its client has gone, or it is done by the prediction: nothing to keep
        # rest * (1 + k * (room / load - 1)) = left
        bound = load * (1.0 + (left / rest - 1.0) / k)
        if bound < room:
            room = bound
    return room
