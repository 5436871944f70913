"""MachineWatch: stalls of the bench process are counted per span."""

from __future__ import annotations

import sys
import time

import pytest

from tessera.bench.machine import MachineWatch


def _hold_the_interpreter(seconds: float) -> None:
    """Keep the GIL for ``seconds``: the watch thread cannot run, as if the machine stopped it."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(10.0)
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
    finally:
        sys.setswitchinterval(interval)


def test_a_stop_of_the_process_is_a_stall_of_its_span() -> None:
    with MachineWatch(tick_s=0.01, stall_s=0.1) as watch:
        time.sleep(0.05)
        mark = watch.span()
        _hold_the_interpreter(0.4)
        time.sleep(0.05)
        stalls = watch.stalls(mark)
        later = watch.span()
        time.sleep(0.05)
    assert stalls.count >= 1 and stalls.longest_s >= 0.3
    assert stalls.total_s >= stalls.longest_s
    assert watch.stalls(later).total_s < stalls.longest_s  # a new span does not see the old stall
    low, high = watch.load_range()
    assert 0 <= low <= high
    assert "longest" in stalls.describe()


def test_tick_must_be_below_the_stall_threshold() -> None:
    with pytest.raises(ValueError, match="tick_s < stall_s"):
        MachineWatch(tick_s=0.2, stall_s=0.1)
