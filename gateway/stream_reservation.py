"""What a running stream tells admission, through the door: its first token (routing
stops counting its prefill as waiting on the replica) and that it outgrew its
reservation (a top-up). The relay reports both through this object (its `StreamHooks`)
and never reaches back into the pipeline that called it."""

from __future__ import annotations

from gateway.context import RequestContext
from gateway.door import AdmissionDoor

# A top-up asks for what the stream holds now plus an eighth (at least 16 tokens), so a
# long stream asks O(log n) times, not once per event.
_TOPUP_MIN = 16
_TOPUP_SHARE = 8


class StreamReservation:
    """The relay's `StreamHooks`, answered by admission's door."""

    def __init__(self, door: AdmissionDoor) -> None:
        self._door = door

    def first_token(self, ctx: RequestContext) -> None:
        self._door.first_token(ctx.admission_id)

    def outgrew(self, ctx: RequestContext) -> None:
        """A stream outgrew its reservation: ask for more (never cuts the stream)."""
        total = ctx.req.prompt_tokens + ctx.generated
        want = total + max(_TOPUP_MIN, total // _TOPUP_SHARE)
        door = self._door
        if ctx.admission_id and door.top_up(ctx.admission_id, want):
            res = door.report.reservation(ctx.admission_id)
            ctx.reserved = res.reserved_tokens if res else want
        ctx.topup_at = max(ctx.reserved, want)
