"""The poller: claims runs left for any process, longest due first, and executes them.

When nothing more is claimable it sleeps for its poll interval, or until the
earliest run of its workflows falls due when that is sooner (a delayed start,
a retry waiting out its backoff); a wake-up (a notification, a local start)
cuts the sleep short.

A run's last write is not its thread's to wait for: when the last task of an
unkeyed run succeeds, its thread hands the finish to the poller's completer
(completer.py) and takes another run, and the run no longer counts against
`concurrency`. The completer writes the finishes handed to it in batches, one
statement and one commit each (a second may be on its way while one is), which
also claim a run for each place the finished runs left free; those go to this
poller's threads. Under load a
worker's run so costs one share of a transaction for its finish and for the claim
of the run taking its place, and no thread waits for either; when that claim
finds fewer runs than it had room for, this loop is woken to claim as before. With
keyed workflows registered, every other batch claims nothing and wakes this loop
instead, whose rounds give keys' waiting runs their turn.

A claim is one statement (`FOR UPDATE SKIP LOCKED`, so pollers in many processes
never claim the same run) that also returns each run's task snapshot. It claims
only runs of workflows registered here, at most `batch_size` at a time and never
more than the free share of `concurrency`. With keyed workflows registered
(SPEC 15) a round has a second statement, which gives free slots of keys to
their oldest waiting runs and claims those; the two take turns going first, so
neither kind of run waits behind a backlog of the other. When an execution of a
keyed run ends here, the thread that ran it claims its key's next run (one
index probe) and runs it in the same room.

A process out of threads goes on with the threads it has (runthreads.py): a run
claimed for a thread that could not start waits for one of them, and claims count on
no more places than those threads until another is tried. A run claimed when no
thread at all can start is released at once, and the poller claims nothing more until
a pause has passed (`NO_THREAD_PAUSE`, doubling).
"""

from __future__ import annotations

import threading
import time

from workflow.completer import Completer
from workflow.config import RunnerSettings
from workflow.executor import Executor
from workflow.runthreads import RunThreads
from workflow.service import Service
from workflow.store import ClaimedRun, slot_race

DUE_REREAD = 1.0
"""The shortest time between two reads of the next due time caused by executions ending
here (a wake-up from outside always reads it)."""
OVERDUE_RETRY = 0.25
"""Seconds before looking again at a due run the last claim skipped (it was locked)."""
NO_THREAD_PAUSE = 0.5
"""Seconds the poller waits before claiming again after a claim whose runs no thread could
take (the process could not start even one), at most the poll interval: doubled after
each such claim, up to the poll interval."""
KEY_WALK_SHARE = 0.1
"""The most of a poller's time its claims of keys' waiting runs may take: each reads
up to a window of keys with runs waiting, so after one that took t seconds (and
filled less than its batch) the next waits t / KEY_WALK_SHARE, doubled after each
one that found nothing (up to the poll interval; a wake-up from outside resets it).
A key's next run does not wait for it: the worker that frees the key claims it
(`claim_key_head`)."""


