"""Whether a GPU slows down when many distinct CUDA graphs are queued back to back: a probe for
hop_cost's ``idle_frac_chained`` of expert forward at EP 64 (64 recorded hops of ~75 us, one
graph per expert range), outside the library.

    python benchmarks/lab/graph_chain_probe.py [--graphs 64] [--passes 5] [--kernels 8] [--m 4096]
        [--n 256] [--k 2048] [--out PATH.jsonl]

Records ``--graphs`` CUDA graphs of the same work (``--kernels`` bf16 matmul-adds
``(m, k) @ (k, n)``, each graph on its own tensors), then times "passes" of ``--graphs``
launches: one graph launched ``--graphs`` times, or every graph once; issued back to back
(``chained``) or after a sync each (``isolated``); with or without the ring executor's per-hop
stream handshake (an event recorded on the compute stream, waited on by a second stream that
records another, waited on by the compute stream). Rows ``bench: graph_chain_probe``: GPU
span per pass (CUDA events), the host's time to issue a pass, and the span against the
one-graph chained pass (the GPU's own time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from benchmarks.common import JsonlWriter, environment  # noqa: E402

_KEEP: list = []  # the recorded graphs' tensors


def record(n_graphs: int, m: int, n: int, k: int, kernels: int) -> list[torch.cuda.CUDAGraph]:
    """``n_graphs`` graphs of ``kernels`` matmul-adds each (as a hop: several kernels)."""
    graphs = []
    side = torch.cuda.Stream()
    for _ in range(n_graphs):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(kernels, k, n, device="cuda", dtype=torch.bfloat16)
        c = torch.zeros(kernels, m, n, device="cuda", dtype=torch.bfloat16)

        def body(a=a, b=b, c=c):
            for j in range(kernels):
                torch.addmm(c[j], a, b[j], out=c[j])

        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            body()
        graphs.append(g)
        _KEEP.append((a, b, c))  # a graph keeps addresses, not tensors
    torch.cuda.synchronize()
    return graphs


def one_pass(order, handshake, comm, ready, done) -> None:
    compute = torch.cuda.current_stream()
    for i, g in enumerate(order):
        if handshake:  # the executor's start(): comm waits for compute, records "done"
            ready.record(compute)
            comm.wait_event(ready)
            done[i & 1].record(comm)
        g.replay()
        if handshake:  # the executor's wait()
            compute.wait_event(done[i & 1])


def timed(order, passes: int, chained: bool, handshake: bool, reps: int = 3) -> dict:
    comm, ready = torch.cuda.Stream(), torch.cuda.Event()
    done = (torch.cuda.Event(), torch.cuda.Event())
    spans, hosts = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if chained:
            e0.record()
            t0 = time.perf_counter()
            for _ in range(passes):
                one_pass(order, handshake, comm, ready, done)
            hosts.append((time.perf_counter() - t0) / passes)
            e1.record()
            e1.synchronize()
            spans.append(e0.elapsed_time(e1) * 1e3 / passes)
        else:
            for _ in range(passes):
                torch.cuda.synchronize()
                e0.record()
                t0 = time.perf_counter()
                one_pass(order, handshake, comm, ready, done)
                hosts.append(time.perf_counter() - t0)
                e1.record()
                e1.synchronize()
                spans.append(e0.elapsed_time(e1) * 1e3)
    return {"span_us_per_pass": round(statistics.median(spans), 1),
            "host_us_per_pass": round(statistics.median(hosts) * 1e6, 1)}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graphs", type=int, default=64)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--kernels", type=int, default=8, help="matmul-adds in a graph")
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--out", default=None, help="JSONL path")
    a = ap.parse_args(argv)
    env = environment()
    writer = JsonlWriter(a.out or f"benchmarks/results/graph_chain_probe_{env['date']}.jsonl",
                         env=env)  # fmt: skip
    graphs = record(a.graphs, a.m, a.n, a.k, a.kernels)
    orders = {"one_graph": [graphs[0]] * a.graphs, "distinct_graphs": graphs}
    for order in orders.values():  # warm every graph
        timed(order, 1, True, False, reps=1)
    base = timed(orders["one_graph"], a.passes, True, False)["span_us_per_pass"]
    for handshake in (False, True):
        for name, order in orders.items():
            for chained in (True, False):
                row = timed(order, a.passes, chained, handshake)
                row.update(bench="graph_chain_probe", graphs=name, handshake=handshake,
                           issue="chained" if chained else "isolated", launches=a.graphs,
                           mnk=[a.m, a.n, a.k], kernels=a.kernels, gpu_us_per_pass=base,
                           extra_frac=round(1 - base / row["span_us_per_pass"], 3))  # fmt: skip
                writer.write(row)
                print(f"{name:16s} handshake={handshake!s:5s} {row['issue']:9s} span "
                      f"{row['span_us_per_pass']:9.1f} us host {row['host_us_per_pass']:9.1f} us"
                      f"  beyond the GPU's own {row['extra_frac']:.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
