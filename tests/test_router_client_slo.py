"""SLO attainment where the client sees it: the router times every answer from the request's arrival at
the router to the token chunks it relays, and judges it against the class's SLO with the one definition
(``tessera.core.slo.slo_met``, through ``delivered_slo_met``). Real sim worker processes behind the
real router on loopback (``router_harness``), and the judging rules on their own."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import httpx
import pytest
from router_harness import CLASS_HEADER, MODEL, PLAN, serve_router

from tessera.core.request import ServiceClass
from tessera.core.slo import delivered_slo_met
from tessera.local.supervisor import Supervisor, WorkerProcess
from tessera.router.backends import Backend
from tessera.worker.engines.vllm_process import free_port

SLOW_PREFILL_S = 0.3  # every prefill step of the slow backend takes at least this long
TIGHT_TTFT_S = 0.1  # the chat class's TTFT SLO: no answer of the slow backend can meet it


def _slow_instance() -> object:
    """The quickstart's first instance with a slow engine (prefill ``SLOW_PREFILL_S``) and a chat class
    whose TTFT SLO is ``TIGHT_TTFT_S``; the offline class keeps its one-hour deadline."""
    inst = PLAN.instances[0]
    config = inst.config
    model = config.models[0]
    slow = model.model_copy(
        update={"profile": model.profile.model_copy(update={"prefill_p0": SLOW_PREFILL_S})}
    )
    chat = config.classes["chat"]
    tight = chat.model_copy(update={"slo": chat.slo.model_copy(update={"ttft_seconds": TIGHT_TTFT_S})})
    config = config.model_copy(update={"models": [slow], "classes": {**config.classes, "chat": tight}})
    return dataclasses.replace(inst, config=config)


@pytest.fixture(scope="module")
def slow_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    supervisor = Supervisor(tmp_path_factory.mktemp("router-client-slo"), grace_s=2.0)
    supervisor.start_all([_slow_instance()], 60.0)  # type: ignore[list-item]
    try:
        yield supervisor.workers[0]
    finally:
        supervisor.stop_all()


def _rows(status: dict[str, object]) -> dict[str, dict[str, object]]:
    rows = status["clientSlo"]
    assert isinstance(rows, list)
    return {row["class"]: row for row in rows if row["model"] == MODEL}


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_router_counts_a_slow_backend_missing_a_tight_ttft_and_meeting_a_deadline(
    slow_worker: WorkerProcess,
) -> None:
    async with serve_router([slow_worker]) as router, httpx.AsyncClient(timeout=30.0) as client:
        chat = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": True}
        for _ in range(2):
            answer = await client.post(
                f"{router.url}/v1/completions", json=chat, headers={CLASS_HEADER: "chat"}
            )
            assert answer.status_code == 200 and answer.text.rstrip().endswith("data: [DONE]")
        offline = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
        for _ in range(2):
            answer = await client.post(f"{router.url}/v1/completions", json=offline,
                                       headers={CLASS_HEADER: "batch"})  # fmt: skip
            assert answer.status_code == 200
        status = (await client.get(f"{router.url}/router/status")).json()

        met = await router.metric("tessera_router_slo_met_total", model=MODEL, **{"class": "chat"})
        missed = await router.metric("tessera_router_slo_missed_total", model=MODEL, **{"class": "chat"})
        assert (met, missed) == (0, 2)
        met = await router.metric("tessera_router_slo_met_total", model=MODEL, **{"class": "offline"})
        missed = await router.metric("tessera_router_slo_missed_total", model=MODEL, **{"class": "offline"})
        assert (met, missed) == (2, 0)
        # Every answer has a client-side TTFT; the slow prefill is in each of them.
        for klass in ("chat", "offline"):
            labels = {"model": MODEL, "class": klass}
            assert await router.metric("tessera_router_ttft_seconds_count", **labels) == 2
            assert await router.metric("tessera_router_ttft_seconds_sum", **labels) >= 2 * SLOW_PREFILL_S
        # Only the streams have gaps between token chunks to time.
        assert await router.metric("tessera_router_mean_itl_seconds_count", **{"class": "chat"}) == 2
        assert await router.metric("tessera_router_mean_itl_seconds_count", **{"class": "offline"}) == 0

    rows = _rows(status)
    assert rows["chat"]["kind"] == "interactive" and (rows["chat"]["sloMet"], rows["chat"]["sloMissed"]) == (
        0,
        2,
    )
    assert rows["chat"]["sloAttainment"] == 0.0 and rows["chat"]["meanTtftSeconds"] >= SLOW_PREFILL_S
    assert rows["offline"]["kind"] == "batch" and rows["offline"]["sloAttainment"] == 1.0


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_an_answer_the_router_could_not_give_misses_the_class_slo() -> None:
    """No instance is reachable: the client gets 503, which misses the chat class's SLO; a request of an
    unknown class (the client's mistake) is not judged."""
    dead = Backend(
        name="dead-0", url=f"http://127.0.0.1:{free_port()}", role="mixed", config=PLAN.instances[0].config
    )
    async with serve_router([_Dead(dead)]) as router, httpx.AsyncClient(timeout=10.0) as client:  # type: ignore[list-item]
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
        assert (await client.post(f"{router.url}/v1/completions", json=body,
                                  headers={CLASS_HEADER: "chat"})).status_code == 503  # fmt: skip
        assert (await client.post(f"{router.url}/v1/completions", json=body,
                                  headers={CLASS_HEADER: "gold"})).status_code == 400  # fmt: skip
        assert await router.metric("tessera_router_slo_missed_total", **{"class": "chat"}) == 1
        assert await router.metric("tessera_router_slo_met_total") == 0
        assert await router.metric("tessera_router_ttft_seconds_count") == 0  # no token reached the client
        rows = _rows((await client.get(f"{router.url}/router/status")).json())
    assert (
        set(rows) == {"chat"}
        and rows["chat"]["sloAttainment"] == 0.0
        and rows["chat"]["meanTtftSeconds"] is None
    )


@dataclasses.dataclass
class _Dead:
    """A worker entry whose address answers nothing (``serve_router`` reads only ``backend()``)."""

    entry: Backend

    def backend(self) -> Backend:
        return self.entry


CHAT = ServiceClass("chat", ttft_slo_s=1.0, itl_slo_s=0.1)
BATCH = ServiceClass("offline", kind="batch", deadline_s=10.0)
NONE = ServiceClass("free")


def test_delivered_slo_met_judges_delivery_times_with_slo_met() -> None:
    # A stream: first chunk at 0.9 s, 11 chunks to 1.9 s (mean gap 0.1 s): met; a later first chunk misses.
    assert delivered_slo_met(CHAT, status=200, arrival=0.0, finished=2.0, first_token=0.9, last_token=1.9,
                             tokens=11) is True  # fmt: skip
    assert delivered_slo_met(CHAT, status=200, arrival=0.0, finished=2.0, first_token=1.1, last_token=1.9,
                             tokens=11) is False  # fmt: skip
    # Mean gap 0.2 s misses the ITL bound.
    assert delivered_slo_met(CHAT, status=200, arrival=0.0, finished=3.0, first_token=0.5, last_token=2.5,
                             tokens=11) is False  # fmt: skip
    # An answer in one piece: its send time is the first token, and no ITL bound applies.
    assert delivered_slo_met(CHAT, status=200, arrival=0.0, finished=0.8, first_token=0.8, last_token=0.8,
                             tokens=1) is True  # fmt: skip
    assert delivered_slo_met(BATCH, status=200, arrival=0.0, finished=9.0) is True
    assert delivered_slo_met(BATCH, status=200, arrival=0.0, finished=11.0) is False


def test_delivered_slo_met_failed_answers_miss_and_client_errors_are_not_judged() -> None:
    for status in (500, 502, 503, 429):
        assert delivered_slo_met(BATCH, status=status, arrival=0.0, finished=0.1) is False
        assert delivered_slo_met(CHAT, status=status, arrival=0.0, finished=0.1, first_token=0.05,
                                 last_token=0.06, tokens=2) is False  # fmt: skip
    for status in (400, 401, 404, 408, 413, 499):
        assert delivered_slo_met(CHAT, status=status, arrival=0.0, finished=0.1) is None
    assert delivered_slo_met(NONE, status=503, arrival=0.0, finished=0.1) is None  # no SLO to miss
