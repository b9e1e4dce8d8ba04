"""Where the tensor-core attention kernel's time goes, block by block.

Needs a build with TQ_MMA_PROBE=3 (`cmake -S . -B build -DTURBOQUANT_MMA_TUNE=TQ_MMA_PROBE=3`),
whose kernel prints, for every block, the %globaltimer (ns) and the SM clock at its
entry, when its tables and queries were ready, when its warp 0 and when all its warps
were done with the keys, and when its results were written. Runs
bench/attention_once.py with the arguments given and summarises the last call:

    python tools/mma_timeline.py --context 131072 --calls 3

The kernel's span is from the first block's entry to the last block's end; the phases
are medians over the blocks (µs, and SM cycles for the per-block ones).
"""

import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


# the kernel's marks (TQ_MMA_MARK in attention_mma.cuh), in order
MARKS = [
    "indices",
    "first copies issued",
    "key table",
    "value table",
    "queries loaded",
    "query fragments",
    "tables-ready barrier",
    "warp 0's keys done",
    "all warps' keys done",
    "partials in shared memory",
    "results written",
]


def main():
    cmd = [sys.executable, os.path.join(HERE, "..", "bench", "attention_once.py"), *sys.argv[1:]]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    rows = []  # chunk, split, z, sm, gt0, gt1, cycles at marks 1..11
    for line in res.stdout.splitlines():
        f = line.split()
        if f and f[0] == "TQT":
            rows.append([int(x) for x in f[1:]])
    if not rows:
        sys.exit(
            f"no TQT lines (not a TQ_MMA_PROBE=3 build?)\n{res.stdout[-2000:]}{res.stderr[-2000:]}"
        )
    rows.sort(key=lambda r: r[4])
    calls, cur = [], [rows[0]]
    for r in rows[1:]:
        if r[4] - cur[-1][4] > 50_000:  # 50 µs between entries: the next call
            calls.append(cur)
            cur = []
        cur.append(r)
    calls.append(cur)
    print(f"{len(calls)} calls, blocks per call: {[len(c) for c in calls]}")
    for i, c in enumerate(calls):
        t0 = min(r[4] for r in c)
        span = (max(r[5] for r in c) - t0) / 1e3
        ghz = statistics.median(r[-1] / max(1, r[5] - r[4]) for r in c)
        print(
            f"call {i}: {len(c)} blocks on {len(set(r[3] for r in c))} SMs, span {span:.1f} µs, "
            f"block median {statistics.median((r[5] - r[4]) / 1e3 for r in c):.2f} µs, {ghz:.2f} GHz"
        )
    c = calls[-1]
    print(f"\nlast call, per block (median over {len(c)} blocks), SM cycles:")
    prev = [0] * len(c)
    for k, name in enumerate(MARKS):
        at = [r[6 + k] for r in c]
        if statistics.median(at) <= 0:  # mark not on this kernel's path
            continue
        d = statistics.median(a - b for a, b in zip(at, prev))
        print(f"  {name:28s} +{d:8.0f}   at {statistics.median(at):8.0f}")
        prev = at
    starts = sorted((r[4] - t0) / 1e3 for r in c)
    ends = sorted((r[5] - t0) / 1e3 for r in c)
    q = lambda v, f: v[min(len(v) - 1, int(f * len(v)))]  # noqa: E731
    print(
        "  entries at (µs) min/25/50/75/max:",
        [round(q(starts, f), 2) for f in (0, 0.25, 0.5, 0.75, 1)],
    )
    print(
        "  ends at (µs)    min/25/50/75/max:",
        [round(q(ends, f), 2) for f in (0, 0.25, 0.5, 0.75, 1)],
    )


if __name__ == "__main__":
    main()
