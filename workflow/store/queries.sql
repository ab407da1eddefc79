-- Every statement pgworkflow sends, each under a `-- name: ...` header and one line
-- saying what it does. Loaded by name in workflow/store/__init__.py, the only
-- module that runs them. Wake-ups go to the channel `%(channel)s` (store.CHANNEL),
-- their payload a workflow name. Writes made after a claim carry `claim_id = %(claim_id)s`:
-- zero rows back means another executor owns the run. A write that lets go of the
-- claim records it in `released_claim`, so the same write retried after its reply
-- was lost can tell that its own earlier try landed (`released`).


-- name: insert_run
-- Insert a run and its task snapshot (claimed by the caller when claim_id is set; woken pollers otherwise).
-- An idempotency key that a transaction still open has inserted makes the insert wait for that
-- transaction; with key_wait set, set_config bounds the wait (lock_timeout, for this statement's
-- own transaction only), evaluated as part of the key's value, before the insert looks for a conflict.
WITH run AS (
    INSERT INTO workflow_runs (id, workflow, status, idempotency_key, input, input_sealed,
                               context, context_sealed, task_count, current_seq,
                               claim_id, heartbeat_at, finished_at)
    VALUES (%(id)s, %(workflow)s, %(status)s,
            CASE WHEN %(key_wait)s::text IS NULL THEN %(idempotency_key)s
                 ELSE %(idempotency_key)s || left(set_config('lock_timeout', %(key_wait)s, true), 0)
            END,
            %(input)s::jsonb, %(input_sealed)s, %(context)s::jsonb, %(context_sealed)s,
            %(task_count)s, %(current_seq)s, %(claim_id)s,
            CASE WHEN %(claim_id)s::uuid IS NULL THEN NULL ELSE now() END,
            CASE WHEN %(status)s = 'succeeded' THEN now() END)
    ON CONFLICT (workflow, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING id, created_at
), tasks AS (
    INSERT INTO workflow_tasks (run_id, seq, name, skipped, finished_at)
    SELECT run.id, t.seq::smallint, t.name, t.skipped, CASE WHEN t.skipped THEN run.created_at END
    FROM run,
         unnest(%(names)s::text[], %(skipped)s::boolean[]) WITH ORDINALITY AS t (name, skipped, seq)
)
SELECT run.id,
       (SELECT pg_notify(%(channel)s, %(workflow)s) WHERE %(wake)s)
FROM run;


-- name: inserted_run
-- The run with this id, if an earlier try of insert_run committed it (the id is random: only ours).
SELECT id, NULL FROM workflow_runs WHERE id = %(id)s;


-- name: find_idempotent_run
-- The run an earlier start inserted under this workflow and idempotency key.
SELECT id FROM workflow_runs WHERE workflow = %(workflow)s AND idempotency_key = %(idempotency_key)s;


-- name: claim_run
-- Claim one run by id when it is claimable now; SKIP LOCKED makes a double kick claim once.
WITH pick AS (
    SELECT id FROM workflow_runs
    WHERE id = %(id)s AND claim_id IS NULL AND finished_at IS NULL AND next_retry_at <= now()
    FOR UPDATE SKIP LOCKED
), claimed AS (
    UPDATE workflow_runs r
    SET claim_id = %(claim_id)s, heartbeat_at = now(), status = 'running', released_claim = NULL
    FROM pick WHERE r.id = pick.id
    RETURNING r.id, r.workflow, r.claim_id, r.input, r.input_sealed, r.context,
              r.context_sealed, r.current_seq, r.created_at
)
SELECT c.id, c.workflow, c.claim_id, c.input, c.input_sealed, c.context::text, c.context_sealed,
       c.current_seq, now(), t.seq, t.name, t.skipped, t.attempts, t.output IS NOT NULL, t.output,
       t.failed_at
FROM claimed c JOIN workflow_tasks t ON t.run_id = c.id
ORDER BY t.seq;


-- name: claim_runs
-- Claim up to `limit` claimable runs of the given workflows, oldest first (the poller), the n-th
-- oldest under the n-th of the caller's claim ids.
WITH pick AS (
    SELECT id, created_at FROM workflow_runs
    WHERE claim_id IS NULL AND finished_at IS NULL AND next_retry_at <= now()
      AND workflow = ANY(%(workflows)s::text[])
    ORDER BY created_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), numbered AS (
    SELECT id, row_number() OVER (ORDER BY created_at, id) AS n FROM pick
), claimed AS (
    UPDATE workflow_runs r
    SET claim_id = (%(claims)s::uuid[])[numbered.n], heartbeat_at = now(), status = 'running',
        released_claim = NULL
    FROM numbered WHERE r.id = numbered.id
    RETURNING r.id, r.workflow, r.claim_id, r.input, r.input_sealed, r.context,
              r.context_sealed, r.current_seq, r.created_at
)
SELECT c.id, c.workflow, c.claim_id, c.input, c.input_sealed, c.context::text, c.context_sealed,
       c.current_seq, now(), t.seq, t.name, t.skipped, t.attempts, t.output IS NOT NULL, t.output,
       t.failed_at
FROM claimed c JOIN workflow_tasks t ON t.run_id = c.id
ORDER BY c.created_at, c.id, t.seq;


-- name: claimed_runs
-- The runs these claims hold, with their snapshots: what a claim whose reply was lost took.
SELECT c.id, c.workflow, c.claim_id, c.input, c.input_sealed, c.context::text, c.context_sealed,
       c.current_seq, now(), t.seq, t.name, t.skipped, t.attempts, t.output IS NOT NULL, t.output,
       t.failed_at
FROM workflow_runs c JOIN workflow_tasks t ON t.run_id = c.id
WHERE c.claim_id = ANY(%(claims)s::uuid[])
ORDER BY c.created_at, c.id, t.seq;


-- name: complete_task
-- Record a task's output and move the run to its next task, or finish it (fenced).
WITH run AS (
    UPDATE workflow_runs
    SET current_seq = %(next_seq)s,
        status = CASE WHEN %(finishes)s THEN 'succeeded' ELSE status END,
        finished_at = CASE WHEN %(finishes)s THEN now() END,
        claim_id = CASE WHEN %(finishes)s THEN NULL ELSE claim_id END,
        heartbeat_at = CASE WHEN %(finishes)s THEN NULL ELSE now() END,
        released_claim = CASE WHEN %(finishes)s THEN claim_id END
    WHERE id = %(id)s AND claim_id = %(claim_id)s
    RETURNING id
)
UPDATE workflow_tasks t
SET output = %(output)s::jsonb, finished_at = now()
FROM run
WHERE t.run_id = run.id AND t.seq = %(seq)s
RETURNING t.seq;


-- name: fail_task
-- Record a failed attempt: retry after `delay` seconds, under the claim or released for a poller (fenced).
-- The attempt count is absolute (the executor knows it under its claim), so a retry cannot count twice.
WITH run AS (
    UPDATE workflow_runs
    SET claim_id = CASE WHEN %(keep_claim)s THEN claim_id END,
        heartbeat_at = CASE WHEN %(keep_claim)s THEN now() END,
        released_claim = CASE WHEN %(keep_claim)s THEN NULL ELSE claim_id END,
        next_retry_at = now() + make_interval(secs => %(delay)s)
    WHERE id = %(id)s AND claim_id = %(claim_id)s
    RETURNING id
)
UPDATE workflow_tasks t
SET attempts = %(attempts)s, error = %(error)s, error_code = %(code)s, failed_at = now()
FROM run
WHERE t.run_id = run.id AND t.seq = %(seq)s
RETURNING t.attempts;


-- name: park_run
-- Park the run on its task `seq`, stopped for a person with the last error, its claim let go (fenced).
WITH run AS (
    UPDATE workflow_runs
    SET status = 'parked', finished_at = now(), claim_id = NULL, heartbeat_at = NULL,
        released_claim = claim_id
    WHERE id = %(id)s AND claim_id = %(claim_id)s
    RETURNING id
)
UPDATE workflow_tasks t
SET attempts = %(attempts)s,
    error = %(error)s,
    error_code = %(code)s,
    failed_at = CASE WHEN %(spent)s THEN now() ELSE t.failed_at END
FROM run
WHERE t.run_id = run.id AND t.seq = %(seq)s
RETURNING t.attempts;


-- name: release_claim
-- Give up a claim without ending an attempt, not claimable before retry_at (or for delay seconds) if
-- given (fenced; wakes pollers when due).
WITH run AS (
    UPDATE workflow_runs
    SET claim_id = NULL, heartbeat_at = NULL, released_claim = claim_id,
        next_retry_at = coalesce(%(retry_at)s, now() + make_interval(secs => %(delay)s),
                                 next_retry_at)
    WHERE id = %(id)s AND claim_id = %(claim_id)s
    RETURNING id, workflow, next_retry_at <= now() AS due
)
SELECT run.id, CASE WHEN run.due THEN pg_notify(%(channel)s, run.workflow) END
FROM run;


-- name: released
-- Whether this claim let go of the run by its own write: a retried write's earlier try landed.
SELECT id FROM workflow_runs WHERE id = %(id)s AND claim_id IS NULL AND released_claim = %(claim_id)s;


-- name: heartbeat
-- Keep the given claims alive; returns the claims still held (a missing one was lost).
UPDATE workflow_runs SET heartbeat_at = now()
WHERE claim_id = ANY(%(claims)s::uuid[])
RETURNING claim_id;


-- name: sweep
-- Release claims whose heartbeat is older than max_age and count the abandoned attempt.
WITH stale AS (
    SELECT id FROM workflow_runs
    WHERE claim_id IS NOT NULL AND heartbeat_at < now() - make_interval(secs => %(max_age)s)
    ORDER BY heartbeat_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), run AS (
    UPDATE workflow_runs r
    SET claim_id = NULL, heartbeat_at = NULL, next_retry_at = now()
    FROM stale WHERE r.id = stale.id
    RETURNING r.id, r.workflow, r.current_seq
), bump AS (
    UPDATE workflow_tasks t
    SET attempts = t.attempts + 1, failed_at = now(),
        error = 'the attempt was abandoned: its executor stopped heartbeating (crashed, or hung past its timeout)',
        error_code = NULL
    FROM run WHERE t.run_id = run.id AND t.seq = run.current_seq
    RETURNING t.run_id
)
SELECT run.id, pg_notify(%(channel)s, run.workflow) FROM run;


-- name: run_status
-- A run's status, times, the task it is on (for Failure), and whether it is claimable now.
SELECT r.workflow, r.status, r.created_at, r.finished_at, t.name, t.error, t.error_code, t.attempts,
       r.claim_id IS NULL AND r.finished_at IS NULL AND r.next_retry_at <= now()
FROM workflow_runs r
LEFT JOIN workflow_tasks t ON t.run_id = r.id AND t.seq = r.current_seq
WHERE r.id = %(id)s;


-- name: run_input
-- A run's workflow name and stored input.
SELECT workflow, input, input_sealed FROM workflow_runs WHERE id = %(id)s;


-- name: current_database
-- The database this session is connected to, as the server names it.
SELECT current_database();


-- name: listen
-- Subscribe this session to the wake-up channel (the listener's own connection); store.CHANNEL.
LISTEN workflow_runs;
