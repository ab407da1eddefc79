-- Every statement pgworkflow sends, each under a `-- name: ...` header and one line
-- saying what it does. Loaded by name in workflow/store/__init__.py, the only
-- module that runs them. Wake-ups go to the channel `%(channel)s` (store.CHANNEL),
-- their payload a workflow name. Writes made after a claim carry `claim_id = %(claim_id)s`:
-- zero rows back means another executor owns the run. A write that lets go of the
-- claim records it in `released_claim`, so the same write retried after its reply
-- was lost can tell that its own earlier try landed (`released`).


-- name: insert_run
-- Insert a run with no idempotency key and its task snapshot (claimed by the caller when claim_id is set;
-- woken pollers otherwise), due now, at run_at, or delay seconds from now (database clock). Its creation
-- time is the clock's at the insert, not the transaction's start: the runs one transaction starts are in
-- the order it started them. A run with an idempotency key goes through insert_idempotent_run, one with a
-- concurrency key through insert_keyed_run. No ON CONFLICT here: an insert that may conflict is made as a
-- speculative insertion, which costs a confirmation record in the WAL (48 bytes a run) even when no key is
-- there to conflict with.
WITH run AS (
    INSERT INTO workflow_runs (id, workflow, status, input, input_sealed,
                               context, context_sealed, task_count, current_seq,
                               claim_id, heartbeat_at, finished_at, traceparent, tracestate,
                               next_retry_at, created_at)
    VALUES (%(id)s, %(workflow)s, %(status)s,
            %(input)s::jsonb, %(input_sealed)s, %(context)s::jsonb, %(context_sealed)s,
            %(task_count)s, %(current_seq)s, %(claim_id)s,
            CASE WHEN %(claim_id)s::uuid IS NULL THEN NULL ELSE now() END,
            CASE WHEN %(status)s = 'succeeded' THEN now() END,
            %(traceparent)s, %(tracestate)s,
            CASE WHEN %(run_at)s::timestamptz IS NOT NULL THEN %(run_at)s::timestamptz
                 WHEN %(delay)s::float8 IS NOT NULL THEN now() + make_interval(secs => %(delay)s::float8)
                 ELSE now() END,
            clock_timestamp())
    RETURNING id, created_at
), tasks AS (
    INSERT INTO workflow_tasks (run_id, seq, name, skipped, finished_at)
    SELECT run.id, t.seq::smallint, t.name, t.skipped, CASE WHEN t.skipped THEN run.created_at END
    FROM run,
         unnest(%(names)s::text[], %(skipped)s::boolean[]) WITH ORDINALITY AS t (name, skipped, seq)
)
SELECT run.id,
       (SELECT pg_notify(%(channel)s, %(workflow)s) WHERE %(wake)s),
       %(claim_id)s::uuid IS NOT NULL
FROM run;


