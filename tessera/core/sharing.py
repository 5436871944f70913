"""How one instance shares its accelerator between the models it serves.

An instance (a pod; a simulated instance) serves one model, or several of a placement group. With
several, it runs in one of two modes, and the operator, the simulator and the placement estimator all
ask ``sharing_mode`` which:

- ``co-resident``: every model's engine is resident with its own KV share (the operator's
  ``memory_plan``); requests of several models run at the same time, each on its own engine, and the
  engines share the accelerator's time. On a GPU two processes time-slice the device; on a CPU they
  share its cores. What that costs is ``CoResidentCost``: while ``n`` engines have work, each
  instance iteration (one step of every busy engine) takes ``factor(n)`` times the sum of their
  isolated step times (1.0: the steps serialise exactly; less: they overlap; more: they interfere).
- ``swapping``: the models' engines can sleep (vLLM's sleep mode, GPUs only), and exactly one is awake
  at a time; ``Decision.load_model`` swaps (sleep, then wake-up). Requests of a sleeping model wait.

A pod runs ``swapping`` only where its engines can sleep; vLLM on a CPU cannot, so a CPU pod of several
models is always co-resident (the documented fallback of ``tessera.worker.swap``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SharingMode = Literal["single", "co-resident", "swapping"]


def sharing_mode(models: int, engines_sleep: bool) -> SharingMode:
    """The mode an instance of ``models`` models runs: ``single`` for one, ``swapping`` where the engines
    can sleep, else ``co-resident``."""
    if models < 1:
        raise ValueError(f"an instance serves at least one model, got {models}")
    if models == 1:
        return "single"
    return "swapping" if engines_sleep else "co-resident"


@dataclass(frozen=True, slots=True)
class CoResidentCost:
    """Interference of co-resident engines: ``factors[n - 2]`` scales an instance iteration while ``n``
    engines are busy (one busy engine runs at its own speed; past the last entry the last one holds).

    ``source`` says where the numbers come from (``tessera profile coresident`` measures them)."""

    factors: tuple[float, ...] = (1.0,)
    source: str = "CHOICE: steps of co-resident engines serialise exactly (GPU time-slicing)"

    def __post_init__(self) -> None:
        if not self.factors or any(not f > 0 for f in self.factors):
            raise ValueError(f"co-resident factors must be positive numbers, got {self.factors}")

    def factor(self, busy_engines: int) -> float:
        """The factor on the sum of the busy engines' step times."""
        if busy_engines <= 1:
            return 1.0
        return self.factors[min(busy_engines - 2, len(self.factors) - 1)]
