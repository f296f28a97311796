"""Platform switches (L1): operators read and set them (``/api/v1/platform-settings``).

Each switch is one ``platform_settings`` row (``"true"`` / ``"false"``) named like the
field, beside the secrets that table already holds — so every server instance reads the
same value and no migration was needed. Only the names in ``SWITCHES`` are ever read or
written here: the table's other rows (the JWT secret, gateway load reports) never leave
it through this door. A missing row is the default (off).
"""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from heteroflow.core.errors import Forbidden
from heteroflow.db.tables import PlatformSetting
from heteroflow.schemas.dedup import PlatformSettingsRead, PlatformSettingsUpdate
from heteroflow.services.identity.auth import Principal

# switch name -> its default (every switch is off until an operator turns it on)
SWITCHES: dict[str, bool] = {
    "inference_dedup_enabled": False,
    "cross_tenant_dedup_enabled": False,
}


def _operator(who: Principal) -> None:
    if not who.is_operator:
        raise Forbidden("only a platform operator reads or changes the platform settings")


def switches(s: Session) -> PlatformSettingsRead:
    """The switches as stored (defaults for rows never written); for every caller."""
    q = select(PlatformSetting.key, PlatformSetting.value).where(
        PlatformSetting.key.in_(list(SWITCHES))
    )
    rows = {key: value for key, value in s.execute(q)}
    values = {name: rows[name] == "true" if name in rows else d for name, d in SWITCHES.items()}
    return PlatformSettingsRead(**values)


def get_settings(s: Session, who: Principal) -> PlatformSettingsRead:
    _operator(who)
    return switches(s)


def put_settings(
    s: Session, who: Principal, req: PlatformSettingsUpdate
) -> PlatformSettingsRead:
    """Set the given switches (fields left out keep their value); answers all of them."""
    _operator(who)
    for name, value in req.model_dump(exclude_none=True).items():
        text = "true" if value else "false"
        moved = s.execute(
            update(PlatformSetting).where(PlatformSetting.key == name).values(value=text)
        )
        if getattr(moved, "rowcount", 0):
            continue
        try:
            with s.begin_nested():  # first write of this switch; a concurrent one may win
                s.add(PlatformSetting(key=name, value=text))
        except IntegrityError:
            s.execute(
                update(PlatformSetting).where(PlatformSetting.key == name).values(value=text)
            )
    return switches(s)
