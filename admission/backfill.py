"""Backfill: a later queued request starts past a waiting head when it cannot delay it.

The queue keeps strict order per replica (admission/settling.py): an entry that does not
fit blocks the replicas it could run on. Where the pool binds, that leaves a fragment of
the pool idle whenever the head is larger than what is free: on the real vLLM the
8,192-token pool holds five or six of seed 001's requests whole (600-1,800 prompt
tokens), and a head of 1,900 waits beside 1,500 free tokens that a request of 700 could
use. EASY backfilling (Lifka, 1995; what Slurm's backfill scheduler does) uses it
without starving the head. The head gets a *shadow*: the moment the running requests
predicted to end first have freed enough for it. The *room* is what is left beside it
then: the tokens free by that moment less its need. A later entry that fits now and
within the room starts now; at the shadow it still runs beside the head, so the head
starts when it would have. Each such start shrinks the room. Running slots need no room
of their own: a later entry takes one only if one is free now, and by the shadow at
least one running request has ended, which leaves the head its slot.

Only the order of the running requests' ends is predicted, never how long a backfilled
request runs: ends are their admission plus the replica's service plane for their prompt
and output (admission/service.py), whose load scaling and margin are the same for all.
Without a service sample there is no order, and the head blocks its replicas as before.
What an end frees is the reservation's private tokens (a shared prefix's blocks may stay
pinned by others), and an abandoned reservation held for the engine ends when its hold
does, so the room errs small. If the ends come in another order, the head waits at most
until enough has ended, as it would behind any misjudged request.
"""

from __future__ import annotations

import math

from admission.ledger import Ledger
from admission.replica import Replica
from admission.types import AdmissionRequest


def room_beside(ledger: Ledger, rep: Replica, head: AdmissionRequest, now: float) -> int | None:
    """The tokens of room beside `head`, which does not fit `rep` now, at its shadow
    there; None when `rep` has none to offer: the head waits for a running slot (a later
    entry would need one too), the order of the ends is unknown, or what runs never frees
    the head's need."""
    allowed = rep.allowed
    if allowed is not None and rep.running >= allowed:
        return None
    plane = rep.service.plane(allowed or rep.running + 1)
    if plane is None:
        return None
    need = Ledger.need(rep, head, now)[0]
    free = rep.free
    ends = sorted(
        (
            res.held_until
            if res.held_since is not None
            else res.admitted_at + plane.at(res.prompt_tokens, res.output_tokens),
            res.tokens,
        )
        for res in ledger.on_replica(rep.name)
    )
    for at, tokens in ends:
        if not math.isfinite(at):
            return None
        free += tokens
        if free >= need:
            return free - need
    return None
