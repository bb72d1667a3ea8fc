"""How long and how much memory planning a trillion-parameter model takes.

Writes shape-only Kimi K2 and DeepSeek V3 split sets (sparse files, a few MB
on disk) into a temporary directory, then times ``tbrpc.plan`` from a cold
read of the headers, in a fresh process per case so peak RSS is the planner's
own.  Target: under 2 s and under 500 MB per plan.

    python benchmarks/plan_scale.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.fixtures_shapes import DEEPSEEK_V3, KIMI_K2, deepseek2_spec, write_shape_only  # noqa: E402

_CASE = r"""
import json, resource, sys, time
sys.path.insert(0, sys.argv[1])
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
from tbrpc.node_memory import nodes_from_flags
from tbrpc.plan import plan
t0 = time.perf_counter()
p = plan(sys.argv[2], nodes_from_flags([], sys.argv[3]), ctx=int(sys.argv[4]))
elapsed = time.perf_counter() - t0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
print(json.dumps({"seconds": elapsed, "peak_rss_mib": rss / 1024, "import_rss_mib": rss0 / 1024, "fits": p.fits,
                  "max_ctx": p.shortfall.max_ctx if p.shortfall else None,
                  "min_nodes": p.shortfall.min_nodes if p.shortfall else None}))
"""


def run_case(shard: Path, nodes: str, ctx: int) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", _CASE, str(ROOT), str(shard), nodes, str(ctx)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        models = {
            "Kimi K2 Q4_K_M": write_shape_only(deepseek2_spec(KIMI_K2), Path(tmp) / "kimi.gguf", 50 * 10**9, KIMI_K2.n_vocab),
            "DeepSeek V3 Q4_K_M": write_shape_only(deepseek2_spec(DEEPSEEK_V3), Path(tmp) / "dsv3.gguf", 50 * 10**9, DEEPSEEK_V3.n_vocab),
        }
        print(f"{'model':20} {'nodes':10} {'ctx':>6} {'fits':>5} {'seconds':>8} {'peak RSS':>9}  shortfall search")
        for name, shards in models.items():
            for nodes in ("4x512GiB", "2x512GiB", "1x512GiB"):
                r = run_case(shards[0], nodes, 32768)
                extra = "" if r["fits"] else f"max_ctx={r['max_ctx']} min_nodes={r['min_nodes']}"
                print(f"{name:20} {nodes:10} {32768:>6} {str(r['fits']):>5} {r['seconds']:>8.3f} {r['peak_rss_mib']:>6.0f} MiB  {extra}")


if __name__ == "__main__":
    main()
