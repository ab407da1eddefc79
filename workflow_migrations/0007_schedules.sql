-- Schedules (SPEC 14): one row per schedule, upserted by every worker whose
-- registry holds it. A tick fires in one transaction that locks the row
-- (FOR UPDATE SKIP LOCKED), inserts the tick's run under the idempotency key
-- schedule:{name}:{tick} and advances next_tick, so it fires exactly once however
-- many workers run, with no leader and no state in memory. Expand-only: a table.
CREATE TABLE workflow_schedules (
    name          text PRIMARY KEY,
    workflow      text NOT NULL,
    cron          text NOT NULL,
    timezone      text NOT NULL,
    catchup       text NOT NULL CHECK (catchup IN ('latest', 'all', 'none')),
    -- The next tick to fire (an instant; the cron is read in `timezone`).
    next_tick     timestamptz NOT NULL,
    last_tick     timestamptz,
    last_run      uuid,
    paused        boolean NOT NULL DEFAULT false,
    -- Removed from the code of the workers that run its workflow: it no longer
    -- fires; the row stays for its history.
    orphaned      boolean NOT NULL DEFAULT false,
    -- A person asked for one run now (`schedules trigger`); the next worker to see
    -- it starts that run under a key of its own and clears this.
    triggered_at  timestamptz,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now()
);
