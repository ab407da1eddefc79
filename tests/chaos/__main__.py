"""`python -m tests.chaos [--short] [--minutes N]`: run the chaos scenario, print its summary."""

from __future__ import annotations

import argparse
import sys

import attrs

from .runner import Plan, run_chaos


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    parser.add_argument("--short", action="store_true", help="about 70 s of load (CI)")
    parser.add_argument("--minutes", type=float, default=10.0, help="load time of the long mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate", type=float, default=None, help="runs started per second")
    parser.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args(argv)
    plan = Plan.short(args.seed) if args.short else Plan.long(args.minutes, args.seed)
    if args.rate is not None:
        plan = attrs.evolve(plan, rate=args.rate)
    result = run_chaos(plan, keep_logs=args.keep_logs)
    for problem in result.problems + result.report.problems:
        print(f"chaos: PROBLEM: {problem}")
    print(result.summary())
    if not result.ok:
        print(f"chaos: FAILED; logs kept in {result.logdir}")
        return 1
    print("chaos: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
