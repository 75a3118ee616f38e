"""A py-spy recording (`py-spy record --subprocesses --threads -f raw`) as a short table per process and thread:
how busy it was, the functions it spent its own time in, and the project's functions with the time under them.

    python test/gpu/spy_summary.py SPY.txt --rate 250 --seconds 7 [--top 8] [--idle]

`--idle` for a recording taken with py-spy's `--idle`: its samples include the threads' waits, so the share is of
the wall time sampled, not busy time, and the own-time frames show where a thread waits.
"""

from __future__ import annotations

import argparse
import collections
import re

# py-spy's frame of a process names it with its quoted command line, which may hold ";" (a spawned process's
# `-c "...; spawn_main(...)"`): the frame is cut to `process PID` before the stack is split
PROCESS_FRAME = re.compile(r'process (\d+):".*?"(?=;|$)')


def summarize(lines, top: int = 8, width: int = 90) -> list[tuple[str, int, list, list]]:
    """Per root (the innermost `process ...` frame, with its `thread ...` frame): samples, the top frames by own
    samples and the top lightllm frames by samples under them, busiest root first."""
    own = collections.defaultdict(collections.Counter)
    under = collections.defaultdict(collections.Counter)
    total = collections.Counter()
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not count.isdigit():
            continue
        frames, n = PROCESS_FRAME.sub(r"process \1", stack).split(";"), int(count)
        starts = [i for i, f in enumerate(frames) if f.startswith("process ")]
        first = starts[-1] if starts else -1
        root = frames[first] if starts else "?"
        rest = frames[first + 1 :]
        if rest and rest[0].startswith("thread "):
            root, rest = f"{root} {rest[0][:40]}", rest[1:]
        if not rest:
            continue
        total[root] += n
        own[root][rest[-1][:width]] += n
        for frame in {f[:width] for f in rest if "lightllm" in f}:
            under[root][frame] += n
    return [(root, n, own[root].most_common(top), under[root].most_common(top)) for root, n in total.most_common()]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path")
    p.add_argument("--rate", type=float, required=True, help="the recording's samples per second")
    p.add_argument("--seconds", type=float, required=True, help="the recording's duration")
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--roots", type=int, default=5, help="the busiest process/thread roots printed")
    p.add_argument("--idle", action="store_true", help="the recording has idle samples (py-spy --idle)")
    a = p.parse_args(argv)
    with open(a.path) as f:
        rows = summarize(f, a.top)
    for root, n, own, under in rows[: a.roots]:
        share = "of the wall time, waits included" if a.idle else "busy"
        print(f"-- {root}: {n} samples, {n / a.rate / a.seconds:.0%} {share}; own time:")
        for frame, k in own:
            print(f"  {100 * k / n:5.1f}%  {frame}")
        print("  under the project's functions:")
        for frame, k in under:
            print(f"  {100 * k / n:5.1f}%  {frame}")


if __name__ == "__main__":
    main()
