"""Link speeds and byte-layout constants of the cost model (relaymoe/cost/)."""

from __future__ import annotations

# The links a ring hop runs over (the planner's per-hop times; the simulator's Cluster defaults
# import them). NVLink: one way between two GPUs of a node, measured with 1 GiB messages. Between
# nodes: one 400 Gb/s NIC per GPU = 50 GB/s nominal, of which RDMA P2P of tens of MB reaches
# about 90% (both assumptions: no multi-node machine was measured).
NVLINK_BYTES_PER_S = 394e9
NIC_BYTES_PER_S = 50e9
NIC_EFFICIENCY = 0.9
INTER_NODE_BYTES_PER_S = NIC_EFFICIENCY * NIC_BYTES_PER_S

INDEX_BYTES = 4  # expert ids travel as int32
ROUTING_INDEX_BYTES_PER_PAIR = 12  # expert_token_indices, token_expert_indices, token_index_map
ALIGN = 256  # every segment of a travelling buffer starts aligned (relaymoe/ring/plan.py)
SYMM_GRANULE = 2 * 1024 * 1024  # the copy-engine workspace grows in these (ring/executor.py)


def align_up(nbytes: int, align: int = ALIGN) -> int:
    """``nbytes`` rounded up to a multiple of ``align`` (a travelling segment's start)."""
    return (nbytes + align - 1) // align * align
