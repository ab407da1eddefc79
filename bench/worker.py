"""A stand-in for `python -m workflow.worker` while that module does not exist.

Same flags as the spec's worker CLI (section 6); builds a Manager over the
`--app` factory's registry and runs one runnable until SIGTERM/SIGINT.

    python -m bench.worker --app bench.apps:factory --database-url URL --concurrency 8
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import threading

import workflow


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--app", required=True)
    p.add_argument("--database-url", default=os.environ.get("WORKFLOW_DATABASE_URL"))
    p.add_argument("--concurrency", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--poll-interval", type=float)
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--sweep-interval", type=float)
    p.add_argument("--no-listen", action="store_true")
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args()
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    module, _, attr = args.app.partition(":")
    made = getattr(importlib.import_module(module), attr)
    made = made() if callable(made) else made
    if isinstance(made, workflow.App):
        reg, config, logger = made.registry, made.config, made.logger
    else:
        reg, config, logger = made, None, None
    mgr = workflow.Manager(args.database_url, reg, config, logger=logger)
    runnable = mgr.new_runnable(
        workflow.RunnerConfig(
            poll_interval=args.poll_interval,
            batch_size=args.batch_size,
            concurrency=args.concurrency,
            sweep_enabled=not args.no_sweep,
            sweep_interval=args.sweep_interval,
            listen=not args.no_listen,
        )
    )
    stopping = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        if stopping.is_set():
            os._exit(1)
        stopping.set()
        threading.Thread(target=runnable.stop, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    runnable.run()
    mgr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
