"""The ledger's read models. ``all_projections()`` lists every one, for runners and replay."""

from __future__ import annotations

from ledger.views.keys import KeysProjection
from ledger.views.projection import Projection
from ledger.views.requests import RequestViewProjection
from ledger.views.spend import SpendProjection

__all__ = ["KeysProjection", "RequestViewProjection", "SpendProjection", "all_projections"]


def all_projections() -> list[Projection]:
    return [KeysProjection(), RequestViewProjection(), SpendProjection()]
