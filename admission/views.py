"""Per-model views of the replicas and their headroom orders, kept incrementally.

A decision reads one model's replicas: which are present, one per fit shape (the fit
checks are computed once per shape), the headroom orders that shortlist candidates, and
the predicted-service maxima (admission/candidates.py states the policy). A view is
rebuilt only when a replica's shape, readiness, models or presence change; its orders
and predictions follow every reserve, release and top-up (`touch`), brought up to date
when a decision reads them: a replica that a release returns to where its reservation
took it, or that several completions and top-ups move between two decisions, is placed
once, not once a change.

Nothing here decides anything: it is bookkeeping of the ledger's own numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from admission.candidates import HeadroomIndex, PredictMax
from admission.replica import Replica
from admission.types import AdmissionRequest


@dataclass(slots=True)
class ModelView:
    """One model's replicas as a decision reads them."""

    present: list[Replica]
    known_shapes: list[Replica]  # one present replica per shape, with a known limit
    usable_shapes: list[Replica]  # one usable replica per shape
    usable_names: list[frozenset[str]]  # the usable replicas of each of those shapes
    order: HeadroomIndex  # read through `ModelViews.orders`
    ttft: PredictMax
    service: PredictMax
    dirty: set[str]  # replicas whose predicted lines are to be refreshed
    moved: set[str]  # replicas whose place in the orders is to be refreshed
    shares_prefix: bool  # some replica counts shared prefixes (admission.prefixshare)
    largest_pool: int  # the largest effective pool of its present replicas


class ModelViews:
    """The per-model views over one replica table (the ledger's)."""

    def __init__(self, replicas: dict[str, Replica]) -> None:
        self._replicas = replicas
        self._by_model: dict[str, list[Replica]] | None = None  # None: rebuild on use
        self._views: dict[str, ModelView] = {}  # model -> its view; cleared on a change
        self._views_of: object = None  # the `_by_model` index the views were built on

    def membership_changed(self) -> None:
        """A replica's models or presence changed: the per-model index is rebuilt."""
        self._by_model = None

    def serving(self, model: str) -> list[Replica]:
        """Replicas that list `model` (present or not), from a per-model index rebuilt
        only when a replica's models or presence change."""
        index = self._by_model
        if index is None:
            index = {}
            for rep in self._replicas.values():
                for m in rep.models:
                    index.setdefault(m, []).append(rep)
            self._by_model = index
        return index.get(model, [])

    def view(self, model: str) -> ModelView:
        """`model`'s view, rebuilt when the replica index was."""
        index = self._by_model
        if index is None:
            self.serving(model)
            index = self._by_model
        if self._views_of is not index:
            self._views.clear()
            self._views_of = index
        view = self._views.get(model)
        if view is not None:
            return view
        present = [r for r in self.serving(model) if r.present]
        known: dict[tuple[object, ...], Replica] = {}
        usable: dict[tuple[object, ...], Replica] = {}
        names: dict[tuple[object, ...], set[str]] = {}
        for r in present:
            shape = r.shape()
            if r.capacity is not None or r.max_model_len is not None:
                known.setdefault(shape, r)
            if r.usable:
                usable.setdefault(shape, r)
                names.setdefault(shape, set()).add(r.name)
        view = ModelView(
            present,
            list(known.values()),
            list(usable.values()),
            [frozenset(names[shape]) for shape in usable],
            HeadroomIndex(),
            PredictMax(),
            PredictMax(),
            {r.name for r in present},
            set(),
            any(r.sharing for r in present),
            max((r.effective for r in present), default=0),
        )
        for r in present:
            _order(view, r)
        self._views[model] = view
        return view

    def touch(self, rep: Replica) -> None:
        """The ledger of `rep` changed (reserve, release, top-up, limit, share): follow
        it in the views of its models, and recompute its deadline room at its next use
        (the load it serves at may have moved)."""
        rep.room_stale = True
        views = self._views
        name = rep.name
        for model in rep.models:
            view = views.get(model)
            if view is not None:
                view.moved.add(name)
                view.dirty.add(name)

    def orders(self, view: ModelView) -> HeadroomIndex:
        """`view`'s headroom orders, with the replicas touched since the last read placed
        by their ledger now."""
        moved = view.moved
        if moved:
            replicas = self._replicas
            for name in moved:
                rep = replicas.get(name)
                if rep is not None:
                    _order(view, rep)
            moved.clear()
        return view.order

    def replica_changed(self, rep: Replica) -> None:
        """After a replica's view, readiness or presence may have changed: rebuild the
        model views when what they group it by did, else just follow its ledger. Any
        code that changes a replica's pool (`effective`), readiness or models calls it."""
        sig = (rep.present, rep.usable, rep.models, rep.shape(), rep.sharing)
        if sig != rep.sig:
            rep.sig = sig
            rep.room_stale = True
            self._views.clear()
        else:
            self.touch(rep)

    def predict(self, req: AdmissionRequest, view: ModelView) -> float:
        """Predicted service of `req` once admitted (a stream whose budget bounds its
        first token: that time), an
        upper bound of the largest of its replicas' upper estimates (`ServiceModel`), from
        per-model maxima refreshed only for replicas that changed (`PredictMax`); 0
        before any sample. An upper estimate, not a typical one: a request admitted at
        its deadline with a typical prediction would time out half the time."""
        if view.dirty:
            for name in view.dirty:
                rep = self._replicas.get(name)
                if rep is None or not rep.present:
                    view.ttft.remove(name)
                    view.service.remove(name)
                    continue
                load = rep.serving_load
                for model, target in ((rep.ttft, view.ttft), (rep.service, view.service)):
                    plane = model.plane(load)
                    if plane is None:
                        target.remove(name)
                    else:
                        target.set(name, *plane)
            view.dirty.clear()
        if req.stream and not req.budget_whole:
            return view.ttft.predict(req.prompt_tokens)
        return view.service.predict(max(1, req.prompt_tokens), max(0, req.expected_output))


def _order(view: ModelView, rep: Replica) -> None:
    """Place `rep` in `view`'s headroom orders by the ledger now."""
    free = rep.free / rep.effective if rep.effective > 0 else 0.0
    allowed = rep.allowed
    if allowed is None:
        run = 1.0 / (1.0 + rep.running)
    else:
        run = max(0.0, 1.0 - rep.running / allowed) if allowed > 0 else 0.0
    view.order.update(rep.name, free, run)