-- name: insert_idempotent_run
-- insert_run for a run with an idempotency key: nothing is inserted (no row) when the workflow has a run
-- with that key already.
-- An idempotency key that a transaction still open has inserted makes the insert wait for that
-- transaction; with key_wait set, set_config bounds the wait (lock_timeout, for this statement's
-- own transaction only), evaluated as part of the key's value, before the insert looks for a conflict.
WITH run AS (
    INSERT INTO workflow_runs (id, workflow, status, idempotency_key, input, input_sealed,
                               context, context_sealed, task_count, current_seq,
                               claim_id, heartbeat_at, finished_at, traceparent, tracestate,
                               next_retry_at, created_at)
    VALUES (%(id)s, %(workflow)s, %(status)s,
            CASE WHEN %(key_wait)s::text IS NULL THEN %(idempotency_key)s
                 ELSE %(idempotency_key)s || left(set_config('lock_timeout', %(key_wait)s, true), 0)
            END,
            %(input)s::jsonb, %(input_sealed)s, %(context)s::jsonb, %(context_sealed)s,
            %(task_count)s, %(current_seq)s, %(claim_id)s,
            CASE WHEN %(claim_id)s::uuid IS NULL THEN NULL ELSE now() END,
            CASE WHEN %(status)s = 'succeeded' THEN now() END,
            %(traceparent)s, %(tracestate)s,
            CASE WHEN %(run_at)s::timestamptz IS NOT NULL THEN %(run_at)s::timestamptz
                 WHEN %(delay)s::float8 IS NOT NULL THEN now() + make_interval(secs => %(delay)s::float8)
                 ELSE now() END,
            clock_timestamp())
    ON CONFLICT (workflow, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING id, created_at
), tasks AS (
    INSERT INTO workflow_tasks (run_id, seq, name, skipped, finished_at)
    SELECT run.id, t.seq::smallint, t.name, t.skipped, CASE WHEN t.skipped THEN run.created_at END
    FROM run,
         unnest(%(names)s::text[], %(skipped)s::boolean[]) WITH ORDINALITY AS t (name, skipped, seq)
)
SELECT run.id,
       (SELECT pg_notify(%(channel)s, %(workflow)s) WHERE %(wake)s),
       %(claim_id)s::uuid IS NOT NULL
FROM run;


-- name: insert_runs
-- insert_run for several runs with neither an idempotency key nor a concurrency key, in one statement and one
-- commit (group commit of the fast path's starts), in the order given; per run its id, the wake-up, and whether
-- it is claimed. `names` and `skipped` hold each run's task snapshot as an array literal. `fence`: as in
-- complete_tasks.
WITH fence AS (
    SELECT pg_advisory_xact_lock(%(fence)s) AS held
), given AS (
    SELECT * FROM unnest(%(id)s::uuid[], %(workflow)s::text[], %(status)s::text[], %(input)s::text[],
                         %(input_sealed)s::bytea[], %(context)s::text[], %(context_sealed)s::bytea[],
                         %(task_count)s::smallint[], %(current_seq)s::smallint[], %(claim_id)s::uuid[],
                         %(names)s::text[], %(skipped)s::text[], %(wake)s::boolean[],
                         %(traceparent)s::text[], %(tracestate)s::text[], %(run_at)s::timestamptz[],
                         %(delay)s::float8[])
        WITH ORDINALITY AS g (id, workflow, status, input, input_sealed, context, context_sealed,
                              task_count, current_seq, claim_id, names, skipped, wake, traceparent,
                              tracestate, run_at, delay, n)
    WHERE (SELECT held FROM fence) IS NOT NULL
), run AS (
    INSERT INTO workflow_runs (id, workflow, status, input, input_sealed, context, context_sealed,
                               task_count, current_seq, claim_id, heartbeat_at, finished_at,
                               traceparent, tracestate, next_retry_at, created_at)
    SELECT id, workflow, status, input::jsonb, input_sealed, context::jsonb, context_sealed,
           task_count, current_seq, claim_id,
           CASE WHEN claim_id IS NULL THEN NULL ELSE now() END,
           CASE WHEN status = 'succeeded' THEN now() END,
           traceparent, tracestate,
           CASE WHEN run_at IS NOT NULL THEN run_at
                WHEN delay IS NOT NULL THEN now() + make_interval(secs => delay)
                ELSE now() END,
           clock_timestamp()
    FROM given ORDER BY n
    RETURNING id, created_at
), tasks AS (
    INSERT INTO workflow_tasks (run_id, seq, name, skipped, finished_at)
    SELECT run.id, t.seq::smallint, t.name, t.skipped, CASE WHEN t.skipped THEN run.created_at END
    FROM run JOIN given g ON g.id = run.id,
         unnest(g.names::text[], g.skipped::boolean[]) WITH ORDINALITY AS t (name, skipped, seq)
)
SELECT run.id, (SELECT pg_notify(%(channel)s, g.workflow) WHERE g.wake), g.claim_id IS NOT NULL
FROM run JOIN given g ON g.id = run.id;

-- name: insert_keyed_run
-- insert_run for a run with a concurrency key (its digest): claimed by the caller only when claim_id is set and
-- its key has a free slot below `concurrency` and no run waiting for one (it takes the lowest free slot);
-- otherwise inserted waiting for a slot, the pollers woken. Due and creation times as in insert_run, the
-- idempotency key's wait as in insert_idempotent_run.
WITH slot AS (
    SELECT CASE WHEN %(claim_id)s::uuid IS NOT NULL THEN (
        SELECT min(s)::smallint FROM generate_series(0, %(concurrency)s - 1) AS s
        WHERE NOT EXISTS (SELECT FROM workflow_runs h
                          WHERE h.workflow = %(workflow)s AND h.concurrency_key = %(concurrency_key)s
                            AND h.key_slot = s)
          AND NOT EXISTS (SELECT FROM workflow_runs w
                          WHERE w.workflow = %(workflow)s AND w.concurrency_key = %(concurrency_key)s
                            AND w.finished_at IS NULL AND w.key_slot IS NULL
                            AND w.next_retry_at <= now())
    ) END AS n
), mine AS (
    SELECT slot.n, CASE WHEN slot.n IS NOT NULL THEN %(claim_id)s::uuid END AS claim_id
    FROM slot
), run AS (
    INSERT INTO workflow_runs (id, workflow, status, idempotency_key, input, input_sealed,
                               context, context_sealed, task_count, current_seq,
                               claim_id, heartbeat_at, finished_at, traceparent, tracestate,
                               next_retry_at, concurrency_key, key_slot, created_at)
    SELECT %(id)s, %(workflow)s,
           CASE WHEN %(status)s = 'running' AND mine.claim_id IS NULL THEN 'pending' ELSE %(status)s END,
           CASE WHEN %(key_wait)s::text IS NULL THEN %(idempotency_key)s
                ELSE %(idempotency_key)s || left(set_config('lock_timeout', %(key_wait)s, true), 0)
           END,
           %(input)s::jsonb, %(input_sealed)s, %(context)s::jsonb, %(context_sealed)s,
           %(task_count)s, %(current_seq)s, mine.claim_id,
           CASE WHEN mine.claim_id IS NULL THEN NULL ELSE now() END,
           CASE WHEN %(status)s = 'succeeded' THEN now() END,
           %(traceparent)s, %(tracestate)s,
           CASE WHEN %(run_at)s::timestamptz IS NOT NULL THEN %(run_at)s::timestamptz
                WHEN %(delay)s::float8 IS NOT NULL THEN now() + make_interval(secs => %(delay)s::float8)
                ELSE now() END,
           %(concurrency_key)s, mine.n, clock_timestamp()
    FROM mine
    ON CONFLICT (workflow, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING id, created_at, claim_id
), tasks AS (
    INSERT INTO workflow_tasks (run_id, seq, name, skipped, finished_at)
    SELECT run.id, t.seq::smallint, t.name, t.skipped, CASE WHEN t.skipped THEN run.created_at END
    FROM run,
         unnest(%(names)s::text[], %(skipped)s::boolean[]) WITH ORDINALITY AS t (name, skipped, seq)
)
SELECT run.id,
       (SELECT pg_notify(%(channel)s, %(workflow)s)
        WHERE %(wake)s OR (%(claim_id)s::uuid IS NOT NULL AND run.claim_id IS NULL)),
       run.claim_id IS NOT NULL
FROM run;


-- name: inserted_run
-- The run with this id, if an earlier try of this start's insert committed it (the id is random: only ours).
SELECT id, NULL, coalesce(claim_id = %(claim_id)s::uuid, false) FROM workflow_runs WHERE id = %(id)s;


-- name: find_idempotent_run
-- The run an earlier start inserted under this workflow and idempotency key.
SELECT id FROM workflow_runs WHERE workflow = %(workflow)s AND idempotency_key = %(idempotency_key)s;


-- name: claim_run
-- Claim one run by id when it is claimable now (a keyed run waiting for a slot is not); SKIP LOCKED
-- makes a double kick claim once.
WITH pick AS (
    SELECT id FROM workflow_runs
    WHERE id = %(id)s AND claim_id IS NULL AND finished_at IS NULL AND next_retry_at <= now()
      AND (concurrency_key IS NULL OR key_slot IS NOT NULL)
    FOR UPDATE SKIP LOCKED
), claimed AS (
    UPDATE workflow_runs r
    SET claim_id = %(claim_id)s, heartbeat_at = now(), status = 'running', released_claim = NULL
    FROM pick WHERE r.id = pick.id
    RETURNING r.id, r.workflow, r.claim_id, r.input, r.input_sealed, r.context,
              r.context_sealed, r.current_seq, r.created_at, r.sealed_for,
              r.next_retry_at, r.traceparent, r.tracestate, r.concurrency_key
)
SELECT c.id, c.workflow, c.claim_id, c.input, c.input_sealed, c.context::text, c.context_sealed,
       c.current_seq, now(), c.sealed_for,
       extract(epoch FROM now() - greatest(c.created_at, c.next_retry_at))::float8,
       c.traceparent, c.tracestate, c.concurrency_key, c.next_retry_at, t.seq, t.name, t.skipped, t.attempts,
       t.output IS NOT NULL, t.output, t.failed_at
FROM claimed c JOIN workflow_tasks t ON t.run_id = c.id
ORDER BY t.seq;


-- name: claim_runs
-- Claim up to `limit` claimable runs of the given workflows, longest due first (the poller; a new
-- run is due from its creation, so new runs go in creation order), the n-th under the n-th of the
-- caller's claim ids. Read through workflow_runs_ready_per_workflow, each workflow apart from its first
-- due run: runs due later, keyed runs waiting for a slot (a keyed run holding its slot is claimed here)
-- and the runs of workflows the caller does not serve (another service's backlog, the runs a renamed
-- workflow left behind) are never visited. Each workflow's first `limit` unlocked runs are locked and
-- the `limit` due first among them all are claimed: with W workflows' runs due, a claim locks up to W x
-- `limit` runs to take `limit`, until its commit (a lock each, written to the WAL; a claim made meanwhile
-- skips them, and finds nothing when they were all there was). The caller names each workflow once.
-- `floors` (one per workflow, or NULL) is where the caller's claims of a backlog left off (store/floors.py):
-- the scan starts there instead of at the front of the index, where every run claimed since the last vacuum
-- has left an entry to step over (2.0 ms a claim after 38,500 drained; 0.1 ms from the last claimed run).
-- "Unclaimed and unfinished" is spelt `num_nonnulls(claim_id, finished_at) = 0`, as that index's
-- predicate spells it, so that no other index's predicate follows from the query: until 0013 dropped
-- them, with `claim_id IS NULL AND finished_at IS NULL` the planner could read workflow_runs_ready (by
-- due time alone) and filter on the workflow, which reads every other workflow's due runs, or
-- workflow_runs_claimable (by creation) and sort the whole backlog at every claim, as it did on a
-- table whose statistics were taken before the backlog came (1.2 ms of server CPU a job).
-- The parameters are read through `given`, one materialized row, so that no estimate depends on their
-- values: the plan PostgreSQL makes without them is then as cheap as one made for them, so after five
-- executions it keeps that generic plan for the connection instead of planning every execution anew
-- (0.7 ms of planning against 0.4 ms of execution). A LIMIT it cannot read is estimated at a tenth of its
-- input, which made that plan read every run to join the picked ones; `numbered` takes the picked ids
-- from an array (estimated at 10) under the same LIMIT (so at one), and each run is found by its primary
-- key, numbered in the claim's order.
WITH given AS MATERIALIZED (
    SELECT %(workflows)s::text[] AS workflows, %(floors)s::timestamptz[] AS floors,
           %(limit)s::int AS lim, %(claims)s::uuid[] AS new_claims
), pick AS (
    SELECT c.id, c.created_at, c.next_retry_at
    FROM unnest((SELECT workflows FROM given), (SELECT floors FROM given)) AS w (name, floor),
         LATERAL (SELECT id, created_at, next_retry_at FROM workflow_runs
                  WHERE workflow = w.name AND num_nonnulls(claim_id, finished_at) = 0
                    AND (concurrency_key IS NULL OR key_slot IS NOT NULL) AND next_retry_at <= now()
                    AND next_retry_at >= coalesce(w.floor, '-infinity')
                  ORDER BY next_retry_at, created_at, id
                  LIMIT (SELECT lim FROM given)
                  FOR UPDATE SKIP LOCKED) AS c
    ORDER BY c.next_retry_at, c.created_at, c.id
    LIMIT (SELECT lim FROM given)
), numbered AS (
    SELECT p.id, p.n
    FROM unnest(ARRAY(SELECT id FROM pick ORDER BY next_retry_at, created_at, id))
         WITH ORDINALITY AS p (id, n)
    LIMIT (SELECT lim FROM given)
), claimed AS (
    UPDATE workflow_runs r
    SET claim_id = (SELECT new_claims FROM given)[numbered.n], heartbeat_at = now(),
        status = 'running', released_claim = NULL
    FROM numbered WHERE r.id = numbered.id
    RETURNING r.id, r.workflow, r.claim_id, r.input, r.input_sealed, r.context,
              r.context_sealed, r.current_seq, r.created_at, r.sealed_for,
              r.next_retry_at, r.traceparent, r.tracestate, r.concurrency_key
)
SELECT c.id, c.workflow, c.claim_id, c.input, c.input_sealed, c.context::text, c.context_sealed,
       c.current_seq, now(), c.sealed_for,
       extract(epoch FROM now() - greatest(c.created_at, c.next_retry_at))::float8,
       c.traceparent, c.tracestate, c.concurrency_key, c.next_retry_at, t.seq, t.name, t.skipped, t.attempts,
       t.output IS NOT NULL, t.output, t.failed_at
FROM claimed c JOIN workflow_tasks t ON t.run_id = c.id
ORDER BY c.created_at, c.id, t.seq;


-- name: wake
-- Wake the pollers for a workflow (a poller leaving a key's next run to the others).
SELECT pg_notify(%(channel)s, %(workflow)s);


-- name: claim_key_head
-- Claim the next run of one key when the key has a slot free below `concurrency`: its oldest due waiting run,
-- taking the lowest free slot (a poller whose execution of a run of this key just ended: the key's backlog
-- drains through the worker that frees it, one index probe each, with no walk of the other keys). Nothing
-- when that run is locked (another claim is taking it) or the key has no slot free.
WITH head AS (
    SELECT id FROM workflow_runs
    WHERE workflow = %(workflow)s AND concurrency_key = %(concurrency_key)s
      AND finished_at IS NULL AND key_slot IS NULL AND next_retry_at <= now()
    ORDER BY created_at, id
    LIMIT 1
), slot AS (
    SELECT min(s)::smallint AS n FROM generate_series(0, %(concurrency)s - 1) AS s
    WHERE NOT EXISTS (SELECT FROM workflow_runs h
                      WHERE h.workflow = %(workflow)s AND h.concurrency_key = %(concurrency_key)s
                        AND h.key_slot = s)
), pick AS (
    SELECT r.id FROM workflow_runs r
    WHERE r.id = (SELECT id FROM head)  -- by primary key: never a walk of the open runs
      AND r.claim_id IS NULL AND r.finished_at IS NULL AND r.key_slot IS NULL
      AND (SELECT n FROM slot) IS NOT NULL
    FOR UPDATE OF r SKIP LOCKED
), claimed AS (
    UPDATE workflow_runs r
    SET claim_id = %(claim_id)s, heartbeat_at = now(), status = 'running', released_claim = NULL,
        key_slot = (SELECT n FROM slot)
    WHERE r.id = (SELECT id FROM pick)
    RETURNING r.id, r.workflow, r.claim_id, r.input, r.input_sealed, r.context,
              r.context_sealed, r.current_seq, r.created_at, r.sealed_for,
              r.next_retry_at, r.traceparent, r.tracestate, r.concurrency_key
)
SELECT c.id, c.workflow, c.claim_id, c.input, c.input_sealed, c.context::text, c.context_sealed,
       c.current_seq, now(), c.sealed_for,
       extract(epoch FROM now() - greatest(c.created_at, c.next_retry_at))::float8,
       c.traceparent, c.tracestate, c.concurrency_key, c.next_retry_at, t.seq, t.name, t.skipped, t.attempts,
       t.output IS NOT NULL, t.output, t.failed_at
FROM claimed c JOIN workflow_tasks t ON t.run_id = c.id
ORDER BY t.seq;


-- name: next_due
-- Seconds until the earliest unclaimed, unfinished run of the given workflows is due (negative:
-- overdue; NULL: none): the first entry of each workflow in workflow_runs_ready_per_workflow (read as
-- claim_runs reads it), or each workflow's first in workflow_runs_key_due_per_workflow still to come (a
-- keyed run started with a delay, waiting for a slot). Neither half visits the runs of other workflows.
-- Each half spells its predicate as its index does (num_nonnulls), so that no other index serves it.
SELECT extract(epoch FROM least(
    (SELECT min(first.at)
     FROM unnest(%(workflows)s::text[]) AS w (name),
          LATERAL (SELECT next_retry_at FROM workflow_runs
                   WHERE workflow = w.name AND num_nonnulls(claim_id, finished_at) = 0
                     AND (concurrency_key IS NULL OR key_slot IS NOT NULL)
                   ORDER BY next_retry_at LIMIT 1) AS first (at)),
    (SELECT min(first.at)
     FROM unnest(%(workflows)s::text[]) AS w (name),
          LATERAL (SELECT next_retry_at FROM workflow_runs
                   WHERE workflow = w.name AND num_nonnulls(finished_at, key_slot) = 0
                     AND concurrency_key IS NOT NULL AND next_retry_at > now()
                   ORDER BY next_retry_at LIMIT 1) AS first (at))
) - now())::float8;


-- name: claim_key_heads
-- Give the free slots of keys to the runs waiting for them, and claim those runs (the poller, for keyed
-- workflows): of the keys of the given workflows with runs waiting, at most `visit` per workflow read in
-- digest order from `start` (random bytes: digests are uniform, so every key's turn comes alike),
-- wrapping around to the first; per key read, its oldest due waiting runs, as many as it has slots free
-- below its workflow's limit (`limits`, paired with `workflows`), each taking the lowest free slot; at
-- most `limit` runs, longest due first, the n-th under the n-th claim id. Keys are found by a loose scan
-- of workflow_runs_key_queue (one probe per key, not per run waiting), so the cost is bounded by `visit`
-- whatever the number of keys; the unique workflow_runs_key_slots makes a slot taken twice by racing
-- claims fail instead.
WITH RECURSIVE limits AS (
    SELECT * FROM unnest(%(workflows)s::text[], %(limits)s::int[]) AS l (workflow, most)
), upper_keys AS (
    SELECT limits.workflow, limits.most, k.concurrency_key, 1 AS visited
    FROM limits, LATERAL (
        SELECT concurrency_key FROM workflow_runs
        WHERE workflow = limits.workflow AND concurrency_key >= %(start)s
          AND finished_at IS NULL AND concurrency_key IS NOT NULL AND key_slot IS NULL
        ORDER BY concurrency_key LIMIT 1
    ) AS k
    UNION ALL
    SELECT u.workflow, u.most, k.concurrency_key, u.visited + 1
    FROM upper_keys AS u, LATERAL (
        SELECT concurrency_key FROM workflow_runs
        WHERE workflow = u.workflow AND concurrency_key > u.concurrency_key
          AND finished_at IS NULL AND concurrency_key IS NOT NULL AND key_slot IS NULL
        ORDER BY concurrency_key LIMIT 1
    ) AS k
    WHERE u.visited < %(visit)s
), lower_keys AS (
    SELECT limits.workflow, limits.most, k.concurrency_key,
           1 + (SELECT count(*) FROM upper_keys AS u WHERE u.workflow = limits.workflow) AS visited
    FROM limits, LATERAL (
        SELECT concurrency_key FROM workflow_runs
        WHERE workflow = limits.workflow AND concurrency_key < %(start)s
          AND finished_at IS NULL AND concurrency_key IS NOT NULL AND key_slot IS NULL
        ORDER BY concurrency_key LIMIT 1
    ) AS k
    WHERE (SELECT count(*) FROM upper_keys AS u WHERE u.workflow = limits.workflow) < %(visit)s
    UNION ALL
    SELECT w.workflow, w.most, k.concurrency_key, w.visited + 1
    FROM lower_keys AS w, LATERAL (
        SELECT concurrency_key FROM workflow_runs
        WHERE workflow = w.workflow AND concurrency_key > w.concurrency_key
          AND concurrency_key < %(start)s
          AND finished_at IS NULL AND concurrency_key IS NOT NULL AND key_slot IS NULL
        ORDER BY concurrency_key LIMIT 1
    ) AS k
    WHERE w.visited < %(visit)s
), keys AS (
    SELECT workflow, most, concurrency_key FROM upper_keys
    UNION ALL
    SELECT workflow, most, concurrency_key FROM lower_keys
), free AS (
    SELECT keys.workflow, keys.concurrency_key,
           ARRAY(SELECT s FROM generate_series(0, keys.most - 1) AS s
                 WHERE NOT EXISTS (SELECT FROM workflow_runs h
                                   WHERE h.workflow = keys.workflow
                                     AND h.concurrency_key = keys.concurrency_key
                                     AND h.key_slot = s)
                 ORDER BY s) AS slots
    FROM keys
), heads AS (
    SELECT w.id, free.workflow, free.concurrency_key, free.slots
    FROM free, LATERAL (
        SELECT id FROM workflow_runs
        WHERE workflow = free.workflow AND concurrency_key = free.concurrency_key
          AND finished_at IS NULL AND key_slot IS NULL AND next_retry_at <= now()
        ORDER BY created_at, id
        LIMIT cardinality(free.slots)
    ) AS w
    WHERE cardinality(free.slots) > 0
), pick AS (
    SELECT r.id, r.created_at, r.next_retry_at FROM workflow_runs r
    WHERE r.id = ANY(ARRAY(SELECT id FROM heads))  -- by primary key: never a walk of the open runs
      AND r.claim_id IS NULL AND r.finished_at IS NULL AND r.key_slot IS NULL
      AND r.next_retry_at <= now()
    ORDER BY r.next_retry_at, r.created_at, r.id
    LIMIT %(limit)s
    FOR UPDATE OF r SKIP LOCKED
), numbered AS (
    SELECT pick.id,
           heads.slots[row_number() OVER (PARTITION BY heads.workflow, heads.concurrency_key
                                          ORDER BY pick.created_at, pick.id)] AS slot,
           row_number() OVER (ORDER BY pick.next_retry_at, pick.created_at, pick.id) AS n
    FROM pick JOIN heads ON heads.id = pick.id
), claimed AS (
    UPDATE workflow_runs r
    SET claim_id = (%(claims)s::uuid[])[numbered.n], heartbeat_at = now(), status = 'running',
        released_claim = NULL, key_slot = numbered.slot
    FROM numbered WHERE r.id = numbered.id AND r.id = ANY(ARRAY(SELECT id FROM numbered))
    RETURNING r.id, r.workflow, r.claim_id, r.input, r.input_sealed, r.context,
              r.context_sealed, r.current_seq, r.created_at, r.sealed_for,
              r.next_retry_at, r.traceparent, r.tracestate, r.concurrency_key
)
SELECT c.id, c.workflow, c.claim_id, c.input, c.input_sealed, c.context::text, c.context_sealed,
       c.current_seq, now(), c.sealed_for,
       extract(epoch FROM now() - greatest(c.created_at, c.next_retry_at))::float8,
       c.traceparent, c.tracestate, c.concurrency_key, c.next_retry_at, t.seq, t.name, t.skipped, t.attempts,
       t.output IS NOT NULL, t.output, t.failed_at
FROM claimed c JOIN workflow_tasks t ON t.run_id = c.id
ORDER BY c.created_at, c.id, t.seq;

-- name: claimed_runs
-- The runs these claims hold, with their snapshots: what a claim whose reply was lost took.
SELECT c.id, c.workflow, c.claim_id, c.input, c.input_sealed, c.context::text, c.context_sealed,
       c.current_seq, now(), c.sealed_for,
       extract(epoch FROM now() - greatest(c.created_at, c.next_retry_at))::float8,
       c.traceparent, c.tracestate, c.concurrency_key, c.next_retry_at, t.seq, t.name, t.skipped, t.attempts,
       t.output IS NOT NULL, t.output, t.failed_at
FROM workflow_runs c JOIN workflow_tasks t ON t.run_id = c.id
WHERE c.claim_id = ANY(%(claims)s::uuid[])
ORDER BY c.created_at, c.id, t.seq;


-- name: complete_task
-- Record a task's output and move the run to its next task, or finish it (fenced); a keyed run that
-- finishes frees its slot and, with wake_key and runs of its key waiting, wakes the pollers (its key's next
-- run is claimable at once). A notification serialises the commits of every notifying transaction, so a
-- poller that claims the key's next run itself (claim_key_head) passes wake_key false. Whether runs of the key
-- wait is a scalar subquery, not EXISTS (here and in complete_tasks, complete_tasks_claiming and park_run): for an
-- EXISTS outside WHERE, PostgreSQL 13 plans a read of every run beside the index lookup and picks one of the two
-- as the statement starts, by its row estimates; 14 and later pick at planning, and pick the index.
WITH run AS (
    UPDATE workflow_runs
    SET current_seq = %(next_seq)s,
        status = CASE WHEN %(finishes)s THEN 'succeeded' ELSE status END,
        finished_at = CASE WHEN %(finishes)s THEN now() END,
        claim_id = CASE WHEN %(finishes)s THEN NULL ELSE claim_id END,
        heartbeat_at = CASE WHEN %(finishes)s THEN NULL ELSE now() END,
        released_claim = CASE WHEN %(finishes)s THEN claim_id END,
        key_slot = CASE WHEN %(finishes)s THEN NULL ELSE key_slot END
    WHERE id = %(id)s AND claim_id = %(claim_id)s
    RETURNING id, CASE WHEN %(finishes)s AND %(wake_key)s AND concurrency_key IS NOT NULL
                            AND (SELECT true FROM workflow_runs w
                                   WHERE w.workflow = workflow_runs.workflow
                                     AND w.concurrency_key = workflow_runs.concurrency_key
                                     AND w.finished_at IS NULL AND w.key_slot IS NULL LIMIT 1)
                       THEN pg_notify(%(channel)s, workflow) END AS woke
)
UPDATE workflow_tasks t
SET output = %(output)s::jsonb, finished_at = now()
FROM run
WHERE t.run_id = run.id AND t.seq = %(seq)s
RETURNING t.seq, run.woke;


-- name: complete_tasks
-- complete_task for several runs in one statement and one commit (group commit), each step fenced by its own
-- claim as complete_task's is: the (run, claim) pairs that matched come back, and no other (two steps of one
-- run, a live claim's and a stale one's, can share a batch). The caller passes the steps in id order, and the
-- plan is a nested loop from the steps, so the rows are locked in that order; a deadlock that happens anyway
-- fails the statement, and the caller then writes the steps one by one. Before it locks or writes any row the
-- statement takes the advisory lock `fence` (a random key of the caller's) for its transaction: a caller that
-- lost the connection while the server may still run the statement waits it out (outlast) before it writes or
-- looks again. One that had not got that far (still on its way, or waiting for a table lock) is not waited
-- for: a write made again before it commits then recognises it afterwards (a start its own id, a last step its
-- own release).
-- The steps' arrays are read through `given`, one materialized row (which also takes the fence), so that no
-- estimate depends on their values (the channel does not shape the plan): PostgreSQL then keeps one generic
-- plan per connection instead of planning every execution anew, as it did while the arrays were constants to
-- it (on tables with statistics: 0.5 ms of planning against 0.3 ms of execution for the fast path's batches,
-- 1.1 ms against 1.7 ms for a worker's 16 finishes and claims, measured with pg_stat_statements). `step`'s
-- LIMIT is the number of steps (it never cuts): PostgreSQL estimates a LIMIT it cannot read at a tenth of its
-- input, one step here, so each run is found by its primary key whatever the table's statistics say. The
-- join alone, on a young table whose statistics are missing or far behind its size, was planned as a read of
-- every run (~0.9 ms a statement on 3,000 runs).
WITH given AS MATERIALIZED (
    SELECT pg_advisory_xact_lock(%(fence)s) AS held, %(ids)s::uuid[] AS ids, %(claims)s::uuid[] AS claims,
           %(seqs)s::smallint[] AS seqs, %(outputs)s::text[] AS outputs,
           %(next_seqs)s::smallint[] AS next_seqs, %(finishes)s::boolean[] AS finishes,
           %(wake_keys)s::boolean[] AS wake_keys
), step AS (
    SELECT s.* FROM given,
         unnest(given.ids, given.claims, given.seqs, given.outputs, given.next_seqs, given.finishes,
                given.wake_keys) AS s (id, claim_id, seq, output, next_seq, finishes, wake_key)
    WHERE given.held IS NOT NULL
    LIMIT (SELECT cardinality(ids) FROM given)
), run AS (
    UPDATE workflow_runs r
    SET current_seq = s.next_seq,
        status = CASE WHEN s.finishes THEN 'succeeded' ELSE r.status END,
        finished_at = CASE WHEN s.finishes THEN now() END,
        claim_id = CASE WHEN s.finishes THEN NULL ELSE r.claim_id END,
        heartbeat_at = CASE WHEN s.finishes THEN NULL ELSE now() END,
        released_claim = CASE WHEN s.finishes THEN r.claim_id END,
        key_slot = CASE WHEN s.finishes THEN NULL ELSE r.key_slot END
    FROM step s
    WHERE r.id = s.id AND r.claim_id = s.claim_id
    RETURNING r.id, s.claim_id, s.seq, s.output,
              CASE WHEN s.finishes AND s.wake_key AND r.concurrency_key IS NOT NULL
                        AND (SELECT true FROM workflow_runs w
                                    WHERE w.workflow = r.workflow
                                      AND w.concurrency_key = r.concurrency_key
                                      AND w.finished_at IS NULL AND w.key_slot IS NULL LIMIT 1)
                   THEN pg_notify(%(channel)s, r.workflow) END AS woke
)
UPDATE workflow_tasks t
SET output = run.output::jsonb, finished_at = now()
FROM run
WHERE t.run_id = run.id AND t.seq = run.seq
RETURNING t.run_id, run.claim_id, run.woke;


-- name: complete_tasks_claiming
-- complete_tasks, and in the same statement and commit a claim of up to `limit` claimable runs of
-- `workflows`, as claim_runs makes it, under the caller's claim ids `new_claims`: for a worker's completer,
-- whose finished runs leave places for as many runs to take (a statement apart from complete_tasks, whose steps
-- alone would otherwise pay for the claim's nodes, ~0.1 ms a statement). Rows: the claimed runs first, as
-- claim_runs returns them, behind a false `step` column; then, behind a true one, each step that matched:
-- its run in the id column, its claim in the claim column (and in the workflow column its wake-up, which
-- the statement must read to make). A run that finishes here is not claimable (finished), nor is a run
-- still claimed, so no run is both stepped and claimed. A caller whose statement failed, perhaps after its
-- commit, waits it out (outlast: the statement takes `fence` before it claims, as complete_tasks does),
-- writes the steps one by one and lets go of what it may have claimed (release_claims). The steps are
-- complete_tasks' text and the claim claim_runs' but for the fence (tests keep them alike). The claim's
-- branch comes first in the UNION ALL, and PostgreSQL runs the branches in order: the claimed runs' rows
-- come out run by run, as claimed_runs needs them, and the claim is taken on a fresh snapshot before the
-- steps wait for their row locks. Keep that order.
WITH given AS MATERIALIZED (
    SELECT pg_advisory_xact_lock(%(fence)s) AS held, %(ids)s::uuid[] AS ids, %(claims)s::uuid[] AS claims,
           %(seqs)s::smallint[] AS seqs, %(outputs)s::text[] AS outputs,
           %(next_seqs)s::smallint[] AS next_seqs, %(finishes)s::boolean[] AS finishes,
           %(wake_keys)s::boolean[] AS wake_keys,
           %(workflows)s::text[] AS workflows, %(floors)s::timestamptz[] AS floors, %(limit)s::int AS lim,
           %(new_claims)s::uuid[] AS new_claims
), step AS (
    SELECT s.* FROM given,
         unnest(given.ids, given.claims, given.seqs, given.outputs, given.next_seqs, given.finishes,
                given.wake_keys) AS s (id, claim_id, seq, output, next_seq, finishes, wake_key)
    WHERE given.held IS NOT NULL
    LIMIT (SELECT cardinality(ids) FROM given)
), run AS (
    UPDATE workflow_runs r
    SET current_seq = s.next_seq,
        status = CASE WHEN s.finishes THEN 'succeeded' ELSE r.status END,
        finished_at = CASE WHEN s.finishes THEN now() END,
        claim_id = CASE WHEN s.finishes THEN NULL ELSE r.claim_id END,
        heartbeat_at = CASE WHEN s.finishes THEN NULL ELSE now() END,
        released_claim = CASE WHEN s.finishes THEN r.claim_id END,
        key_slot = CASE WHEN s.finishes THEN NULL ELSE r.key_slot END
    FROM step s
    WHERE r.id = s.id AND r.claim_id = s.claim_id
    RETURNING r.id, s.claim_id, s.seq, s.output,
              CASE WHEN s.finishes AND s.wake_key AND r.concurrency_key IS NOT NULL
                        AND (SELECT true FROM workflow_runs w
                                    WHERE w.workflow = r.workflow
                                      AND w.concurrency_key = r.concurrency_key
                                      AND w.finished_at IS NULL AND w.key_slot IS NULL LIMIT 1)
                   THEN pg_notify(%(channel)s, r.workflow) END AS woke
), done AS (
    UPDATE workflow_tasks t
    SET output = run.output::jsonb, finished_at = now()
    FROM run
    WHERE t.run_id = run.id AND t.seq = run.seq
    RETURNING t.run_id, run.claim_id, run.woke
), pick AS (
    SELECT c.id, c.created_at, c.next_retry_at
    FROM unnest((SELECT workflows FROM given), (SELECT floors FROM given)) AS w (name, floor),
         LATERAL (SELECT id, created_at, next_retry_at FROM workflow_runs
                  WHERE workflow = w.name AND num_nonnulls(claim_id, finished_at) = 0
                    AND (concurrency_key IS NULL OR key_slot IS NOT NULL) AND next_retry_at <= now()
                    AND next_retry_at >= coalesce(w.floor, '-infinity')
                    AND (SELECT held FROM given) IS NOT NULL
                  ORDER BY next_retry_at, created_at, id
                  LIMIT (SELECT lim FROM given)
                  FOR UPDATE SKIP LOCKED) AS c
    ORDER BY c.next_retry_at, c.created_at, c.id
    LIMIT (SELECT lim FROM given)
), numbered AS (
    SELECT p.id, p.n
    FROM unnest(ARRAY(SELECT id FROM pick ORDER BY next_retry_at, created_at, id))
         WITH ORDINALITY AS p (id, n)
    LIMIT (SELECT lim FROM given)
), claimed AS (
    UPDATE workflow_runs r
    SET claim_id = (SELECT new_claims FROM given)[numbered.n], heartbeat_at = now(),
        status = 'running', released_claim = NULL
    FROM numbered WHERE r.id = numbered.id
    RETURNING r.id, r.workflow, r.claim_id, r.input, r.input_sealed, r.context,
              r.context_sealed, r.current_seq, r.created_at, r.sealed_for,
              r.next_retry_at, r.traceparent, r.tracestate, r.concurrency_key
)
(SELECT false, c.id, c.workflow, c.claim_id, c.input, c.input_sealed, c.context::text, c.context_sealed,
        c.current_seq, now(), c.sealed_for,
        extract(epoch FROM now() - greatest(c.created_at, c.next_retry_at))::float8,
        c.traceparent, c.tracestate, c.concurrency_key, c.next_retry_at, t.seq, t.name, t.skipped, t.attempts,
        t.output IS NOT NULL, t.output, t.failed_at
 FROM claimed c JOIN workflow_tasks t ON t.run_id = c.id
 ORDER BY c.created_at, c.id, t.seq)
UNION ALL
SELECT true, d.run_id, d.woke::text, d.claim_id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
FROM done d;


-- name: outlast
-- Wait until no transaction holds the advisory lock `fence`: one a combined write took (complete_tasks,
-- complete_tasks_claiming, insert_runs) and whose connection was lost has ended, committed or not, so that
-- looking for what it did finds all of it; at most `patience` (lock_timeout, this transaction only, set
-- before the wait), then LockNotAvailable. Safe to repeat.
SELECT set_config('lock_timeout', %(patience)s, true), pg_advisory_xact_lock(%(fence)s);


-- name: end_fenced
-- Terminate the backend that holds the advisory lock `fence` (a bigint key: its high and low 32 bits in
-- classid and objid, objsubid 1): a combined write whose client is gone and which outlast waited for too
-- long. Its transaction rolls back.
SELECT pg_terminate_backend(pid) FROM pg_locks
WHERE locktype = 'advisory' AND granted AND objsubid = 1
  AND classid = (%(fence)s::bigint >> 32)::oid AND objid = (%(fence)s::bigint & 4294967295)::oid
  AND pid <> pg_backend_pid();


-- name: release_claims
-- Let go of the runs these claims hold, unattempted and claimable at once, and wake the pollers: what a
-- combined step write that failed, perhaps after its commit, may have claimed, or a run claimed for a thread
-- that an interrupt ended (safe to repeat).
WITH run AS (
    UPDATE workflow_runs
    SET claim_id = NULL, heartbeat_at = NULL, released_claim = claim_id
    WHERE claim_id = ANY(%(claims)s::uuid[])
    RETURNING workflow
)
SELECT pg_notify(%(channel)s, workflow) FROM (SELECT DISTINCT workflow FROM run) AS woken;

-- name: fail_task
-- Record a failed attempt, and its history row: retry after `delay` seconds, under the claim or released for a poller (fenced).
-- The attempt count is absolute (the executor knows it under its claim), so a retry cannot count twice; the history row
-- (its id `event_id`, made by the caller) is written only when the count moves (`before` is read before the update), so
-- a retry writes none either.
WITH before AS (
    SELECT attempts FROM workflow_tasks WHERE run_id = %(id)s AND seq = %(seq)s
), run AS (
    UPDATE workflow_runs
    SET claim_id = CASE WHEN %(keep_claim)s THEN claim_id END,
        heartbeat_at = CASE WHEN %(keep_claim)s THEN now() END,
        released_claim = CASE WHEN %(keep_claim)s THEN NULL ELSE claim_id END,
        next_retry_at = now() + make_interval(secs => %(delay)s)
    WHERE id = %(id)s AND claim_id = %(claim_id)s
    RETURNING id
), task AS (
    UPDATE workflow_tasks t
    SET attempts = %(attempts)s, error = %(error)s, error_code = %(code)s, failed_at = now()
    FROM run
    WHERE t.run_id = run.id AND t.seq = %(seq)s
    RETURNING t.run_id
), history AS (
    INSERT INTO workflow_events (id, run_id, kind, seq, attempt, error, error_code)
    SELECT %(event_id)s, task.run_id, 'failed', %(seq)s, %(attempts)s, %(error)s, %(code)s
    FROM task, before
    WHERE before.attempts < %(attempts)s
)
SELECT run_id FROM task;


-- name: park_run
-- Park the run on its task `seq`, stopped for a person with the last error, its claim let go, and its history row (its id
-- `event_id`, made by the caller) (fenced);
-- a keyed run frees its slot and wakes the pollers as complete_task does.
WITH run AS (
    UPDATE workflow_runs
    SET status = 'parked', finished_at = now(), claim_id = NULL, heartbeat_at = NULL,
        released_claim = claim_id, key_slot = NULL
    WHERE id = %(id)s AND claim_id = %(claim_id)s
    RETURNING id, CASE WHEN %(wake_key)s AND concurrency_key IS NOT NULL
                            AND (SELECT true FROM workflow_runs w
                                   WHERE w.workflow = workflow_runs.workflow
                                     AND w.concurrency_key = workflow_runs.concurrency_key
                                     AND w.finished_at IS NULL AND w.key_slot IS NULL LIMIT 1)
                       THEN pg_notify(%(channel)s, workflow) END AS woke
), task AS (
    UPDATE workflow_tasks t
    SET attempts = %(attempts)s,
        error = %(error)s,
        error_code = %(code)s,
        failed_at = CASE WHEN %(spent)s THEN now() ELSE t.failed_at END
    FROM run
    WHERE t.run_id = run.id AND t.seq = %(seq)s
    RETURNING t.run_id
), history AS (
    INSERT INTO workflow_events (id, run_id, kind, seq, attempt, error, error_code)
    SELECT %(event_id)s, run_id, 'parked', %(seq)s, %(attempts)s, %(error)s, %(code)s FROM task
)
SELECT task.run_id, run.woke FROM task, run;


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
-- Keep the given claims alive; returns the claims still held (a missing one was lost). A run whose row
-- another transaction is writing is skipped, not waited for: that is mostly a step of its own executor,
-- which moves the heartbeat itself, and waiting could deadlock with a group commit (complete_tasks)
-- holding the rows of several runs.
WITH held AS (
    SELECT id, claim_id FROM workflow_runs WHERE claim_id = ANY(%(claims)s::uuid[])
), beat AS (
    SELECT id FROM workflow_runs WHERE claim_id = ANY(%(claims)s::uuid[])
    FOR NO KEY UPDATE SKIP LOCKED
), moved AS (
    UPDATE workflow_runs r SET heartbeat_at = now() FROM beat WHERE r.id = beat.id
)
SELECT claim_id FROM held;


-- name: sweep
-- Release claims whose heartbeat is older than max_age and count the abandoned attempt; per run
-- released, its workflow and the task, seq and attempt count of the attempt it counted.
-- Each event's id is made here, in the layout of workflow/ids.py, as one sweep may release any
-- number of claims: a random UUID whose first 48 bits become the Unix millisecond and whose version
-- becomes 7 (set_bit counts from each byte's lowest bit: 52 and 53 are byte 6's 0x10 and 0x20;
-- gen_random_uuid's 0x40 is set already).
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
    RETURNING t.run_id, t.seq, t.name, t.attempts, t.error
), history AS (
    INSERT INTO workflow_events (id, run_id, kind, seq, attempt, error)
    SELECT encode(set_bit(set_bit(overlay(uuid_send(gen_random_uuid()) PLACING
               substring(int8send(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
               FROM 1 FOR 6), 52, 1), 53, 1), 'hex')::uuid,
           run_id, 'swept', seq, attempts, error
    FROM bump
)
SELECT run.id, run.workflow, bump.name, bump.seq, bump.attempts, pg_notify(%(channel)s, run.workflow)
FROM run LEFT JOIN bump ON bump.run_id = run.id;


-- name: run_status
-- A run's status, times, the task it is on (for Failure), and whether it is claimable now.
SELECT r.workflow, r.status, r.created_at, r.finished_at, t.name, t.error, t.error_code, t.attempts,
       r.claim_id IS NULL AND r.finished_at IS NULL AND r.next_retry_at <= now()
       AND (r.concurrency_key IS NULL OR r.key_slot IS NOT NULL)
FROM workflow_runs r
LEFT JOIN workflow_tasks t ON t.run_id = r.id AND t.seq = r.current_seq
WHERE r.id = %(id)s;


-- name: run_input
-- A run's workflow name and stored input, and the run its sealed documents were sealed for.
SELECT workflow, input, input_sealed, sealed_for FROM workflow_runs WHERE id = %(id)s;


-- name: current_database
-- The database this session is connected to, as the server names it.
SELECT current_database();


-- name: listen_cancels
-- Subscribe this session to cancellations (the listener's own connection); store.CANCELS; payload a run id.
LISTEN workflow_cancels;


-- name: listen
-- Subscribe this session to the wake-up channel (the listener's own connection); store.CHANNEL.
LISTEN workflow_runs;


-- name: check_claims
-- Which of these claims are still held, and for a lost one whether its run was cancelled (the heartbeat, every second).
SELECT c.claim_id, r.claim_id IS NOT DISTINCT FROM c.claim_id, r.status = 'cancelled'
FROM unnest(%(runs)s::uuid[], %(claims)s::uuid[]) AS c (run_id, claim_id)
LEFT JOIN workflow_runs r ON r.id = c.run_id;


-- Operating runs (workflow.Admin). ---------------------------------------------------------


-- name: cancel_runs
-- Cancel each run of ids that is neither succeeded nor cancelled: finished now, its claim dropped (its executor's next write matches nothing), a keyed run's slot freed (and the pollers woken), a history row under the event id paired with it, a notice to the executing process; the ids it cancelled.
WITH wanted AS (
    SELECT * FROM unnest(%(ids)s::uuid[], %(event_ids)s::uuid[]) AS w(id, event_id)
), run AS (
    UPDATE workflow_runs r
    SET status = 'cancelled', finished_at = now(), claim_id = NULL, heartbeat_at = NULL,
        released_claim = NULL, key_slot = NULL
    FROM wanted
    WHERE r.id = wanted.id AND r.status NOT IN ('succeeded', 'cancelled')
    RETURNING r.id, wanted.event_id, r.current_seq, r.task_count, r.workflow,
              r.concurrency_key IS NOT NULL AS keyed
), history AS (
    INSERT INTO workflow_events (id, run_id, kind, seq, actor, reason)
    SELECT event_id, id, 'cancelled', CASE WHEN current_seq <= task_count THEN current_seq END,
           %(actor)s, %(reason)s
    FROM run
)
SELECT id, pg_notify(%(cancels)s, id::text), CASE WHEN keyed THEN pg_notify(%(channel)s, workflow) END
FROM run;


-- name: resume_runs
-- Make each run of ids that is parked, or cancelled with tasks left, claimable now on the task it stopped on, with a fresh attempt budget; a history row under the event id paired with it; a wake-up; the ids it resumed.
WITH wanted AS (
    SELECT * FROM unnest(%(ids)s::uuid[], %(event_ids)s::uuid[]) AS w(id, event_id)
), run AS (
    UPDATE workflow_runs r
    SET status = 'running', finished_at = NULL, next_retry_at = now(), released_claim = NULL
    FROM wanted
    WHERE r.id = wanted.id AND r.claim_id IS NULL
      AND (r.status = 'parked' OR (r.status = 'cancelled' AND r.current_seq <= r.task_count))
    RETURNING r.id, wanted.event_id, r.workflow, r.current_seq
), task AS (
    UPDATE workflow_tasks t SET attempts = 0
    FROM run WHERE t.run_id = run.id AND t.seq = run.current_seq
    RETURNING t.run_id
), history AS (
    INSERT INTO workflow_events (id, run_id, kind, seq, actor, reason)
    SELECT event_id, id, 'resumed', current_seq, %(actor)s, %(reason)s FROM run
)
SELECT run.id, pg_notify(%(channel)s, run.workflow) FROM run;


-- name: fork_run
-- Start a new run of the same workflow and stored input with the outputs of the tasks before `from_seq`, recording forked_from, and the original's history row; a wake-up.
WITH src AS (
    SELECT id, workflow, input, input_sealed, context, context_sealed, task_count, sealed_for,
           concurrency_key
    FROM workflow_runs WHERE id = %(id)s
), new AS (
    INSERT INTO workflow_runs (id, workflow, status, input, input_sealed, context, context_sealed,
                               task_count, current_seq, forked_from, sealed_for, concurrency_key)
    SELECT %(new_id)s, workflow, 'pending', input, input_sealed, context, context_sealed,
           task_count, %(current_seq)s, id,
           CASE WHEN input_sealed IS NULL AND context_sealed IS NULL THEN NULL
                ELSE coalesce(sealed_for, id) END,
           concurrency_key
    FROM src
    RETURNING id, workflow
), tasks AS (
    INSERT INTO workflow_tasks (run_id, seq, name, skipped, output, finished_at)
    SELECT %(new_id)s, t.seq, t.name, t.skipped,
           CASE WHEN t.seq < %(from_seq)s THEN t.output END,
           CASE WHEN t.seq < %(from_seq)s OR (t.skipped AND t.seq < %(current_seq)s)
                THEN coalesce(t.finished_at, now()) END
    FROM workflow_tasks t, new
    WHERE t.run_id = %(id)s
), history AS (
    INSERT INTO workflow_events (id, run_id, kind, seq, actor, reason, other_run)
    SELECT (%(event_ids)s::uuid[])[1], src.id, 'forked', %(from_seq)s, %(actor)s, %(reason)s, new.id
    FROM src, new
)
SELECT new.id, pg_notify(%(channel)s, new.workflow) FROM new;


-- name: admin_events
-- The runs an operator's action recorded under these event ids: what a retried action whose reply was lost finds.
SELECT run_id FROM workflow_events WHERE id = ANY(%(event_ids)s::uuid[]);


-- name: list_runs
-- Runs newest first, filtered (the task a run is on, and its last failure's code, when match_code), from after the (created_at, id) of the previous page; with the task each is on and its failure.
SELECT r.id, r.workflow, r.status, r.created_at, r.finished_at, r.idempotency_key,
       CASE WHEN r.current_seq <= r.task_count THEN t.name END,
       t.error, t.error_code, t.attempts
FROM workflow_runs r
LEFT JOIN workflow_tasks t ON t.run_id = r.id AND t.seq = r.current_seq
WHERE (%(statuses)s::text[] IS NULL OR r.status = ANY(%(statuses)s::text[]))
  AND (%(workflow)s::text IS NULL OR r.workflow = %(workflow)s)
  AND (%(since)s::timestamptz IS NULL OR r.created_at >= %(since)s)
  AND (%(until)s::timestamptz IS NULL OR r.created_at < %(until)s)
  AND (%(after_at)s::timestamptz IS NULL OR (r.created_at, r.id) < (%(after_at)s, %(after_id)s::uuid))
  AND (%(task)s::text IS NULL AND NOT %(match_code)s OR EXISTS (
      SELECT FROM workflow_tasks f
      WHERE f.run_id = r.id AND f.seq = r.current_seq AND r.current_seq <= r.task_count
        AND (%(task)s::text IS NULL OR f.name = %(task)s)
        AND (NOT %(match_code)s OR f.error_code IS NOT DISTINCT FROM %(code)s::text)))
ORDER BY r.created_at DESC, r.id DESC
LIMIT %(limit)s;


-- name: run_detail
-- One run with its stored input, where it came from, its key's digest and slot, and every task of its snapshot.
SELECT r.id, r.workflow, r.status, r.created_at, r.finished_at, r.idempotency_key, r.current_seq,
       r.task_count, r.input, r.input_sealed IS NOT NULL, r.forked_from, r.claim_id IS NOT NULL,
       r.next_retry_at, r.concurrency_key, r.key_slot, t.seq, t.name, t.skipped, t.attempts, t.error, t.error_code, t.finished_at
FROM workflow_runs r JOIN workflow_tasks t ON t.run_id = r.id
WHERE r.id = %(id)s
ORDER BY t.seq;


-- name: run_history
-- A run's history, oldest first.
SELECT at, kind, seq, attempt, error, error_code, actor, reason, other_run
FROM workflow_events WHERE run_id = %(id)s ORDER BY at, id;


-- name: prune_runs
-- Delete up to `limit` runs of `status` finished more than `older_than` seconds ago, oldest first, with their tasks (a trigger) and history (cascade); skips rows others hold.
WITH doomed AS (
    SELECT id FROM workflow_runs
    WHERE status = %(status)s AND finished_at IS NOT NULL
      AND finished_at < now() - make_interval(secs => %(older_than)s)
    ORDER BY finished_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
DELETE FROM workflow_runs WHERE id = ANY(ARRAY(SELECT id FROM doomed)) RETURNING id;


-- name: count_prunable
-- How many runs of `status` finished more than `older_than` seconds ago (a prune's dry run).
SELECT count(*) FROM workflow_runs
WHERE status = %(status)s AND finished_at IS NOT NULL
  AND finished_at < now() - make_interval(secs => %(older_than)s);


-- name: queue_stats
-- Per workflow: runs pending and running, claimable now (not a keyed run waiting for a slot), the oldest claimable's age (s), stale claims, parked, and finished in the last day.
-- The open, unclaimed runs are read in two disjoint parts: those that may be claimed, through the claims'
-- index (spelt as its predicate is), and the keyed runs waiting for a slot, through an index of theirs
-- ("unclaimed" spelt so that the predicate of workflow_runs_claimable, 0010's reader, did not follow).
WITH open AS (
    SELECT workflow, status, claim_id, heartbeat_at, created_at, next_retry_at, true AS ready
    FROM workflow_runs WHERE num_nonnulls(claim_id, finished_at) = 0
                         AND (concurrency_key IS NULL OR key_slot IS NOT NULL)
    UNION ALL
    SELECT workflow, status, claim_id, heartbeat_at, created_at, next_retry_at, false
    FROM workflow_runs WHERE finished_at IS NULL AND concurrency_key IS NOT NULL AND key_slot IS NULL
                         AND num_nonnulls(claim_id) = 0
    UNION ALL
    SELECT workflow, status, claim_id, heartbeat_at, created_at, next_retry_at, false
    FROM workflow_runs WHERE claim_id IS NOT NULL
), finished AS (
    SELECT workflow, status FROM workflow_runs
    WHERE finished_at IS NOT NULL AND status = 'parked'
    UNION ALL
    SELECT workflow, status FROM workflow_runs
    WHERE finished_at IS NOT NULL AND status IN ('succeeded', 'cancelled')
      AND finished_at >= now() - interval '1 day'
), per AS (
    SELECT workflow,
           count(*) FILTER (WHERE status = 'pending') AS pending,
           count(*) FILTER (WHERE status = 'running') AS running,
           count(*) FILTER (WHERE ready AND next_retry_at <= now()) AS claimable,
           extract(epoch FROM now() - min(greatest(created_at, next_retry_at))
                   FILTER (WHERE ready AND next_retry_at <= now()))::float8 AS oldest,
           count(*) FILTER (WHERE claim_id IS NOT NULL
                            AND heartbeat_at < now() - make_interval(secs => %(stale_after)s)) AS stale,
           0 AS parked, 0 AS succeeded, 0 AS cancelled
    FROM open GROUP BY workflow
    UNION ALL
    SELECT workflow, 0, 0, 0, NULL::float8, 0,
           count(*) FILTER (WHERE status = 'parked'),
           count(*) FILTER (WHERE status = 'succeeded'),
           count(*) FILTER (WHERE status = 'cancelled')
    FROM finished GROUP BY workflow
)
SELECT workflow, sum(pending)::bigint, sum(running)::bigint, sum(claimable)::bigint, max(oldest),
       sum(stale)::bigint, sum(parked)::bigint, sum(succeeded)::bigint, sum(cancelled)::bigint
FROM per GROUP BY workflow ORDER BY workflow;


-- name: queue_gauges
-- Per workflow and status, the runs not finished and the parked ones; of those, how many are claimable
-- now (a keyed run waiting for a slot is not) and the oldest claimable's age (s); and per workflow the claims whose heartbeat is older than
-- stale_after. Each branch reads one partial index, never the history: the unclaimed runs that may be
-- claimed (the claims' index), the keyed runs waiting for a slot (an index of theirs), the claimed runs, and the
-- finished ones.
WITH open AS (
    SELECT workflow, status, next_retry_at <= now() AS claimable,
           greatest(created_at, next_retry_at) AS since, false AS stale
    FROM workflow_runs WHERE num_nonnulls(claim_id, finished_at) = 0
                         AND (concurrency_key IS NULL OR key_slot IS NOT NULL)
    UNION ALL
    SELECT workflow, status, false, NULL, false
    FROM workflow_runs WHERE finished_at IS NULL AND concurrency_key IS NOT NULL AND key_slot IS NULL
                         AND num_nonnulls(claim_id) = 0
    UNION ALL
    SELECT workflow, status, false, NULL,
           heartbeat_at < now() - make_interval(secs => %(stale_after)s)
    FROM workflow_runs WHERE claim_id IS NOT NULL
    UNION ALL
    SELECT workflow, status, false, NULL, false
    FROM workflow_runs WHERE finished_at IS NOT NULL AND status = 'parked'
)
SELECT workflow, status, count(*), count(*) FILTER (WHERE claimable),
       extract(epoch FROM now() - min(since) FILTER (WHERE claimable))::float8,
       count(*) FILTER (WHERE stale)
FROM open GROUP BY workflow, status ORDER BY workflow, status;


-- name: count_runs
-- How many runs match the filters of list_runs (a bulk action's dry run).
SELECT count(*) FROM workflow_runs r
WHERE (%(statuses)s::text[] IS NULL OR r.status = ANY(%(statuses)s::text[]))
  AND (%(workflow)s::text IS NULL OR r.workflow = %(workflow)s)
  AND (%(since)s::timestamptz IS NULL OR r.created_at >= %(since)s)
  AND (%(until)s::timestamptz IS NULL OR r.created_at < %(until)s)
  AND (%(task)s::text IS NULL AND NOT %(match_code)s OR EXISTS (
      SELECT FROM workflow_tasks f
      WHERE f.run_id = r.id AND f.seq = r.current_seq AND r.current_seq <= r.task_count
        AND (%(task)s::text IS NULL OR f.name = %(task)s)
        AND (NOT %(match_code)s OR f.error_code IS NOT DISTINCT FROM %(code)s::text)));


-- name: finished_per_minute
-- Runs finished in each minute of the last `minutes` (database clock), by status; minutes with none are absent.
-- Reads workflow_runs_finished: three range scans, never the older history.
SELECT date_trunc('minute', finished_at), status, count(*)
FROM workflow_runs
WHERE status IN ('succeeded', 'parked', 'cancelled') AND finished_at IS NOT NULL
  AND finished_at >= date_trunc('minute', now()) - make_interval(mins => %(minutes)s - 1)
GROUP BY 1, 2 ORDER BY 1;


-- name: db_now
-- The database clock.
SELECT now();

-- name: upsert_schedule
-- Record a schedule a worker registers; a changed cron or time zone takes the next_tick computed for
-- it (from now), an unchanged one keeps its own; either way it is no longer orphaned.
INSERT INTO workflow_schedules AS s (name, workflow, cron, timezone, catchup, next_tick)
VALUES (%(name)s, %(workflow)s, %(cron)s, %(timezone)s, %(catchup)s, %(next_tick)s)
ON CONFLICT (name) DO UPDATE
SET workflow = EXCLUDED.workflow, cron = EXCLUDED.cron, timezone = EXCLUDED.timezone,
    catchup = EXCLUDED.catchup, orphaned = false, updated_at = now(),
    next_tick = CASE WHEN (s.cron, s.timezone) IS DISTINCT FROM (EXCLUDED.cron, EXCLUDED.timezone)
                     THEN EXCLUDED.next_tick ELSE s.next_tick END
RETURNING name;

-- name: orphan_schedules
-- Mark orphaned the schedules of these workflows that these names no longer include (removed from the code).
UPDATE workflow_schedules SET orphaned = true, updated_at = now()
WHERE workflow = ANY(%(workflows)s::text[]) AND name <> ALL(%(names)s::text[]) AND NOT orphaned
RETURNING name;

-- name: claim_schedule
-- Lock one due (or triggered) schedule whose row holds this worker's definition (name, cron, time zone:
-- during a deploy that changes a cron, only workers of the version the row holds fire it), skipping rows
-- another worker holds and the names in skip; with the database clock.
SELECT s.name, s.next_tick, s.triggered_at, s.paused, now() FROM workflow_schedules s
JOIN unnest(%(names)s::text[], %(crons)s::text[], %(zones)s::text[]) AS mine (name, cron, timezone)
  ON mine.name = s.name AND mine.cron = s.cron AND mine.timezone = s.timezone
WHERE s.name <> ALL(%(skip)s::text[]) AND NOT s.orphaned
  AND ((NOT s.paused AND s.next_tick <= now()) OR s.triggered_at IS NOT NULL)
ORDER BY s.next_tick
LIMIT 1
FOR UPDATE OF s SKIP LOCKED;

-- name: advance_schedule
-- After firing: the next tick, the last tick and run fired (kept when NULL), a trigger cleared when handled.
UPDATE workflow_schedules
SET next_tick = %(next_tick)s, last_tick = coalesce(%(last_tick)s, last_tick),
    last_run = coalesce(%(last_run)s, last_run),
    triggered_at = CASE WHEN %(triggered)s THEN NULL ELSE triggered_at END, updated_at = now()
WHERE name = %(name)s
RETURNING name;

-- name: next_schedule_due
-- Seconds until the earliest of these schedules (by this worker's definition) is due or triggered
-- (negative: overdue; NULL: none).
SELECT extract(epoch FROM min(CASE WHEN s.triggered_at IS NOT NULL THEN now() ELSE s.next_tick END)
                          - now())::float8
FROM workflow_schedules s
JOIN unnest(%(names)s::text[], %(crons)s::text[], %(zones)s::text[]) AS mine (name, cron, timezone)
  ON mine.name = s.name AND mine.cron = s.cron AND mine.timezone = s.timezone
WHERE NOT s.orphaned AND (NOT s.paused OR s.triggered_at IS NOT NULL);

-- name: list_schedules
-- Every schedule, by name.
SELECT name, workflow, cron, timezone, catchup, next_tick, last_tick, last_run, paused, orphaned,
       triggered_at
FROM workflow_schedules ORDER BY name;

-- name: pause_schedule
-- Pause or resume one schedule; its name when it exists.
UPDATE workflow_schedules SET paused = %(paused)s, updated_at = now() WHERE name = %(name)s RETURNING name;

-- name: trigger_schedule
-- Ask for one run of a schedule now (a worker holding it starts it); its name when it exists.
UPDATE workflow_schedules SET triggered_at = coalesce(triggered_at, now()), updated_at = now()
WHERE name = %(name)s RETURNING name;
