"""Who may do what: ``tenants``, ``platform`` switches, ``sharing-groups``, ``users``."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from heteroflow.cmd.parsers.common import MANAGE, count, json_flag

if TYPE_CHECKING:
    from heteroflow.cmd.parsers.common import Subparsers


def add_parsers(sub: Subparsers) -> None:
    _tenants(sub)
    _platform(sub)
    _sharing_groups(sub)
    _users(sub)


def _tenants(sub: Subparsers) -> None:
    tn = sub.add_parser("tenants", help="tenants (operators create them)")
    tns = tn.add_subparsers(dest="action", required=True, metavar="ACTION")
    json_flag(tns.add_parser("list", help="the tenants you may see"))
    tc = tns.add_parser("create", help="operators: a new tenant")
    tc.add_argument("name", help="the tenant's name")
    tu = tns.add_parser("update", help="operators: priority ceiling, sharing group, quotas")
    tu.add_argument("id", help="the tenant id")
    for t in (tc, tu):
        t.add_argument(
            "--priority-ceiling", type=count(0, 1000), default=None, help="0-1000 (default 100)"
        )
        t.add_argument(
            "--sharing-group", default=None, metavar="ID", help="a sharing group id; none: no group"
        )
        json_flag(t)
    _quota_flags(tu)
    tq = tns.add_parser("quota", help="a tenant's quotas and what it holds (members: their own)")
    tq.add_argument("id", help="the tenant id")
    json_flag(tq)
    tn.set_defaults(root=MANAGE)


def _quota_flags(tu: argparse.ArgumentParser) -> None:
    for flag, text in (
        ("--quota-cards", "whole GPU cards by commitment (a card at 50%% counts 0.5)"),
        ("--quota-services", "live services"),
        ("--quota-replicas", "tasks of those services"),
        ("--quota-cpu-memory-mb", "MB booked by CPU work"),
    ):
        tu.add_argument(flag, type=count(0), default=None, metavar="N", help=f"{text}; 0: no limit")
    tu.add_argument(
        "--quota-tokens", type=count(0, 10**15), default=None, metavar="N",
        help="gateway tokens per --quota-token-period, all keys together; 0: no limit",
    )
    tu.add_argument("--quota-token-period", choices=("day", "month"), default=None,
                    help="the UTC day or month of --quota-tokens")
    tu.add_argument(
        "--members-see-own", action=argparse.BooleanOptionalAction, default=None,
        help="members see and manage only the services and keys they created (N5)",
    )


def _platform(sub: Subparsers) -> None:
    pf = sub.add_parser("platform", help="platform switches: inference dedup (operators only)")
    pfs = pf.add_subparsers(dest="action", required=True, metavar="ACTION")
    json_flag(pfs.add_parser("show", help="the switches and their values"))
    pset = pfs.add_parser("set", help="turn switches on or off (the others keep their value)")
    pset.add_argument(
        "--inference-dedup", choices=["on", "off"], default=None,
        help="a create of a model already served (same model path and image) reuses it",
    )
    pset.add_argument(
        "--cross-tenant-dedup", choices=["on", "off"], default=None,
        help="dedup also reuses services of tenants in the caller's sharing group",
    )
    json_flag(pset)
    pf.set_defaults(root=MANAGE)


def _sharing_groups(sub: Subparsers) -> None:
    sg = sub.add_parser("sharing-groups", help="tenants that may share GPU cards (operators only)")
    sgs = sg.add_subparsers(dest="action", required=True, metavar="ACTION")
    json_flag(sgs.add_parser("list", help="every sharing group and its tenants"))
    sgc = sgs.add_parser("create", help="a new, empty sharing group")
    sgc.add_argument("name", help="the group's name")
    json_flag(sgc)
    sgv = sgs.add_parser("show", help="one sharing group and its tenants")
    sgv.add_argument("id", help="the sharing group id")
    json_flag(sgv)
    sgd = sgs.add_parser("delete", help="delete a sharing group (it must have no tenants)")
    sgd.add_argument("id", help="the sharing group id")
    json_flag(sgd)
    for action, text in (("add-tenant", "put a tenant in"), ("remove-tenant", "take one out")):
        m = sgs.add_parser(action, help=f"{text} the group")
        m.add_argument("id", help="the sharing group id")
        m.add_argument("tenant_id", help="the tenant id")
        json_flag(m)
    sg.set_defaults(root=MANAGE)


def _users(sub: Subparsers) -> None:
    us = sub.add_parser("users", help="users (operators create them)")
    uss = us.add_subparsers(dest="action", required=True, metavar="ACTION")
    json_flag(uss.add_parser("list", help="the users you may see"))
    uc = uss.add_parser("create", help="operators: a new user")
    uc.add_argument("username", help="the user's login name")
    uc.add_argument("--password", required=True, help="at least 8 characters")
    uc.add_argument(
        "--role", choices=["operator", "member", "tenant_admin"], default="member",
        help="default: member (tenant_admin: also manages the tenant's registry credentials)",
    )
    uc.add_argument("--tenant-id", default=None, help="default: your own tenant")
    json_flag(uc)
    us.set_defaults(root=MANAGE)
