"""Token usage: gateways hand in batches, members and operators read the sums."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import Depends, Header, Query, Response
from pydantic import AfterValidator, StringConstraints

from heteroflow.api.deps import DB, Ctx, Who, require_gateway
from heteroflow.api.unit_of_work import api_router
from heteroflow.schemas.common import IdStr, UtcTime, no_nul
from heteroflow.schemas.usage import UsageAccepted, UsageBatch, UsageReport, UsageRow
from heteroflow.services.tenancy import usage

router = api_router(prefix="/api/v1", tags=["usage"])
ModelName = Annotated[str, StringConstraints(max_length=256), AfterValidator(no_nul)]


@router.post(
    "/gateway/usage",
    response_model=UsageAccepted,
    dependencies=[Depends(require_gateway)],
    tags=["gateway"],
)
def hand_in(batch: UsageBatch, ctx: Ctx) -> UsageAccepted:
    """A separate gateway's batch (gateway token, like the snapshot poll).

    Committed before the answer (not in a dependency's exit, which runs after the
    response is sent): a 2xx tells the gateway it may forget the batch.
    """
    rows = [
        UsageRow(
            endpoint_id=r.endpoint_id,
            tenant_id=r.tenant_id,
            model=r.model,
            requests=r.requests,
            prompt_tokens=r.prompt_tokens,
            completion_tokens=r.completion_tokens,
            recorded_at=r.recorded_at,
        )
        for r in batch.records
    ]
    with ctx.db.session() as s:
        accepted = usage.write_batch(s, rows)
    return UsageAccepted(accepted=accepted)


@router.get("/usage", response_model=UsageReport, response_model_exclude_unset=True)
def read_usage(
    s: DB,
    who: Who,
    ctx: Ctx,
    start: UtcTime | None = Query(default=None, description="from (inclusive); UTC if no zone"),
    end: UtcTime | None = Query(default=None, description="until (exclusive); UTC if no zone"),
    group_by: str = Query(
        default="endpoint,model",
        max_length=64,
        description="comma list of tenant, member, endpoint, model, service, hour, day",
    ),
    tenant_id: IdStr | None = Query(default=None, description="operators: any; members: own"),
    member_id: IdStr | None = None,
    endpoint_id: IdStr | None = None,
    model: ModelName | None = None,
    service_id: IdStr | None = Query(default=None, description="a task group's id"),
    gpu: bool = Query(default=False, description="GPU time beside the tokens (N4)"),
    fmt: Literal["json", "csv"] | None = Query(
        default=None, alias="format", description="csv: text/csv (also Accept: text/csv)"
    ),
    accept: str | None = Header(default=None),
) -> Response | UsageReport:
    """Tokens, and with ``gpu=true`` GPU time, summed per group (docs/api.md)."""
    rep = usage.report(
        s,
        who,
        now=ctx.clock.now(),
        start=start,
        end=end,
        group_by=usage.parse_group_by(group_by),
        tenant_id=tenant_id,
        member_id=member_id,
        endpoint_id=endpoint_id,
        model=model,
        service_id=service_id,
        gpu=gpu,
    )
    if fmt == "csv" or (fmt is None and accept is not None and "text/csv" in accept):
        return Response(
            usage.to_csv(rep, gpu),
            media_type="text/csv; charset=utf-8",
            headers={"Content-Disposition": 'attachment; filename="usage.csv"'},
        )
    return rep
