"""`static` (the seed's baseline): request-level batches with a fixed collection
window (`window_ms`, from the oldest waiting arrival) or `max_batch` requests, whichever
comes first; each batch runs to completion and returns all its results together. The
mechanics and the padding accounting are in `request_level`."""
from __future__ import annotations

from batchserve.core.policies.request_level import RequestLevelPolicy


class StaticPolicy(RequestLevelPolicy):
    name = "static"
