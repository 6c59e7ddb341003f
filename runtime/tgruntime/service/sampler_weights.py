"""The lifecycle of in-memory sampler weights (``save_weights_and_get_sampling_client``).

Each such call keeps a copy of the model's weights (a LoRA run's adapters) on every rank
under ``<model_id>/ephemeral/<n>``. An RL loop makes one per step, so nothing may keep them
all: when a model makes a newer copy, the older one is *superseded*, and it is dropped from the
group as soon as no sample request on it is in flight (queued in the service or running in the
group). A later request on a dropped copy is refused with what happened and what to do; a copy
written to disk (``save_weights_for_sampler(name)``) is not managed here: it stays sampleable
by its path.

``save_weights_and_get_sampling_client(kind="inflight")`` makes no copy per call: every
inflight sampling client of a model samples the model's current weights. On a full-weight group
those are the training weights themselves (the session's weights are None: nothing is copied);
on a LoRA group they are the run's adapters written at each inflight save into one target per
model, ``<model_id>/ephemeral/inflight`` (:func:`inflight_name`; one adapter's bytes, whatever
the count of saves, since a run's live adapters leave the model's hooks while another run
trains). The target is never superseded by a save, snapshot or inflight; it goes with its
model.

Pure bookkeeping: the caller sends the drops this returns to the group.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from tgapi.errors import PicklableError

__all__ = ["EphemeralWeights", "FreedWeights", "inflight_name"]


def inflight_name(model_id: str) -> str:
    """The one in-memory target of ``model_id``'s inflight sampling clients (a LoRA group)."""
    return f"{model_id}/ephemeral/inflight"


class FreedWeights(PicklableError, LookupError):
    """A request named in-memory sampler weights that were superseded and freed."""


@dataclass
class EphemeralWeights:
    newest: dict[str, str] = field(default_factory=dict)  # model id -> its newest copy
    pending: Counter[str] = field(default_factory=Counter)  # copy -> requests in flight
    superseded: set[str] = field(default_factory=set)  # replaced, not yet dropped
    freed: dict[str, str] = field(default_factory=dict)  # dropped copy -> the model's newer one
    max_freed: int = 4096  # names remembered for the refusal's message (oldest forgotten)
    inflight: dict[str, str] = field(default_factory=dict)  # model id -> its inflight target
    # model id -> the one sampling session every inflight save of it answers with (they all
    # sample the same current weights: a session per save only piled up in the registry)
    inflight_sessions: dict[str, str] = field(default_factory=dict)

    def inflight_saved(self, model_id: str, weights: str) -> None:
        """``model_id`` wrote its inflight target ``weights`` (in place: nothing to drop)."""
        self.inflight[model_id] = weights

    def models(self) -> set[str]:
        """The models with an in-memory copy or an inflight target."""
        return set(self.newest) | set(self.inflight)

    def names(self) -> set[str]:
        """The in-memory copies and targets the group holds that this bookkeeping knows of."""
        return set(self.newest.values()) | self.superseded | set(self.inflight.values())

    def saved(self, model_id: str, weights: str) -> list[str]:
        """``model_id`` made the copy ``weights``: the copies to drop now."""
        old = self.newest.get(model_id)
        self.newest[model_id] = weights
        if old is None or old == weights:
            return []
        self.superseded.add(old)
        return self._droppable(old, newer=weights)

    def begin(self, weights: str | None) -> None:
        """A sample request on ``weights`` is accepted (raises FreedWeights for a freed copy)."""
        if weights is None:
            return
        if weights in self.freed:
            newer = self.newest.get(_model_of(weights), self.freed[weights])
            raise FreedWeights(
                f"the sampling client's weights ({weights}) were freed: the same training "
                f"client saved newer ones ({newer}) and nothing was still "
                "sampling from these. Sample from the sampling client of the newest "
                "save_weights_and_get_sampling_client, or keep weights with "
                "save_weights_for_sampler(name) and sample from its tinker:// path"
            )
        self.pending[weights] += 1

    def end(self, weights: str | None) -> list[str]:
        """A sample request on ``weights`` finished (either way): the copies to drop now."""
        if weights is None or self.pending[weights] <= 0:
            return []
        self.pending[weights] -= 1
        if self.pending[weights] == 0:
            del self.pending[weights]
        return self._droppable(weights, newer=None)

    def forget_model(self, model_id: str) -> list[str]:
        """The model is gone (its session ended): its newest copy and its inflight target go
        too, once idle."""
        drops: list[str] = []
        self.inflight_sessions.pop(model_id, None)
        for old in (self.newest.pop(model_id, None), self.inflight.pop(model_id, None)):
            if old is not None:
                self.superseded.add(old)
                drops += self._droppable(old, newer=None)
        return drops

    def resident(self) -> int:
        """Copies the group holds that this bookkeeping knows of."""
        return len(self.names())

    def _droppable(self, weights: str, *, newer: str | None) -> list[str]:
        if weights not in self.superseded or self.pending[weights] > 0:
            return []
        self.superseded.discard(weights)
        self.freed[weights] = newer or self.newest.get(
            _model_of(weights), "none: its session ended"
        )
        while len(self.freed) > self.max_freed:
            del self.freed[next(iter(self.freed))]
        return [weights]


def _model_of(weights: str) -> str:
    return weights.split("/ephemeral/", 1)[0]
