"""Chiron's mechanisms, once: the local autoscaler as a policy wrapper, the dispatch of interactive
requests, the global queue, and one global-autoscaler step per placement group.

The worker, the simulator, the operator and local mode all run these objects; each only measures and
acts its own way (HTTP and vLLM, a virtual clock, Prometheus and StatefulSets, worker processes).
"""

from tessera.core.chiron.autoscale import (
    ArrivalMeter,
    GroupEvaluation,
    GroupMemory,
    evaluate_group,
    instance_tokens_per_s,
    spike_p99,
)
from tessera.core.chiron.dispatch import (
    PREFILL_BACKLOG_S,
    DispatchQueue,
    DispatchTarget,
    chiron_pick,
    chiron_place,
    has_room,
    prefill_fits,
)
from tessera.core.chiron.global_queue import (
    ORPHAN_WAIT_S,
    GlobalQueue,
    PullCandidate,
    RunningStats,
    batch_pulls,
    batch_room,
    interactive_lends,
)
from tessera.core.chiron.local import BATCH_ITL_S, INTERACTIVE_ITL_S, ChironLocal, ChironPolicy

__all__ = [
    "BATCH_ITL_S",
    "INTERACTIVE_ITL_S",
    "ORPHAN_WAIT_S",
    "PREFILL_BACKLOG_S",
    "ArrivalMeter",
    "ChironLocal",
    "ChironPolicy",
    "DispatchQueue",
    "DispatchTarget",
    "GlobalQueue",
    "GroupEvaluation",
    "GroupMemory",
    "PullCandidate",
    "RunningStats",
    "batch_pulls",
    "batch_room",
    "chiron_pick",
    "chiron_place",
    "evaluate_group",
    "has_room",
    "instance_tokens_per_s",
    "interactive_lends",
    "prefill_fits",
    "spike_p99",
]
