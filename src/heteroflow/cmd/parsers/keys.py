"""issue 33: ``keys`` (a service's API key: list, rotate) and ``usage`` (the usage table)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from heteroflow.cmd.parsers.common import MANAGE, json_flag

if TYPE_CHECKING:
    from heteroflow.cmd.parsers.common import Subparsers


def add_parsers(sub: Subparsers) -> None:
    ky = sub.add_parser(
        "keys",
        help="services' API keys: list them (prefix, limits), rotate or revoke one",
        description="A service has one API key, its endpoint's. `rotate` revokes it and "
        "prints a new one (once); `revoke` prints none (no key works until a rotate); the "
        "old key stops working within seconds.",
    )
    kys = ky.add_subparsers(dest="action", required=True, metavar="ACTION")
    kl = kys.add_parser("list", help="every key you may see (only its prefix)")
    kl.add_argument("--service", default=None, metavar="ID", help="only this service's (tg-...)")
    json_flag(kl)
    kr = kys.add_parser("rotate", help="revoke a key and print a new one (once)")
    kr.add_argument("id", help="the service (tg-...) or its endpoint (ep-...)")
    json_flag(kr)
    kv = kys.add_parser("revoke", help="revoke a key: no key works until `keys rotate`")
    kv.add_argument("id", help="the service (tg-...) or its endpoint (ep-...)")
    json_flag(kv)
    ky.set_defaults(root=MANAGE)

    us = sub.add_parser(
        "usage",
        help="requests and tokens (and GPU time) per service, key, model, day...",
        description="GET /api/v1/usage as a table: sums of what the gateways recorded in "
        "[--start, --end), grouped by --group-by.",
    )
    us.add_argument("--start", default=None, metavar="ISO", help="from (e.g. 2026-03-01)")
    us.add_argument("--end", default=None, metavar="ISO", help="until, excluded (default: now)")
    us.add_argument(
        "--group-by", default="service,model", metavar="FIELDS",
        help="comma list of tenant, member, endpoint, model, service, hour, day "
        "(default: %(default)s; empty: one total)",
    )
    us.add_argument("--service", default=None, metavar="ID", help="only this service (tg-...)")
    us.add_argument("--gpu", action="store_true", help="GPU time beside the tokens")
    json_flag(us)
    us.set_defaults(root=MANAGE)
