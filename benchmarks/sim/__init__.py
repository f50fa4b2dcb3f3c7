"""EP-scaling simulator (paper Fig. 10 analog): ring vs all-to-all beyond the machine we have.

Pure Python. ``model`` holds the inputs (shape, cluster, compute model), ``ring`` the
discrete-event ring, ``alltoall`` the all-to-all dispatcher, ``memory`` the MoE-block peaks,
``calibrate`` reads measured rows, fits the inputs and checks predictions against measurements.
``benchmarks/scaling_sim.py`` drives it and writes ``bench: scaling_sim`` rows.
"""

from benchmarks.sim.alltoall import simulate_alltoall
from benchmarks.sim.batched import simulate_node_batched
from benchmarks.sim.model import Cluster, ComputeModel, MoEShape, SimResult
from benchmarks.sim.ring import hop_payloads, simulate_pass, simulate_ring

__all__ = [
    "Cluster",
    "ComputeModel",
    "MoEShape",
    "SimResult",
    "hop_payloads",
    "simulate_alltoall",
    "simulate_node_batched",
    "simulate_pass",
    "simulate_ring",
]
