"""Summarise a py-spy `--format raw` (collapsed stacks) profile: top self and inclusive.

py-spy record --format raw -o out.txt -- python -m bench.engine fast ...
python -m bench.profile_summary out.txt [--top 25] [--thread-prefix workflow-run]
"""

from __future__ import annotations

import argparse
import collections
import re

# First match wins, tested against the whole stack (outermost first).
CATEGORIES = [
    (
        "startup (imports, Manager, migrate)",
        (
            "_find_and_load",
            "SourceLoader",
            "Manager.__init__",
            "migrate (",
            "prepare (bench",
            "ConnectionPool.__init__",
        ),
    ),
    (
        "pool maintenance / heartbeat threads",
        ("Heartbeat._loop", "Worker.run (psycopg_pool", "MaintenanceTask", "Scheduler.run"),
    ),
    (
        "psycopg: sending the statement, waiting for the result",
        ("Cursor.execute", "Cursor.fetchall", "Connection.execute"),
    ),
    (
        "connection checkout/return (psycopg_pool, Store warm stack)",
        (
            "ConnectionPool.connection",
            "ConnectionPool.getconn",
            "ConnectionPool.putconn",
            "Store._conn",
            "Store._take",
            "Store._give_back",
        ),
    ),
    (
        "thread hand-off (RunThreads, completion latch, Event, Condition)",
        (
            "RunThreads.",
            "_Completion.",
            "ThreadPoolExecutor.submit",
            "_worker (concurrent",
            "Event.wait",
            "Event.set",
            "Condition.",
        ),
    ),
    ("engine Python (executor, manager, codec, lease, uuid)", ("(workflow/",)),
    ("benchmark loop", ("(bench/",)),
    # psycopg's generators resumed from its C wait loop show no caller frames.
    ("psycopg: sending the statement, waiting for the result", ("(psycopg/",)),
]


def _short(path: str) -> str:
    """A source path without site-packages/ or the repo prefix."""
    return path.split("site-packages/")[-1].replace("/work/main/", "")


def categorize(stack: str) -> str:
    # Test innermost-first ownership: a frame deeper in the stack decides among the
    # statement/pool/hand-off groups; startup and background threads by any frame.
    for name, needles in CATEGORIES[:2]:
        if any(n in stack for n in needles):
            return name
    frames = stack.split(";")
    for frame in reversed(frames):
        for name, needles in CATEGORIES[2:]:
            if any(n in frame for n in needles):
                return name
    return "other"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("path")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--files", action="store_true", help="also group by file")
    args = p.parse_args()
    self_t: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    files: collections.Counter[str] = collections.Counter()
    cats: collections.Counter[str] = collections.Counter()
    total = 0
    with open(args.path) as f:
        lines = f.read().splitlines()
    for line in lines:
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        n = int(count)
        total += n
        frames = stack.split(";")
        names = []
        for f in frames:
            m = re.match(r"(.*) \((.*?):\d+\)$", f)
            names.append(f"{m.group(1)} ({_short(m.group(2))})" if m else f)
        self_t[names[-1]] += n
        cats[categorize(";".join(names))] += n
        for name in set(names):
            incl[name] += n
        leaf = frames[-1]
        m = re.match(r".* \((.*?):\d+\)$", leaf)
        files[
            (m.group(1).split("site-packages/")[-1].replace("/work/main/", "") if m else leaf)
        ] += n
    print(f"total samples: {total}")
    print("\n== by category (innermost matching frame)")
    for name, n in cats.most_common():
        print(f"{100 * n / total:5.1f}%  {name}")
    print(f"\n== top {args.top} by self time")
    for name, n in self_t.most_common(args.top):
        print(f"{100 * n / total:5.1f}%  {name}")
    print(f"\n== top {args.top} by inclusive time")
    for name, n in incl.most_common(args.top):
        print(f"{100 * n / total:5.1f}%  {name}")
    if args.files:
        print("\n== by file (self)")
        for name, n in files.most_common(args.top):
            print(f"{100 * n / total:5.1f}%  {name}")


if __name__ == "__main__":
    main()
