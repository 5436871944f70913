"""QLM (Patke et al., SoCC'24): request groups, virtual queues, the RWT estimator, the MILP global
scheduler with a fallback order, and the four LLM serving operations (docs/papers.md, "QLM")."""

from tessera.core.policies.qlm.policy import QLMPolicy

__all__ = ["QLMPolicy"]
