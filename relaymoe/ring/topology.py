"""The ranks' hosts: this host's id in the agreement, nodes from the hosts, the schedule they run.

Pure Python, no torch: the agreement (``agree.py``) exchanges every rank's ``host_hash`` and
resolves the schedule from them on every rank alike.
"""

from __future__ import annotations

import hashlib
import socket

from relaymoe.options import NODE_BATCHED

__all__ = ["host_hash", "nodes_from_hosts", "resolve_schedule"]


def host_hash() -> int:
    digest = hashlib.blake2b(socket.gethostname().encode(), digest_size=7).digest()
    return int.from_bytes(digest, "little")


def nodes_from_hosts(hosts: list) -> int | None:
    """GPUs per node when the ranks form equal blocks of consecutive ranks, one host per block
    and a different host for each block (rank ``n*G + g`` on node ``n``); None otherwise."""
    blocks = [1]
    for a, b in zip(hosts, hosts[1:], strict=False):
        if a == b:
            blocks[-1] += 1
        else:
            blocks.append(1)
    starts = [0]
    for n in blocks[:-1]:
        starts.append(starts[-1] + n)
    block_hosts = [hosts[s] for s in starts]
    if len(set(blocks)) != 1 or len(set(block_hosts)) != len(block_hosts):
        return None
    return blocks[0]


def resolve_schedule(
    requested: str, gpus_per_node: int | None, hosts: list
) -> tuple[str, int | None]:
    """``(schedule, gpus_per_node)`` a ring of ``len(hosts)`` ranks runs (the same on every rank:
    the inputs are agreed). ``gpus_per_node`` None: from the ranks' hosts. ``auto`` and
    ``two_level`` run two levels when there are several nodes of several GPUs; one node, or one
    GPU per node, is the flat order anyway."""
    R = len(hosts)
    G = gpus_per_node if gpus_per_node is not None else nodes_from_hosts(hosts)
    if gpus_per_node is not None and gpus_per_node < R and R % gpus_per_node:
        raise ValueError(
            f"ring_moe: gpus_per_node={gpus_per_node} does not divide the EP group's {R} ranks; "
            "the two-level ring needs nodes of equally many consecutive ranks: pass the GPUs "
            "per node of the group (a divisor of its size), or schedule='flat'"
        )
    if requested == "flat":
        return "flat", None
    if G is None:
        if requested in ("two_level", NODE_BATCHED):
            raise ValueError(
                f"ring_moe: schedule={requested!r} needs nodes of equally many consecutive ranks, "
                f"but the EP group's hosts by rank are {_host_runs(hosts)}; pass gpus_per_node "
                "(and order the ranks node by node), or use schedule='flat'"
            )
        return "flat", None  # auto: an irregular placement runs the flat ring
    if requested == NODE_BATCHED:  # any node size: G = 1 is the flat ring, G = R one round
        return NODE_BATCHED, min(G, R)
    if 1 < G < R:
        return "two_level", G
    return "flat", None


def _host_runs(hosts: list) -> str:
    names = {}
    labels = [names.setdefault(h, f"host{len(names)}") for h in hosts]
    return "[" + ", ".join(labels) + "]"