class Poller(Service):
    """Claims and executes runs until stopped; `wake()` polls at once."""

    name = "workflow-poller"

    def __init__(self, executor: Executor, settings: RunnerSettings) -> None:
        super().__init__()
        self._executor = executor
        self._settings = settings
        self._workflows = executor.registry.names()
        registry = executor.registry
        keyed = [
            (name, definition.limit)
            for name in self._workflows
            if (definition := registry.definition(name)) is not None
            and definition.concurrency_key is not None
        ]
        self._keyed = [name for name, _ in keyed]
        self._limits = [limit for _, limit in keyed]
        self._keys_first = False
        self._walk_after = -float("inf")  # monotonic: no claim of keys' heads before
        self._walk_pause = 0.0  # the pause after the last one (it grows while they find none)
        self._threads = RunThreads(settings.concurrency, "workflow-worker", executor.log)
        # This poller's runs claimed and not yet handed to the completer (executing, or
        # waiting for a thread), and the places reserved for claims being made, against
        # `concurrency`.
        self._running = 0
        self._lock = threading.Lock()
        self._handed = threading.local()  # `flag`: this thread's run went to the completer
        self._batch_turn = False  # with keyed workflows: whether the loop claims this time
        self.completer = Completer(
            executor.store, executor.log, self._workflows, settings.concurrency,
            # A finish it could not write leaves its run for a retry: `wake` reads the
            # due time again (a handed-over run's thread does not mark it as it comes
            # back: only the completer knows how its finish went).
            self._handed_over, self._reserve_for_batch, self._deliver, self.wake,
        )
        """Writes the finishes of this poller's runs; `Runnable.stop` stops it after the
        drain."""
        # The earliest due time known (monotonic; None: no run waits), and whether it
        # must be read again: after a wake-up from outside (a start, a notification,
        # a sweep), or once it has come. An execution ending here wakes the loop
        # without that: it frees room, it makes no run due sooner.
        self._due_at: float | None = None
        self._due_stale = True
        # An execution that ended here may have released its run for a later retry:
        # that makes the due time stale too, but is read again at most every
        # `DUE_REREAD` seconds (a busy worker ends many executions a second).
        self._due_changed_here = False
        self._due_read_at = -float("inf")
        # After a run no thread could take: no claim before this (monotonic), and the
        # pause the next such run sets (both under `_lock`).
        self._no_thread_until = -float("inf")
        self._no_thread_pause = self._first_pause()

    def wake(self) -> None:
        """Poll at once, and read the next due time again (a run may have been added)."""
        self._due_stale = True
        self._walk_pause = 0.0  # a key may have freed: the keys' claim is paced afresh
        self._walk_after = -float("inf")
        super().wake()

    def start(self) -> None:
        """Start its run threads, then claiming, and the completer."""
        self._threads.start_all()
        self.completer.start()
        super().start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop claiming; in-flight executions go on (the executor's drain awaits them, and
        the completer goes on writing their finishes until its own `stop()`)."""
        super().stop(timeout)
        self._threads.shutdown(wait=False)

    def _reserve(self, wanted: int) -> int:
        """Take up to `wanted` free places of `concurrency` for a claim about to be made
        (none once stopping or draining); how many were taken."""
        if (
            self._stopping.is_set()
            or self._executor.draining.is_set()
            or self._threads.closed  # interpreter exit: no thread would take a run
            or self._pause_left() > 0
        ):
            return 0
        places = min(self._settings.concurrency, self._threads.capacity)
        with self._lock:
            taken = max(0, min(wanted, places - self._running))
            self._running += taken
        return taken

    def _handed_over(self) -> None:
        """The calling thread's run handed its finish to the completer: its place is free
        now, before the completer can take the finish (so its claim sees the place)."""
        self._free(1)
        self._handed.flag = True

    def _reserve_for_batch(self, wanted: int) -> int:
        """Places for the claim riding with one of the completer's batches. With keyed
        workflows registered, every other batch leaves its places to this loop (none
        reserved: `_deliver` wakes it), whose rounds give keys' waiting runs their turn."""
        if self._keyed:
            with self._lock:  # the completer's threads take turns too
                self._batch_turn = not self._batch_turn
                if self._batch_turn:
                    return 0
        return self._reserve(wanted)

    def _deliver(self, runs: list[ClaimedRun], reserved: int) -> None:
        """Hand over `runs`, claimed in `reserved` places; free the places left unused, and
        wake this loop to claim in them (the completer's claim found fewer runs than it
        had room for, or claimed none). `_hand_over` raises nothing of its own (a run no
        thread takes is released and its place freed)."""
        for run in runs:
            self._hand_over(run)
        unused = reserved - len(runs)
        self._free(unused)
        if unused > 0 or not reserved:
            self._wake.set()

    def _loop(self) -> None:
        executor = self._executor
        failures = 0
        while not self._stopping.is_set():
            limit = self._reserve(self._settings.batch_size)
            if limit <= 0:  # no room, or a pause for want of threads (`_reserve`)
                pause = self._pause_left()
                self._sleep(pause if pause > 0 else self._settings.poll_interval)
                continue
            claimed: list[ClaimedRun] = []
            try:
                raced = self._claim(limit, claimed)
            except Exception:
                failures += 1
                executor.log.exception("poller: claiming runs failed")
                self._free(limit - len(claimed))  # what was claimed was handed over
                self._sleep(min(self._settings.poll_interval, 0.5 * 2 ** min(failures, 6)))
                continue
            failures = 0
            self._free(limit - len(claimed))
            for run in claimed:
                self._hand_over(run)
            if len(claimed) < limit and not raced:
                nap = self._until_next_due()
                if self._keyed:  # wake up when the keys may be read again
                    nap = min(nap, max(self._walk_after - time.monotonic(), 0.005))
                self._sleep(nap)

    def _free(self, places: int) -> None:
        """Give back `places` of `concurrency`: reserved for a claim that did not fill
        them, or held by runs that no longer count."""
        if places > 0:
            with self._lock:
                self._running -= places

    def _claim(self, limit: int, claimed: list[ClaimedRun]) -> bool:
        """Claim up to `limit` runs into `claimed`: ready ones, and keyed runs given a free
        slot of their key (in turns, which goes first); whether a race for a slot made
        the keyed claim do nothing (claim again at once). When it raises, what it
        claimed before has been handed over."""
        store = self._executor.store
        if not self._keyed:
            claimed += store.claim_runs(self._workflows, limit)
            return False
        self._keys_first = keys_first = not self._keys_first
        raced = False
        for keys in (keys_first, not keys_first):
            room = limit - len(claimed)
            if room <= 0:
                break
            try:
                if keys:
                    claimed += self._claim_heads(room)
                else:
                    claimed += store.claim_runs(self._workflows, room)
            except Exception as e:
                if keys and slot_race(e):
                    raced = True  # another claim took a slot this one counted as free
                    continue
                for run in claimed:  # what the first statement claimed still runs
                    self._hand_over(run)
                raise
        return raced

    def _until_next_due(self) -> float:
        """How long to sleep when nothing more is claimable: the poll interval, or less
        when a run (delayed, or waiting out a backoff) falls due sooner. The due time
        is read only when it may have changed (see `_due_stale`)."""
        interval = self._settings.poll_interval
        known = self._due_at
        now = time.monotonic()
        if not self._due_stale and known is not None and known <= now:
            self._due_stale = True  # it came, and the claim took it (or passed it over)
        if self._due_changed_here and now - self._due_read_at >= DUE_REREAD:
            self._due_stale = True
        if self._due_stale:
            self._due_stale = self._due_changed_here = False
            self._due_read_at = now
            try:
                due = self._executor.store.next_due(self._workflows)
            except Exception:
                self._executor.log.exception("poller: reading the next due time failed")
                self._due_stale = True
                return interval
            self._due_at = None if due is None else time.monotonic() + due
        if self._due_changed_here:  # not read again yet: wake up when it may be
            interval = min(interval, max(DUE_REREAD - (now - self._due_read_at), 0.005))
        if self._due_at is None:
            return interval
        left = self._due_at - time.monotonic()
        if left <= 0:
            # Due, yet the claim just passed it over: locked by another poller's
            # claim (gone in a moment) or by a transaction still open. Look again
            # soon, not in a loop.
            self._due_stale = True
            return min(interval, OVERDUE_RETRY)
        # A little past the due time: the claim compares with the database clock.
        return min(interval, left + 0.005)

    def _hand_over(self, run: ClaimedRun) -> None:
        """Execute `run`, claimed in a place reserved for it, on one of the threads."""
        executor = self._executor
        executor.admit()
        try:
            self._threads.submit(self._execute, run)
            if self._no_thread_until != -float("inf"):  # a thread could start again
                with self._lock:
                    self._no_thread_until = -float("inf")
                    self._no_thread_pause = self._first_pause()
        except Exception as exc:  # shut down (stop() gave up joining us), or no thread
            executor.dismiss()
            if not self._threads.closed:
                self._pause_claims(run, exc)  # before the place is free for another claim
            self._free(1)
            try:
                executor.store.release_claim(run.id, run.claim_id)
            except Exception:
                executor.log.exception(
                    "poller: releasing a run no thread will execute failed: the sweeper "
                    "will release it"
                )

    def _first_pause(self) -> float:
        return min(NO_THREAD_PAUSE, self._settings.poll_interval)

    def _pause_left(self) -> float:
        """Seconds left of the pause after a run no thread could take (0: none)."""
        until = self._no_thread_until
        if until == -float("inf"):  # the usual case: no clock read on the claim path
            return 0.0
        return max(until - time.monotonic(), 0.0)

    def _pause_claims(self, run: ClaimedRun, exc: Exception) -> None:
        """No thread could take `run` (the process is out of threads): claim nothing more
        for a while, rather than claim and release it again at once (`NO_THREAD_PAUSE`,
        doubling up to the poll interval). The other runs of the same claim fall in the
        same pause: one pause, and one warning, per claim."""
        with self._lock:
            now = time.monotonic()
            if now < self._no_thread_until:
                return
            pause = self._no_thread_pause
            self._no_thread_pause = min(2 * pause, self._settings.poll_interval)
            self._no_thread_until = now + pause
        self._executor.log.for_run(run.id).warning(
            "poller: no thread could take the run (%s); it is released, and this worker "
            "claims again in %gs",
            exc, pause,
        )

    def _execute(self, run: ClaimedRun) -> None:
        self._handed.flag = False  # set by `_handed_over`, on this thread, for this run
        try:
            following: ClaimedRun | None = run
            while following is not None:
                keyed = following.concurrency_key is not None
                # A keyed run's thread claims its key's next run once the run's end has
                # committed; an unkeyed one's last write goes to the completer.
                handed = self._executor.execute(
                    following, follows_key=keyed, completer=None if keyed else self.completer
                )
                following = None if handed else self._next_of_key(following)
        finally:
            if getattr(self._handed, "flag", False):
                # Its place was freed as it was handed over (even if an interrupt came
                # after): the completer's claim fills it, or wakes this loop; a finish
                # it cannot write wakes this loop too (`wake`).
                self._handed.flag = False
            else:
                self._due_changed_here = True  # it may have left its run for a later retry
                self._free(1)
                self._wake.set()  # room to claim again

    def _claim_heads(self, room: int) -> list[ClaimedRun]:
        """`claim_key_heads`, unless the last one was too recent for its cost (see
        `KEY_WALK_SHARE`)."""
        began = time.monotonic()
        if began < self._walk_after:
            return []
        heads = self._executor.store.claim_key_heads(self._keyed, self._limits, room)
        cost = time.monotonic() - began
        if len(heads) >= room:  # more may be ready: no pause
            self._walk_pause = 0.0
        elif heads:
            self._walk_pause = cost / KEY_WALK_SHARE
        else:
            self._walk_pause = min(
                max(2 * self._walk_pause, cost / KEY_WALK_SHARE, 0.005),
                self._settings.poll_interval,
            )
        self._walk_after = began + self._walk_pause
        return heads

    def _next_of_key(self, run: ClaimedRun) -> ClaimedRun | None:
        """After a keyed run's execution here: claim its key's next run, admitted to run on
        this thread in the room the first leaves (None when the key has none waiting, or
        still holds it, or this poller is stopping). A key's backlog so drains through
        the worker that frees it, one cheap claim a run, without walking every key."""
        key = run.concurrency_key
        executor = self._executor
        if key is None:
            return None
        definition = executor.registry.definition(run.workflow)
        assert definition is not None  # claimed only for workflows registered here
        if self._stopping.is_set() or executor.draining.is_set():
            self._wake_pollers(run.workflow)  # its finish woke no one: leave the key's next
            return None
        try:
            following = executor.store.claim_key_head(run.workflow, key, definition.limit)
        except Exception as e:
            if not slot_race(e):  # a race: another claim took the key's next run
                executor.log.exception("poller: claiming the next run of a key failed")
                self._wake_pollers(run.workflow)
            return None
        if following is not None:
            executor.admit()
        return following

    def _wake_pollers(self, workflow: str) -> None:
        try:
            self._executor.store.wake(workflow)
        except Exception:
            self._executor.log.exception("poller: waking the pollers failed")
