"""SeaLLM doubling-budget scheduling: budget mechanics, one service per batch, Fig. 2 ordering."""

from __future__ import annotations

import pytest

from tessera.core import InstanceView, Request, StepProfile
from tessera.core.policies.seallm import DBBook, DoublingBudget, ServiceStats

PROFILE = StepProfile("t", 0.01, 0.0, 0.0, 0.01, 0.0, kv_capacity_tokens=100_000)


def view(now, running, max_batch=8):
    return InstanceView(now, "i", tuple(running), max_batch, 100_000, 0, PROFILE)


def test_budget_doubles_geometrically_at_exhaustion():
    book = DBBook({"a": ServiceStats(mean_exec_s=1.0, std_exec_s=0.5)})
    b = book.start("a", 0.0)
    assert b.left == 1.5
    book.charge("a", b, 1.0, 1.0)
    assert b.left == pytest.approx(0.5) and b.renewals == 0
    book.charge("a", b, 0.5, 1.5)
    assert (b.left, b.renewals) == (3.0, 1)  # 2·Q⁰
    book.charge("a", b, 3.0, 4.5)
    assert (b.left, b.renewals) == (6.0, 2)  # 4·Q⁰
    const = DBBook({"a": ServiceStats(1.0, 0.5)}, doubling="constant")
    c = const.start("a", 0.0)
    for _ in range(3):
        const.charge("a", c, c.left, 0.0)
        assert c.left == 3.0
    with pytest.raises(ValueError, match="doubling"):
        DBBook({}, doubling="triple")  # type: ignore[arg-type]


def test_policy_batches_one_service_short_service_first_and_demotes():
    pol = DoublingBudget({"short": ServiceStats(1.0), "long": ServiceStats(10.0)})
    long_r = Request("L", 0.0, 10, 100, model="long")
    shorts = [Request(f"S{i}", 0.1, 10, 10, model="short") for i in range(3)]
    pol.add(long_r, 0.0)
    for r in shorts:
        pol.add(r, 0.1)
    d = pol.schedule(view(0.1, []))
    assert {r.model for r in d.run} == {"short"} and len(d.run) == 3
    assert d.recheck_at == pytest.approx(0.1 + 1.0)
    # the shorts overrun their budget (1 s): at exhaustion they are demoted to 2·Q⁰ = 2 s,
    # priority 2·1 = 2 < long's 10·10: still first; a second exhaustion gives 4 s
    d2 = pol.schedule(view(1.1, d.run))
    assert all(r.annotations["db_budget"].renewals == 1 for r in shorts)
    assert {r.model for r in d2.run} == {"short"}
    for r in shorts:
        pol.remove(r, 1.2)
    d3 = pol.schedule(view(1.2, []))
    assert d3.run == [long_r]


def test_starved_request_seeds_the_batch():
    pol = DoublingBudget({"short": ServiceStats(1.0), "long": ServiceStats(10.0, starvation_s=5.0)})
    long_r = Request("L", 0.0, 10, 100, model="long")
    pol.add(long_r, 0.0)
    short = Request("S", 0.0, 10, 10, model="short")
    pol.add(short, 0.0)
    assert pol.schedule(view(0.0, [])).run == [short]
    assert pol.schedule(view(6.0, [short])).run == [long_r]  # waited 6 s > θ = 5 s
