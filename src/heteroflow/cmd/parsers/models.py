"""``models``: the nodes' model caches (issue 29, H9) — list them, pull a model to a node,
evict one. Operators only (the server answers 403 to anyone else)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from heteroflow.cmd.parsers.common import MANAGE, json_flag, json_progress_flag, wait_flags

if TYPE_CHECKING:
    from heteroflow.cmd.parsers.common import Subparsers

MODELS_EPILOG = """\
examples:
  heteroflow models list --node gpu-1
  heteroflow models pull hf://Qwen/Qwen2.5-0.5B-Instruct --node gpu-1 --wait
  heteroflow models evict <KEY from models list> --node gpu-1"""
NODE_HELP = "the node (its name or id)"


def add_parsers(sub: Subparsers) -> None:
    md = sub.add_parser(
        "models",
        help="the nodes' model caches: list them, pull a model to a node, evict one",
        description="Each node's agent keeps a cache of the models fetched from their "
        "sources (one copy per revision). `list` shows what every node holds as its last "
        "heartbeat said; `pull` and `evict` ask one node's agent (operators only).",
        epilog=MODELS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mds = md.add_subparsers(dest="action", required=True, metavar="ACTION")
    ml = mds.add_parser("list", help="the cached models: node, key, source, revision, size, state")
    ml.add_argument("--node", default=None, metavar="NAME", help="only this node's")
    json_flag(ml)
    mp = mds.add_parser("pull", help="fetch a model source into a node's cache")
    mp.add_argument(
        "source",
        help="hf://org/name[@revision], modelscope://org/name[@revision], https://host/path "
        "or fleet://<key>",
    )
    mp.add_argument("--node", required=True, metavar="NAME", help=NODE_HELP)
    wait_flags(mp, "the node holds it", default=False)
    json_progress_flag(mp)
    me = mds.add_parser("evict", help="remove a model from a node's cache (not one in use)")
    me.add_argument("key", help="the cache key, as `heteroflow models list` shows it")
    me.add_argument("--node", required=True, metavar="NAME", help=NODE_HELP)
    wait_flags(me, "it is gone", default=False)
    json_progress_flag(me)
    md.set_defaults(root=MANAGE)
