"""GET /api/v1/engines: the engines and each capability's maturity label (H8)."""

from __future__ import annotations

from heteroflow.api.deps import Who
from heteroflow.api.unit_of_work import api_router
from heteroflow.core.engines.maturity import catalog
from heteroflow.schemas.engines import EngineRead

router = api_router(prefix="/api/v1", tags=["engines"])


@router.get("/engines", response_model=list[EngineRead])
def list_engines(_who: Who) -> list[EngineRead]:
    """Every engine the platform can launch, with what it can do and how far each
    capability is proven; the same for every signed-in caller."""
    return [EngineRead.model_validate(e) for e in catalog()]
