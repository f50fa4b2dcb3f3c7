"""The job's shape as train.sh launches it, checked before torchrun starts: ``cluster_problems``.

torchrun starts ``GPUS_PER_NODE`` processes on each of ``NNODES`` nodes and joins them through
a store on ``MASTER_ADDR:MASTER_PORT``. Each mistake here costs a booked cluster: an address
every node but the first cannot reach (``localhost`` makes each node wait for itself until the
rendezvous times out), a node with fewer GPUs than processes (torchrun's workers die one by one
with "Found no NVIDIA driver" or an invalid device), a config whose ``parallel.gpus_per_node``
(the ring's node boundaries) is not the cluster's. The values come from the entry point
(train.sh's environment), as arguments: nothing here reads the environment.
"""

from __future__ import annotations

import ipaddress
import socket


def cluster_problems(
    *,
    nnodes: int,
    gpus_per_node: int,
    master_addr: str,
    master_port: int,
    visible_gpus: int | None = None,
    config_gpus_per_node: int | None = None,
) -> list[str]:
    """Why a job of ``nnodes`` x ``gpus_per_node`` cannot start from here, one line each with
    its fix. ``master_addr``: "" when unset; ``visible_gpus``: the GPUs this node's processes
    see (None: not launching, a dry run); ``config_gpus_per_node``: the run's
    ``--relaymoe-gpus-per-node`` (None when not given)."""
    out = []
    if nnodes > 1:
        why = _master_addr_problem(master_addr, master_port, nnodes)
        if why:
            out.append(why)
    if visible_gpus is not None and visible_gpus < gpus_per_node:
        seen = (
            "no GPU is visible here (torch.cuda.device_count() is 0: no NVIDIA driver, or "
            "CUDA_VISIBLE_DEVICES hides them)"
            if visible_gpus == 0
            else f"this node sees {visible_gpus} GPU(s)"
        )
        out.append(
            f"{seen}, and GPUS_PER_NODE={gpus_per_node} starts one process per GPU; fix: "
            f"launch on a node with {gpus_per_node} GPUs (nvidia-smi lists them), set "
            "GPUS_PER_NODE to what it has (with a config that fills the job), or check without "
            "GPUs with DRY_RUN=1"
        )
    if config_gpus_per_node is not None and config_gpus_per_node != gpus_per_node:
        out.append(
            f"the run says --relaymoe-gpus-per-node {config_gpus_per_node} (the config's "
            f"parallel.gpus_per_node) but the job has GPUS_PER_NODE={gpus_per_node}: the ring "
            "would place its node boundaries wrongly; fix: set parallel.gpus_per_node to "
            f"{gpus_per_node} (or leave it unset: the ring reads the hosts), or GPUS_PER_NODE"
        )
    return out


def _master_addr_problem(addr: str, port: int, nnodes: int) -> str | None:
    """Why the nodes of a multi-node job cannot meet at ``addr`` (None when they can, as far
    as this node can tell: the name resolves to an address that is not a loopback one)."""
    fix = (
        "fix: export MASTER_ADDR=<node 0's hostname or IP, as the other nodes reach it> on "
        "every node (slurm.sbatch sets it to the allocation's first node)"
    )
    if not addr:
        return (
            f"MASTER_ADDR is not set and NNODES={nnodes}: the nodes meet at node 0's address; {fix}"
        )
    try:
        found = {info[4][0] for info in socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)}
    except (OSError, UnicodeError) as e:
        return f"MASTER_ADDR={addr} does not resolve on this node ({e}); {fix}"
    if all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in found):
        return (
            f"MASTER_ADDR={addr} is a loopback address ({', '.join(sorted(found))}) and "
            f"NNODES={nnodes}: every node would wait for itself; {fix}"
        )
    return None
