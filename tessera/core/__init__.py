"""The engine-agnostic scheduling core.

Policies are pure objects over queue state and a time passed in; engines (the
simulator, the real-vLLM adapter) apply their decisions. See docs/architecture.md,
"The rule".
"""

from tessera.core.policy import Decision, InstanceView, Policy
from tessera.core.profile import StepProfile
from tessera.core.request import Phase, Request, ServiceClass
from tessera.core.timeline import TokenTimeline

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
