"""A model, not a measurement: Kimi K2 at Q4 on four Mac Studios, layer split
against tensor split, per generated token.

Nothing here ran on a Mac. The inputs are stated below and can be changed
on the command line; the output says which split wins at each per-graph
dispatch overhead and where the answer flips.

Per token, decode (one token, so each all-reduce carries n_embd floats):

  layer split   the nodes run one after another: every active weight is read
                once, by one node  ->  bytes / bandwidth
                + one graph dispatch per node, + one activation hop per node
                (each hop is to the next node in the ring: any cabling will do)
  tensor split  every node reads its share at the same time:
                full TP     (replicated + split / N) / bandwidth, 2 all-reduces per layer
                experts TP  attention, shared expert and dense layers whole on every
                            node, routed experts split: 1 all-reduce per layer
                + one graph dispatch per subgraph (the meta backend runs a subgraph per
                  all-reduce, plus one), + the all-reduces

Routed experts in experts TP (--experts):
  cut    every node holds every expert at 1/N of its inner width (tbrpc's
         split_rules.c): each node reads 1/N of the 8 selected experts
  whole  every node holds 1/N of the experts: a token waits for the node that
         drew the most of its 8 (uniform routing: the exact expectation of the
         hypergeometric maximum, 3.52 experts of 8 for 4 nodes, 1.76x the mean;
         skewed real routing is worse)
  benchmarks/bench_experts.py measures both kernels.

An all-reduce of S bytes (--cabling):
  mesh         a cable per pair (6 for 4 Macs, 3 per Mac). tbrpc's mesh ALLREDUCE
               sends each partial straight to every other node (node_links.c),
               all links at once: one message, latency + S / bandwidth, or,
               counting TB5's 4.6 us per 4 KiB frame, ceil(S / 4 KiB) frames
  ring         4 cables, each Mac cabled to two neighbours; no routing over
               Thunderbolt, so tbrpc's ring ALLREDUCE (TB_ALLREDUCE_RING, what a
               cluster file with a ring of `links` gets): reduce-scatter then
               all-gather, 2(N-1) steps one after another, each a message of
               S/N to a neighbour
  ring-direct  4 cables and the mesh ALLREDUCE (TBRPC_ALLREDUCE=mesh): neighbours over their
               cable, the two non-neighbour pairs over the ordinary network
               (their peer link dials the node's `host`, TCP), so every
               all-reduce waits for that network: --lan-latency-us + S / --lan-gbit
Both figures (bandwidth, frames) are printed for the Thunderbolt messages.

    python benchmarks/tp_model.py [--cabling mesh|ring|ring-direct] [--experts cut|whole]
                                  [--dispatch-us 0,10,20,50,100] [--bandwidth-gbs 650] ...
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace

CABLINGS = ("mesh", "ring", "ring-direct")


@dataclass(frozen=True)
class Inputs:
    n_layer: int = 61                 # Kimi K2 / DeepSeek V3
    n_embd: int = 7168
    active_params: float = 31.5e9     # per token (the brief's figure: 8 of 384 experts + shared + attention)
    replicated_params: float = 6.2e9  # attention, shared experts, dense layers, embeddings/output
    n_expert: int = 384
    n_expert_used: int = 8
    bits_per_weight: float = 4.5      # Q4_K-class quantization
    bandwidth_gbs: float = 650.0      # achieved memory bandwidth of one M3 Ultra (819 GB/s peak)
    nodes: int = 4
    link_latency_us: float = 4.6      # TB5 RDMA, one 4 KiB frame (TN3205-class figure)
    link_gbit: float = 75.0           # TB5 RDMA payload bandwidth
    cabling: str = "mesh"
    experts: str = "cut"
    lan_latency_us: float = 50.0      # ring-direct: one TCP message over the ordinary network (10 GbE; assumed)
    lan_gbit: float = 10.0            # the Mac Studio's Ethernet


def gb(params: float, x: Inputs) -> float:
    return params * x.bits_per_weight / 8 / 1e9


def message_us(x: Inputs, size: int, frame_bound: bool) -> float:
    """One message over one Thunderbolt cable."""
    if frame_bound:
        return math.ceil(size / 4096) * x.link_latency_us
    return x.link_latency_us + size / (x.link_gbit / 8 * 1e9) * 1e6


def allreduce_us(x: Inputs, frame_bound: bool) -> float:
    size = x.n_embd * 4
    if x.cabling == "ring":
        return 2 * (x.nodes - 1) * message_us(x, math.ceil(size / x.nodes), frame_bound)
    direct = message_us(x, size, frame_bound)
    if x.cabling == "ring-direct" and x.nodes > 3:   # 3 nodes in a ring are a full mesh
        return max(direct, x.lan_latency_us + size / (x.lan_gbit / 8 * 1e9) * 1e6)
    return direct


def busiest_share(x: Inputs) -> float:
    """Expected experts of a token's n_expert_used on the node that holds the most of them, over
    the mean (n_expert_used / nodes), experts in equal blocks, uniform routing: exact."""
    held, used, n = x.n_expert // x.nodes, x.n_expert_used, x.nodes

    def ways(node: int, left: int, most: int) -> float:   # sum over placements of C(held, c_i)... x max
        if node == n - 1:
            return math.comb(held, left) * max(most, left) if left <= held else 0.0
        return sum(math.comb(held, c) * ways(node + 1, left - c, max(most, c)) for c in range(min(held, left) + 1))

    return ways(0, used, 0) / math.comb(x.n_expert, used) / (used / n)


def layer_ms(x: Inputs, dispatch_us: float) -> float:
    compute = gb(x.active_params, x) / x.bandwidth_gbs * 1e3
    hops = x.nodes * message_us(x, x.n_embd * 4, frame_bound=False) / 1e3   # one activation hop per node
    return compute + hops + x.nodes * dispatch_us / 1e3


def tensor_ms(x: Inputs, dispatch_us: float, experts_only: bool, frame_bound: bool) -> float:
    split = x.active_params - x.replicated_params
    if experts_only:
        per_node = x.replicated_params + split / x.nodes * (busiest_share(x) if x.experts == "whole" else 1.0)
    else:
        per_node = x.active_params / x.nodes
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
    parser.add_argument("--cabling", choices=CABLINGS, default=Inputs.cabling)
    parser.add_argument("--experts", choices=("cut", "whole"), default=Inputs.experts)
    parser.add_argument("--lan-latency-us", type=float, default=Inputs.lan_latency_us)
    parser.add_argument("--lan-gbit", type=float, default=Inputs.lan_gbit)
    args = parser.parse_args()
    x = replace(Inputs(), bandwidth_gbs=args.bandwidth_gbs, nodes=args.nodes, cabling=args.cabling,
                experts=args.experts, lan_latency_us=args.lan_latency_us, lan_gbit=args.lan_gbit)
    print(f"Kimi K2 Q4 on {x.nodes} Macs, {x.cabling} cabling, routed experts {x.experts}"
          + (f" (busiest node x{busiest_share(x):.2f} the mean)" if x.experts == "whole" else "")
          + f": {gb(x.active_params, x):.1f} GB of active weights per token, {x.bandwidth_gbs:.0f} GB/s per Mac; "
          f"an all-reduce of {x.n_embd * 4 // 1024} KiB costs {allreduce_us(x, False):.1f} us (bandwidth) "
          f"or {allreduce_us(x, True):.1f} us (frames)")
    print(f"{'dispatch us':>11} {'layer':>14} {'TP full (bw)':>14} {'TP full (frames)':>16} "
          f"{'TP experts (bw)':>15} {'TP experts (frames)':>19}")
    for d in (float(v) for v in args.dispatch_us.split(",")):
        cells = [layer_ms(x, d), tensor_ms(x, d, False, False), tensor_ms(x, d, False, True),
                 tensor_ms(x, d, True, False), tensor_ms(x, d, True, True)]
        print(f"{d:11.0f} " + " ".join(f"{ms:6.1f} ms {1e3 / ms:4.0f}/s".rjust(w)
                                       for ms, w in zip(cells, (14, 14, 16, 15, 19))))
    for experts_only in (False, True):
        for frames in (False, True):
            flip = flip_us(x, experts_only, frames)
            print(f"TP {'experts' if experts_only else 'full'} ({'frames' if frames else 'bandwidth'}) "
                  + (f"wins below {flip:.0f} us per graph dispatch" if flip > 0 else "never wins"))


if __name__ == "__main__":
    main()
