"""Shared state for several gateway processes: one interface, two backends.

A replica's KV pool, its running limit and a tenant's budget are properties of the
replica or the tenant, not of one gateway process. When several processes (``kvgate
serve --workers N``, or several hosts) front the same replicas, they must divide them.
They do so by *leases*, as Google's Doorman divides a global rate limit:

- Each process leases a slice of each shared resource (a replica's effective pool in
  tokens, its running limit in requests, a tenant's budget in units) and admits from its
  slice locally: the request path never waits on the backend.
- A background loop in the gateway shell (`gateway.state.sharing`) renews the slices every
  ``renew_interval_s`` (and at once when requests queue behind a slice). A slice asks
  for what the process holds and has queued plus a little spare (its *want*).
- The arithmetic (`admission.lease.grant`) runs atomically in the backend (a Lua
  script on Redis): expired holders are dropped; when the wants fit the total, each gets
  its want and what nobody wants is split equally (a lone process holds the whole);
  when they do not, the shares are max-min fair (an equal split, and more where others
  want less); a grant never exceeds what others do not hold
  (each holder counts the larger of its grant and its reported use). So the sum over
  processes never exceeds the total, and a busy process can use most of a pool while the
  others idle.
- Every lease has a TTL (``lease_ttl_s``): a process that dies stops renewing and its
  slice returns to the others within the TTL. A process that stops cleanly returns its
  slices at once.
- Re-registering is idempotent: a lease is one record per (resource, process), written
  from the process's own truth (what it holds now), so a backend that restarts empty is
  rebuilt without double counting.

Learned running limits are shared the same way a setting is: the latest value any
process learned for a replica is published with a version; the others adopt it.

`MemoryBackend` keeps all of this in the process (the default: one process, no Redis);
`RedisBackend` keeps it in Redis. Both pass the same contract tests.
"""

from __future__ import annotations

from admission.lease import HolderRecord, Lease, LeaseRequest, RenewResult, SharedLimit
from gateway.state.backend import StateBackend, StateUnavailable
from gateway.state.memory import MemoryBackend

__all__ = [
    "HolderRecord",
    "Lease",
    "LeaseRequest",
    "MemoryBackend",
    "RenewResult",
    "SharedLimit",
    "StateBackend",
    "StateUnavailable",
]
