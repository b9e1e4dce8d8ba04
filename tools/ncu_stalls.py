"""Summarises an Nsight Compute report of one kernel: where its warps wait.

    ncu --section WarpStateStats --section SourceCounters \
        --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio -o rep ...
    python tools/ncu_stalls.py rep.ncu-rep

Prints the stall reasons (warps stalled per issued instruction, largest first) and the
SASS instructions with the most stall samples, each with its leading stall reasons.
"""

import collections
import csv
import io
import subprocess
import sys


def ncu_csv(report, *args):
    out = subprocess.run(
        ["ncu", "-i", report, "--csv", *args], capture_output=True, text=True, check=False
    ).stdout
    lines = [line for line in out.splitlines() if line.startswith('"')]
    return list(csv.reader(io.StringIO("\n".join(lines))))


def number(s):
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return None


def regions(body, head, si):
    """The source rows split by how often each instruction ran: the per-iteration code
    (run at least 8 times as often as the most common count, which is once per warp),
    what comes before its first instruction (the set-up: tables, queries, first copies)
    and after its last (the warps' merge, the results), and the rest of that span (code
    some iterations take). Address order alone misleads: parts of the unrolled loop sit
    before its first mma. None without an execution count column or a loop."""
    if "Instructions Executed" not in head:
        return None
    ei = head.index("Instructions Executed")
    runs = [number(r[ei]) or 0.0 for r in body]
    counts = collections.Counter(x for x in runs if x > 0)
    if not counts:
        return None
    per_iteration = 8 * counts.most_common(1)[0][0]
    loop = [i for i, x in enumerate(runs) if x >= per_iteration]
    if not loop:
        return None
    parts = {
        "set-up (before the loop)": [],
        "per-iteration code": [],
        "code some iterations take": [],
        "after the loop": [],
    }
    for i, r in enumerate(body):
        if runs[i] >= per_iteration:
            parts["per-iteration code"].append(r)
        elif i < loop[0]:
            parts["set-up (before the loop)"].append(r)
        elif i > loop[-1]:
            parts["after the loop"].append(r)
        else:
            parts["code some iterations take"].append(r)
    return parts


def main():
    report = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    rows = ncu_csv(report, "--page", "raw")
    if len(rows) >= 3:
        head, values = rows[0], rows[2]
        stalls = []
        for name, v in zip(head, values):
            x = number(v)
            if "issue_stalled" in name and name.endswith("per_issue_active.ratio") and x:
                stalls.append((x, name.split("issue_stalled_")[1].split("_per_issue")[0]))
            elif x is not None and any(
                k in name
                for k in (
                    "sm__cycles_elapsed.avg.per_second",
                    "smsp__issue_active.avg.per_cycle",
                    "gpu__time_duration.sum",
                    "dram__throughput.avg.pct",
                )
            ):
                print(f"{name:60s} {v}")
        print("\nstall reason (warps stalled per issued instruction):")
        for x, n in sorted(stalls, reverse=True)[:16]:
            print(f"  {n:28s} {x:7.3f}")
    src = ncu_csv(report, "--page", "source", "--print-source", "sass")
    if not src:
        print("(no source page)")
        return
    # the page may open with the kernel's name: the header is the row naming the samples
    hi = next(
        (i for i, r in enumerate(src) if any(h.startswith("Warp Stall Sampling (All") for h in r)),
        None,
    )
    if hi is None:
        print("(no stall samples on the source page; first rows:", src[:3], ")")
        return
    head, src = src[hi], src[hi:]
    si = next(i for i, h in enumerate(head) if h.startswith("Warp Stall Sampling (All"))
    # one column per stall reason (all samples), not the totals or the not-issued subsets
    reasons = [
        i
        for i, h in enumerate(head)
        if i != si
        and not h.startswith("Warp Stall Sampling")
        and "Not Issued" not in h
        and (h.startswith("stall_") or "Stall" in h)
    ]
    body = [r for r in src[1:] if len(r) == len(head) and number(r[si]) is not None]
    total = sum(number(r[si]) for r in body) or 1.0
    parts = regions(body, head, si)
    if parts:
        print("\nstall samples by region (by how often each instruction ran):")
        for name, rs in parts.items():
            print(
                f"  {name:34s} {100 * sum(number(r[si]) for r in rs) / total:5.1f}%  ({len(rs)} instructions)"
            )
    print(f"\ntotal stall samples {total:.0f}; top {top} instructions:")
    for r in sorted(body, key=lambda r: -number(r[si]))[:top]:
        why = sorted(((number(r[i]) or 0.0, head[i]) for i in reasons), reverse=True)[:3]
        why = ", ".join(f"{h.replace('stall_', '')} {x:.0f}" for x, h in why if x > 0)
        print(f"  {100 * number(r[si]) / total:5.1f}%  {r[0]:>6s} {r[1][:60]:60s} {why}")


if __name__ == "__main__":
    main()
