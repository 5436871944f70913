"""What the router and the batch component (``tessera batch``) say to each other, and the deadline a
batch line carries to the worker.

The two share one secret (``TESSERA_BATCH_TOKEN`` in both processes' environment; on a cluster, one
Secret key). Each request between them carries it in ``x-tessera-batch-token``:

- router -> batch component (``/v1/files``, ``/v1/batches``): the router has authenticated the client
  and names its tenant (``x-tessera-tenant``), the models it may use that are served
  (``x-tessera-models``, comma-separated) and the batch classes it may use with the header that selects
  each (``x-tessera-batch-classes``, JSON ``{name: [header, value]}``); the batch component believes
  those headers only with the token, so files and batches are scoped to the API key's tenant.
- batch component -> router (each line, as a request of the batch class): the token marks the request
  as the feeder's, the only one whose ``x-tessera-deadline`` the router accepts (any other client's is
  refused with 403). The router drops the token and forwards the deadline to the worker, which trusts
  it as it trusts the class header: workers are reached through the router.

``x-tessera-deadline`` is an absolute time, seconds since the Unix epoch (the batch's ``expires_at``),
so that it means the same on every machine; the router and the worker turn it into their own clock.

What the feeder has not sent yet is out of every queue the autoscaler reads, so the batch component
exports it on its ``/metrics`` (no token: aggregates by model and class only), and the operator's
queries and local mode's scrapes count it in Chiron's global queue: ``PENDING_METRIC`` (the lines of
the batches in progress not sent yet), ``DEADLINE_METRIC`` (the Unix time of the earliest expiry among
them), ``OUTPUT_MEAN_METRIC`` and ``OUTPUT_STD_METRIC`` (the output lengths of those batches' answered
lines: the μ_o and σ_o of Chiron's waiting-time estimate), each labelled ``model`` and ``class``.
"""

from __future__ import annotations

import math

TOKEN_ENV = "TESSERA_BATCH_TOKEN"
TOKEN_HEADER = "x-tessera-batch-token"
TENANT_HEADER = "x-tessera-tenant"
MODELS_HEADER = "x-tessera-models"
CLASSES_HEADER = "x-tessera-batch-classes"
DEADLINE_HEADER = "x-tessera-deadline"
PENDING_METRIC = "tessera_batch_pending_lines"
DEADLINE_METRIC = "tessera_batch_earliest_deadline_seconds"
OUTPUT_MEAN_METRIC = "tessera_batch_output_tokens_mean"
OUTPUT_STD_METRIC = "tessera_batch_output_tokens_stddev"
NO_KEYS_TENANT = "default"  # the tenant of every caller of a router without API keys


def parse_deadline(value: str) -> float:
    """The Unix time of an ``x-tessera-deadline`` value; ValueError naming the header otherwise."""
    try:
        deadline = float(value)
    except ValueError:
        deadline = math.nan
    if not math.isfinite(deadline) or deadline <= 0:
        raise ValueError(f"{DEADLINE_HEADER} must be a Unix time in seconds (> 0), got {value!r}")
    return deadline


def to_clock(deadline_unix: float, now_unix: float, now_clock: float) -> float:
    """``deadline_unix`` on another clock that reads ``now_clock`` when the Unix time is ``now_unix``."""
    return now_clock + (deadline_unix - now_unix)
