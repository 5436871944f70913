"""The router's view of the worker instances: where they are, their role and their worker configuration.

Every backend carries the worker configuration its instance runs (the operator's ConfigMap, or what
local mode starts the worker with), so the router knows the models, classes, default classes and
step-time profiles from the same source as the worker. A backends file is JSON or YAML::

    backends:
      - name: h100-pool-g1-0
        url: http://127.0.0.1:8101
        role: interactive            # interactive | mixed | batch (Chiron roles)
        config: {models: [...], classes: {...}}   # a worker configuration
        kvEvents:                    # optional: where its vLLM publishes KV events, per model
          - {model: tiny, endpoint: "tcp://127.0.0.1:5557"}   # blockSize: 128 (unset: the events')
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, model_validator

from tessera.api.base import ApiModel
from tessera.api.files import read_json_or_yaml
from tessera.api.worker_config import WorkerConfig


class BackendsError(ValueError):
    """The backends file is invalid; the message says where and how to fix it."""


class KVEventsSource(ApiModel):
    """Where an instance's vLLM engine publishes its KV events for one model (``--kv-events-config``),
    for the ``precise-prefix`` route (``tessera.router.kv_events``)."""

    model: str = Field(min_length=1, description="The model whose engine publishes them.")
    endpoint: str = Field(
        pattern=r"^tcp://", description="ZMQ address to subscribe to, e.g. tcp://10.0.0.5:5557."
    )
    block_size: Annotated[int, Field(ge=1)] | None = Field(
        default=None,
        description="The engine's KV block size in tokens (vLLM: 16 on most GPUs, 128 on CPUs); unset: "
        "the size of the blocks its events report.",
    )


class Backend(ApiModel):
    """One worker instance behind the router."""

    name: str = Field(min_length=1, description="Instance name (unique).")
    url: str = Field(pattern=r"^https?://", description="Base URL of the worker (no /v1).")
    role: Literal["interactive", "mixed", "batch"] = Field(default="mixed", description="Chiron role.")
    config: WorkerConfig = Field(description="The worker configuration the instance runs.")
    kv_events: list[KVEventsSource] = Field(
        default_factory=list,
        description="Its engines' KV-event publishers (none: no engine-reported blocks).",
    )

    @model_validator(mode="after")
    def _sources_of_served_models(self) -> Backend:
        served = {m.name for m in self.config.models}
        unknown = sorted({s.model for s in self.kv_events} - served)
        if unknown:
            raise ValueError(f"kvEvents names models the backend does not serve: {', '.join(unknown)}")
        return self


class BackendsFile(ApiModel):
    """The whole backends file."""

    backends: list[Backend] = Field(min_length=1, description="Worker instances.")


def parse_backends(data: Any, where: str = "backends") -> list[Backend]:
    """Validate parsed backends; BackendsError listing every problem with its location."""
    try:
        backends = BackendsFile.model_validate(data).backends
    except ValidationError as exc:
        lines = [f"  {'.'.join(str(p) for p in e['loc']) or '(top level)'}: {e['msg']}" for e in exc.errors()]
        raise BackendsError(f"invalid {where}:\n" + "\n".join(lines)) from None
    names = [b.name for b in backends]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise BackendsError(f"invalid {where}: backend names must be unique; repeated: {', '.join(dupes)}")
    return backends


def load_backends(path: Path | str) -> list[Backend]:
    """Read a backends file (JSON or YAML)."""
    path = Path(path)
    data = read_json_or_yaml(path, "backends file", BackendsError)
    return parse_backends(data, where=f"backends file {path}")
