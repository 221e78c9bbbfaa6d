"""Refusals: requests that can never be served, answered at once and never queued.

404 ``model_not_found`` when no known replica serves the model; 400
``context_length_exceeded`` when, on every replica whose limits are known, prompt +
max_tokens exceeds ``max_model_len`` (an engine that does not preempt: the prompt leaves
no room to generate) or the KV need exceeds the effective pool. Only an exact count is
refused (invariant 4): an estimated prompt that looks too long is cut down to what some
replica can hold and forwarded, and the engine, which counts exactly, decides.
"""

from __future__ import annotations

from dataclasses import replace

from admission.replica import Replica
from admission.types import AdmissionRequest, Refuse


def unknown_model(req: AdmissionRequest) -> Refuse:
    return Refuse(req.request_id, 404, "model_not_found", "unknown_model", req.model)


def clamp_estimate(req: AdmissionRequest, known: list[Replica]) -> AdmissionRequest | None:
    """An estimated prompt that looks too long for every replica, cut down to the largest
    request some replica can hold, so that it is forwarded and the engine decides. None
    when even a one-token prompt cannot fit: the declared ``max_tokens`` alone is over
    every limit, which is exact."""
    best: tuple[AdmissionRequest, int] | None = None
    for rep in known:
        prompt = req.prompt_tokens
        if rep.max_model_len is not None:
            output = req.max_tokens if rep.preempts else 1
            prompt = min(prompt, rep.max_model_len - output)
        if rep.capacity is not None and rep.preempts:
            room = rep.effective // rep.block_size * rep.block_size
            prompt = min(prompt, room - req.expected_output)
        if prompt < 1:
            continue
        clamped = replace(req, prompt_tokens=prompt)
        if not rep.can_ever_fit(clamped):
            continue
        size = prompt + req.expected_output
        if best is None or size > best[1]:
            best = (clamped, size)
    return best[0] if best is not None else None


def too_long(req: AdmissionRequest, known: list[Replica]) -> Refuse:
    """The 400 of a request over every known replica's context or pool."""
    limited = [r for r in known if r.max_model_len is not None]
    longest = max((r.max_model_len or 0 for r in limited), default=0)
    if limited and all(r.context_needed(req) > (r.max_model_len or 0) for r in limited):
        reason = "no_room_to_generate" if all(not r.preempts for r in limited) else "over_context"
        limit = longest
    else:
        reason = "over_pool"
        limit = max((r.effective for r in known if r.capacity is not None), default=0)
    return Refuse(
        req.request_id,
        400,
        "context_length_exceeded",
        reason,
        req.model,
        prompt_tokens=req.prompt_tokens,
        max_tokens=req.max_tokens,
        limit=limit,
        expected_output=req.expected_output,
    )


def refuse_or_clamp(req: AdmissionRequest, present: list[Replica]) -> Refuse | AdmissionRequest:
    """For a request no known replica shape can ever fit: its 400, or (an estimated
    prompt) the request cut down to forward."""
    known = [r for r in present if r.capacity is not None or r.max_model_len is not None]
    clamped = None if req.prompt_exact else clamp_estimate(req, known)
    return too_long(req, known) if clamped is None else clamped
