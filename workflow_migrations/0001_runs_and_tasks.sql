-- The two tables of pgworkflow: a run, and its snapshot of ordered tasks.

CREATE TABLE workflow_runs (
    id              uuid PRIMARY KEY,
    workflow        text NOT NULL,
    status          text NOT NULL DEFAULT 'pending'
                    CHECK (status IN ('pending', 'running', 'succeeded', 'parked', 'cancelled')),
    idempotency_key text,
    -- The input and the calling context: plain JSON, or sealed by the cipher.
    input           jsonb,
    input_sealed    bytea,
    context         jsonb,
    context_sealed  bytea,
    task_count      smallint NOT NULL CHECK (task_count >= 1),
    -- The task the run is on (1-based); task_count + 1 once every task is done.
    current_seq     smallint NOT NULL,
    -- The claim fences every write of the executor that holds it.
    claim_id        uuid,
    heartbeat_at    timestamptz,
    -- Not claimable before this time (database clock).
    next_retry_at   timestamptz NOT NULL DEFAULT now(),
    created_at      timestamptz NOT NULL DEFAULT now(),
    finished_at     timestamptz,
    CONSTRAINT workflow_runs_one_input CHECK ((input IS NULL) <> (input_sealed IS NULL)),
    CONSTRAINT workflow_runs_one_context CHECK (context IS NULL OR context_sealed IS NULL),
    CONSTRAINT workflow_runs_claim_heartbeat CHECK ((claim_id IS NULL) = (heartbeat_at IS NULL))
);

-- One run per (workflow, idempotency key).
CREATE UNIQUE INDEX workflow_runs_idempotency
    ON workflow_runs (workflow, idempotency_key)
    WHERE idempotency_key IS NOT NULL;

-- The poller's claim query: unfinished, unclaimed runs in creation order. Finished
-- runs are not in it, so its cost does not grow with history.
CREATE INDEX workflow_runs_claimable
    ON workflow_runs (created_at, id)
    WHERE claim_id IS NULL AND finished_at IS NULL;

-- The sweeper's stale-claim query: claimed runs by heartbeat age.
CREATE INDEX workflow_runs_claimed
    ON workflow_runs (heartbeat_at)
    WHERE claim_id IS NOT NULL;

CREATE TABLE workflow_tasks (
    run_id      uuid NOT NULL REFERENCES workflow_runs (id) ON DELETE CASCADE,
    seq         smallint NOT NULL CHECK (seq >= 1),
    name        text NOT NULL,
    skipped     boolean NOT NULL DEFAULT false,
    -- Attempts that have ended: failed, timed out, or abandoned and swept.
    attempts    integer NOT NULL DEFAULT 0,
    output      jsonb,
    error       text,
    error_code  text,
    failed_at   timestamptz,
    finished_at timestamptz,
    PRIMARY KEY (run_id, seq)
);
