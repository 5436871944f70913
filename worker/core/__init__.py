"""The engine-agnostic scheduling core.

Policies are pure objects over queue state and a time passed in; engines (the
simulator, the real-vLLM adapter) apply their decisions. See DESIGN.md, "The
keystone".
"""

from tessera.worker.core.policy import Decision, InstanceView, Policy
from tessera.worker.core.profile import StepProfile
from tessera.worker.core.request import Phase, Request, ServiceClass
from tessera.worker.core.timeline import TokenTimeline

__all__ = [
    "Decision",
    "InstanceView",
    "Phase",
    "Policy",
    "Request",
    "ServiceClass",
    "StepProfile",
    "TokenTimeline",
]
