"""A model, not a measurement: Kimi K2 at Q4 on four Mac Studios, layer split
against tensor split, per generated token.

Nothing here ran on a Mac. The inputs are stated below and can be changed
on the command line; the output says which split wins at each per-graph
dispatch overhead and where the answer flips.

Per token, decode (one token, so each all-reduce carries n_embd floats):

  layer split   the nodes run one after another: every active weight is read
                once, by one node  ->  bytes / bandwidth
                + one graph dispatch per node, + one activation hop per node
  tensor split  every node reads its share at the same time:
                full TP     (replicated + split / N) / bandwidth, 2 all-reduces per layer
                experts TP  attention, shared expert and dense layers whole on every
                            node, routed experts split: 1 all-reduce per layer
                + one graph dispatch per subgraph (the meta backend runs a subgraph per
                  all-reduce, plus one), + the all-reduces

An all-reduce over a full mesh of Thunderbolt cables (tbrpc's ALLREDUCE sends
each partial straight to every other node, so tensor split needs a cable per
pair: 3 per Mac for 4 Macs; a ring is enough for layer split) costs one
message per link in parallel: latency + bytes / bandwidth, or, counting
TB5's 4.6 us per 4 KiB frame, frames x 4.6 us. Both are printed.

    python benchmarks/tp_model.py [--dispatch-us 0,10,20,50,100] [--bandwidth-gbs 650] ...
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Inputs:
    n_layer: int = 61                 # Kimi K2 / DeepSeek V3
    n_embd: int = 7168
    active_params: float = 31.5e9     # per token (the brief's figure: 8 of 384 experts + shared + attention)
    replicated_params: float = 6.2e9  # attention, shared experts, dense layers, embeddings/output
    bits_per_weight: float = 4.5      # Q4_K-class quantization
    bandwidth_gbs: float = 650.0      # achieved memory bandwidth of one M3 Ultra (819 GB/s peak)
    nodes: int = 4
    link_latency_us: float = 4.6      # TB5 RDMA, one 4 KiB frame (TN3205-class figure)
    link_gbit: float = 75.0           # TB5 RDMA payload bandwidth


def gb(params: float, x: Inputs) -> float:
    return params * x.bits_per_weight / 8 / 1e9


def allreduce_us(x: Inputs, frame_bound: bool) -> float:
    size = x.n_embd * 4
    if frame_bound:
        return math.ceil(size / 4096) * x.link_latency_us
    return x.link_latency_us + size / (x.link_gbit / 8 * 1e9) * 1e6


def layer_ms(x: Inputs, dispatch_us: float) -> float:
    compute = gb(x.active_params, x) / x.bandwidth_gbs * 1e3
    hops = x.nodes * allreduce_us(x, frame_bound=False) / 1e3   # one activation hop per node, like one message
    return compute + hops + x.nodes * dispatch_us / 1e3


def tensor_ms(x: Inputs, dispatch_us: float, experts_only: bool, frame_bound: bool) -> float:
    split = x.active_params - x.replicated_params
    per_node = (x.replicated_params + split / x.nodes) if experts_only else x.active_params / x.nodes
    compute = gb(per_node, x) / x.bandwidth_gbs * 1e3
    reduces = x.n_layer * (1 if experts_only else 2)
    graphs = reduces + 1
    return compute + reduces * allreduce_us(x, frame_bound) / 1e3 + graphs * dispatch_us / 1e3


def flip_us(x: Inputs, experts_only: bool, frame_bound: bool) -> float:
    """The per-graph dispatch overhead above which layer split is faster."""
    base_layer, base_tensor = layer_ms(x, 0), tensor_ms(x, 0, experts_only, frame_bound)
    graphs = x.n_layer * (1 if experts_only else 2) + 1
    return (base_layer - base_tensor) * 1e3 / (graphs - x.nodes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dispatch-us", default="0,10,20,50,100,200")
    parser.add_argument("--bandwidth-gbs", type=float, default=Inputs.bandwidth_gbs)
    parser.add_argument("--nodes", type=int, default=Inputs.nodes)
    args = parser.parse_args()
    x = Inputs(bandwidth_gbs=args.bandwidth_gbs, nodes=args.nodes)
    print(f"Kimi K2 Q4 on {x.nodes} Macs: {gb(x.active_params, x):.1f} GB of active weights per token, "
          f"{x.bandwidth_gbs:.0f} GB/s per Mac; an all-reduce of {x.n_embd * 4 // 1024} KiB costs "
          f"{allreduce_us(x, False):.1f} us (bandwidth) or {allreduce_us(x, True):.1f} us (frames)")
    print(f"{'dispatch us':>11} {'layer':>14} {'TP full (bw)':>14} {'TP full (frames)':>16} "
          f"{'TP experts (bw)':>15} {'TP experts (frames)':>19}")
    for d in (float(v) for v in args.dispatch_us.split(",")):
        cells = [layer_ms(x, d), tensor_ms(x, d, False, False), tensor_ms(x, d, False, True),
                 tensor_ms(x, d, True, False), tensor_ms(x, d, True, True)]
        print(f"{d:11.0f} " + " ".join(f"{ms:6.1f} ms {1e3 / ms:4.0f}/s".rjust(w)
                                       for ms, w in zip(cells, (14, 14, 16, 15, 19))))
    for experts_only in (False, True):
        for frames in (False, True):
            print(f"TP {'experts' if experts_only else 'full'} ({'frames' if frames else 'bandwidth'}) wins below "
                  f"{flip_us(x, experts_only, frames):.0f} us per graph dispatch")


if __name__ == "__main__":
    main()
