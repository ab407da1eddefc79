"""The chaos test's own tables, in the chaos database beside the engine's two.

- `chaos_started`: one row per run the starter started, written in the same
  transaction as `start_tx` (so it exists iff the run committed) or right after a
  `start()` returned.
- `chaos_exec`: the ledger, one row per handler execution, written by the handler
  itself: a fresh execution id, the run, seq and attempt, the process, the claim id
  the executing engine holds (read from the executor's frame), the claim the
  database showed when the handler began, the output of the previous task the
  handler read, and start and end times from the database clock
  (`clock_timestamp()`). `ended_at` stays NULL for an execution that never got to
  the end (its process was killed).
- `chaos_claims` (a trigger on `workflow_runs`): every change of a run's claim id,
  with the database clock, the transaction id and the `application_name` of the
  session that made it (each process has its own), so the checks know when each
  claim became valid, when it stopped being valid, and which process set it.
- `chaos_task_events` (a trigger on `workflow_tasks`): every change of a task's
  output or attempt count, with the error text stored with it (a sweep's bump says
  "abandoned"), the clock and the transaction id.
- `chaos_key_holds` (a trigger on `workflow_runs`): every change of a keyed run's
  slot of its key (SPEC 15), with the database clock and the transaction id, so
  the checks know when each run held its key. The trigger is named to fire
  before `chaos_log_claim`: in a statement that takes a slot and a claim, the
  hold is stamped first.
- `chaos_faults`: what the runner did to the processes and the server, in the
  database clock: each SIGKILL (`kill`, the victim's application name), each
  SIGTERM that asks a process to drain (`stop`), and the server restart
  (`restart`, from just before it to just after).

The triggers only observe: they add rows to the test's tables and never change the
engine's.
"""

from __future__ import annotations

TABLES = """
CREATE TABLE chaos_started (
    run_id     uuid PRIMARY KEY,
    via        text NOT NULL,
    started_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE TABLE chaos_exec (
    exec_id        uuid PRIMARY KEY,
    run_id         uuid NOT NULL,
    seq            integer NOT NULL,
    attempt        integer NOT NULL,
    pid            integer NOT NULL,
    claim_id       uuid,
    claim_at_start uuid,
    prev_output    text,
    started_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    ended_at       timestamptz,
    outcome        text
);
CREATE INDEX chaos_exec_task ON chaos_exec (run_id, seq);

CREATE TABLE chaos_claims (
    id        bigserial PRIMARY KEY,
    run_id    uuid NOT NULL,
    old_claim uuid,
    new_claim uuid,
    at        timestamptz NOT NULL DEFAULT clock_timestamp(),
    xid       bigint NOT NULL DEFAULT txid_current(),
    app       text NOT NULL DEFAULT current_setting('application_name')
);
CREATE INDEX chaos_claims_run ON chaos_claims (run_id);

CREATE TABLE chaos_key_holds (
    id        bigserial PRIMARY KEY,
    run_id    uuid NOT NULL,
    key       bytea NOT NULL,
    old_slot  smallint,
    new_slot  smallint,
    at        timestamptz NOT NULL DEFAULT clock_timestamp(),
    xid       bigint NOT NULL DEFAULT txid_current()
);

CREATE TABLE chaos_faults (
    id     bigserial PRIMARY KEY,
    kind   text NOT NULL CHECK (kind IN ('kill', 'restart', 'stop')),
    app    text,
    at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    until_ timestamptz
);

CREATE TABLE chaos_task_events (
    id           bigserial PRIMARY KEY,
    run_id       uuid NOT NULL,
    seq          integer NOT NULL,
    old_output   jsonb,
    new_output   jsonb,
    old_attempts integer NOT NULL,
    new_attempts integer NOT NULL,
    error        text,
    at           timestamptz NOT NULL DEFAULT clock_timestamp(),
    xid          bigint NOT NULL DEFAULT txid_current()
);
CREATE INDEX chaos_task_events_task ON chaos_task_events (run_id, seq);

CREATE FUNCTION chaos_log_claim() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        IF NEW.claim_id IS NOT NULL THEN
            INSERT INTO chaos_claims (run_id, old_claim, new_claim)
            VALUES (NEW.id, NULL, NEW.claim_id);
        END IF;
    ELSIF OLD.claim_id IS DISTINCT FROM NEW.claim_id THEN
        INSERT INTO chaos_claims (run_id, old_claim, new_claim)
        VALUES (NEW.id, OLD.claim_id, NEW.claim_id);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER chaos_log_claim AFTER INSERT OR UPDATE ON workflow_runs
    FOR EACH ROW EXECUTE FUNCTION chaos_log_claim();

CREATE FUNCTION chaos_key_log() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.concurrency_key IS NULL THEN
        RETURN NULL;
    END IF;
    IF TG_OP = 'INSERT' THEN
        IF NEW.key_slot IS NOT NULL THEN
            INSERT INTO chaos_key_holds (run_id, key, old_slot, new_slot)
            VALUES (NEW.id, NEW.concurrency_key, NULL, NEW.key_slot);
        END IF;
    ELSIF OLD.key_slot IS DISTINCT FROM NEW.key_slot THEN
        INSERT INTO chaos_key_holds (run_id, key, old_slot, new_slot)
        VALUES (NEW.id, NEW.concurrency_key, OLD.key_slot, NEW.key_slot);
    END IF;
    RETURN NULL;
END $$;

-- Fires before chaos_log_claim (triggers of one event fire in name order).
CREATE TRIGGER chaos_key_log AFTER INSERT OR UPDATE ON workflow_runs
    FOR EACH ROW EXECUTE FUNCTION chaos_key_log();

CREATE FUNCTION chaos_log_task() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.output IS DISTINCT FROM NEW.output OR OLD.attempts IS DISTINCT FROM NEW.attempts THEN
        INSERT INTO chaos_task_events
            (run_id, seq, old_output, new_output, old_attempts, new_attempts, error)
        VALUES (NEW.run_id, NEW.seq, OLD.output, NEW.output, OLD.attempts, NEW.attempts,
                NEW.error);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER chaos_log_task AFTER UPDATE ON workflow_tasks
    FOR EACH ROW EXECUTE FUNCTION chaos_log_task();
"""

SWEEP_ERROR_PREFIX = "the attempt was abandoned"
"""How the sweep statement's bump of the attempt count reads (workflow/store/queries.sql)."""
