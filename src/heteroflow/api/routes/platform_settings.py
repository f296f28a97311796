"""Platform switches (/api/v1/platform-settings): operators only (L1)."""

from __future__ import annotations

from heteroflow.api.deps import DB, Who
from heteroflow.api.unit_of_work import api_router
from heteroflow.schemas.dedup import PlatformSettingsRead, PlatformSettingsUpdate
from heteroflow.services.tenancy import platform_settings

router = api_router(prefix="/api/v1/platform-settings", tags=["platform settings"])


@router.get("", response_model=PlatformSettingsRead)
def get_settings(s: DB, who: Who) -> PlatformSettingsRead:
    return platform_settings.get_settings(s, who)


@router.put("", response_model=PlatformSettingsRead)
def put_settings(req: PlatformSettingsUpdate, s: DB, who: Who) -> PlatformSettingsRead:
    """Set the switches given; fields left out keep their value. Unknown keys: 400."""
    return platform_settings.put_settings(s, who, req)
