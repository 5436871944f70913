"""The fair-share setting of a service's scheduling (``LLMService.spec.scheduling.fairShare``), as the
worker configuration carries it (``scheduling.fairShare``): VTC between the router's tenants around the
service's policy (``tessera.core.fair_share``)."""

from __future__ import annotations

from pydantic import Field, model_validator

from tessera.api.base import ApiModel


class FairShareSpec(ApiModel):
    """VTC fair share between tenants (off by default): within a class, the next request admitted is
    the least served backlogged tenant's, service counted in weighted prompt and output tokens."""

    enabled: bool = Field(default=False, description="Share each class's service fairly between tenants.")
    input_weight: float = Field(default=1.0, ge=0, le=1000, description="Service counted per prompt token.")
    output_weight: float = Field(default=2.0, ge=0, le=1000, description="Service counted per output token.")
    lift_credit: float = Field(
        default=0.0,
        ge=0,
        le=1e9,
        description="Weighted service a tenant whose requests are still running may stay below the least "
        "backlogged tenant's counter when it has requests waiting again (0: VTC's lift, to that counter). "
        "It keeps a tenant sending less than its share ahead of a flood; the service gap bound becomes "
        "twice the largest request's weighted tokens plus this credit.",
    )

    @model_validator(mode="after")
    def _counts_something(self) -> FairShareSpec:
        if self.input_weight == 0 and self.output_weight == 0:
            raise ValueError("fairShare.inputWeight and outputWeight are both 0: no service would count")
        return self
