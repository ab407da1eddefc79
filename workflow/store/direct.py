"""The hot path's statements straight through libpq: `pgconn.exec_prepared` with text
parameters, skipping psycopg's per-statement Python (query conversion, a dumper looked
up per parameter, its non-blocking send and wait, a loader per column).

Measured on a typed 3-task fast-path run (bench/README.md, "The hot statements through
libpq"): psycopg's `Cursor.execute` of a prepared statement costs about 18 µs more
client CPU than libpq's own `PQexecPrepared`, and 20-40 µs more wall time; a run makes
four such statements.

Only statements of `DIRECT` go this way, only with parameters of the kinds `_dump`
writes (anything else, a list or bytes say, goes through psycopg as before) and only
on a connection that may prepare statements (never one with `prepare_threshold=None`,
as `make_pool(prepared=False)` makes for PgBouncer), with no transaction open (the
statement is its own transaction, as psycopg's autocommit would make it), not in
pipeline mode, and with UTF-8 client encoding. A string holding NUL goes through
psycopg too, which refuses it (libpq would cut it short). Each statement is
prepared once per connection under a name of its own, its parameters' types
inferred by the server from the statement's text (every parameter of `DIRECT` is
cast or compared with a column). Columns are read by
their type: text, integers, booleans, uuids; `void` (a `pg_notify`) reads as text, as
psycopg reads it.

Errors are psycopg's own: a result carrying an SQLSTATE raises that state's class
(`psycopg.errors.error_from_result`), and a connection that broke raises
`psycopg.OperationalError` without one, which `connection_lost` takes as lost. The
call blocks in libpq with the GIL released; unlike psycopg's wait it cannot be
interrupted by Ctrl-C before the reply comes. The steps wait on no lock a person
holds; a start with an idempotency key may wait for a transaction holding the same
key, at most `KEY_WAIT` seconds (its statement sets `lock_timeout`).
"""

from __future__ import annotations

import re
import uuid
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import psycopg
from psycopg import pq
from psycopg.errors import error_from_result

__all__ = ["DIRECT", "Direct"]

DIRECT = ("insert_run", "insert_idempotent_run", "complete_task", "insert_runs", "complete_tasks")
"""The statements made through libpq: the fast path's start (with and without an idempotency
key) and steps, alone and combined."""

Rows = list[tuple[Any, ...]]
Reader = Callable[[bytes | None], Any]

_PARAMETER = re.compile(r"%\((\w+)\)s")
_SQLSTATE = pq.DiagnosticField.SQLSTATE
_NO_SUCH_STATEMENT = b"26000"
_ALREADY_PREPARED = b"42P05"  # by a store that had not told this process's registry
# The client encodings psycopg reads as UTF-8: none reported yet counts as UTF8, and the
# server keeps the spelling UNICODE when a client asked for it by that name.
_UTF8 = frozenset((None, b"UTF8", b"UNICODE"))

# Per connection, the statement names prepared on it, whichever store's `Direct` did it
# (a Manager's store and an Admin's may share a pool), each with how its columns read
# (None until its first result; a prepared statement's column types never change, the
# server refuses to run it instead); gone with the connection.
_PREPARED: weakref.WeakKeyDictionary[
    psycopg.Connection[Any], dict[bytes, tuple[Reader, ...] | None]
] = weakref.WeakKeyDictionary()

# Column types by OID: how their text reads.
_BOOL, _INT8, _INT2, _INT4, _TEXT, _VARCHAR, _NAME, _UUID, _VOID = (
    16, 20, 21, 23, 25, 1043, 19, 2950, 2278
)
_INTEGERS = frozenset((_INT8, _INT2, _INT4))
_TEXTS = frozenset((_TEXT, _VARCHAR, _NAME, _VOID))


class _Statement:
    """One statement in libpq's form: its text with `$n` for each named parameter, the
    names in that order, and the name it is prepared under."""

    __slots__ = ("name", "order", "text")

    def __init__(self, name: str, sql: str) -> None:
        order: list[str] = []

        def number(match: re.Match[str]) -> str:
            if match.group(1) not in order:
                order.append(match.group(1))
            return f"${order.index(match.group(1)) + 1}"

        text = _PARAMETER.sub(number, sql)
        if "%" in text.replace("%%", ""):
            raise ValueError(f"statement {name!r} has a parameter libpq cannot take")
        self.text = text.replace("%%", "%").encode()
        self.order = tuple(order)
        self.name = f"workflow_direct_{name}".encode()


def _dump(value: Any) -> bytes | None:
    """`value` as PostgreSQL reads it in text form; TypeError for a kind not written here."""
    if value is None:
        return None
    kind = type(value)
    if kind is str:
        if "\x00" in value:  # libpq would cut the text there; psycopg refuses it
            raise TypeError("not written directly: a string holding NUL")
        return value.encode()  # type: ignore[no-any-return]
    if kind is bool:
        return b"t" if value else b"f"
    if kind is int:
        return str(value).encode()
    if kind is uuid.UUID:
        return value.hex.encode()  # type: ignore[no-any-return]
    raise TypeError(f"not written directly: {kind.__name__}")


class Direct:
    """The statements of `DIRECT` in libpq's form."""

    def __init__(self, queries: Mapping[str, str]) -> None:
        self._by_sql = {
            queries[name]: _Statement(name, queries[name]) for name in DIRECT if name in queries
        }

    def statement(self, sql: str) -> _Statement | None:
        """The direct form of `sql`, or None when it is not one of `DIRECT`."""
        return self._by_sql.get(sql)

    def suits(self, conn: psycopg.Connection[Any]) -> bool:
        """Whether `conn` may take direct statements (see the module's docstring)."""
        pgconn = conn.pgconn
        return (
            conn.prepare_threshold is not None
            and pgconn.transaction_status == pq.TransactionStatus.IDLE
            and pgconn.pipeline_status == pq.PipelineStatus.OFF
            and pgconn.parameter_status(b"client_encoding") in _UTF8
        )

    def execute(
        self, conn: psycopg.Connection[Any], statement: _Statement, params: dict[str, Any]
    ) -> Rows | None:
        """Run `statement` on `conn` (which `suits`); its rows, or None when a parameter is
        of a kind not written here (nothing was sent: run it through psycopg)."""
        try:
            values = [_dump(params[name]) for name in statement.order]
        except TypeError:
            return None
        pgconn = conn.pgconn
        prepared = _PREPARED.get(conn)
        if prepared is None:
            prepared = _PREPARED[conn] = {}
        for _ in range(2):
            if statement.name not in prepared:
                result = pgconn.prepare(statement.name, statement.text)
                if result.error_field(_SQLSTATE) != _ALREADY_PREPARED:
                    _check(pgconn, result, pq.ExecStatus.COMMAND_OK)
                prepared[statement.name] = None
            # libpq takes None for NULL; the stub says only buffers.
            result = pgconn.exec_prepared(statement.name, values)  # type: ignore[arg-type]
            if result.error_field(_SQLSTATE) != _NO_SUCH_STATEMENT:
                break
            # Gone from the session (a DISCARD ALL): nothing ran; prepare it again.
            del prepared[statement.name]
        _check(pgconn, result, pq.ExecStatus.TUPLES_OK)
        readers = prepared.get(statement.name)
        if readers is None:
            readers = prepared[statement.name] = tuple(
                _reader(result.ftype(i)) for i in range(result.nfields)
            )
        return _rows(result, readers)


def _check(pgconn: pq.abc.PGconn, result: pq.abc.PGresult, ok: pq.ExecStatus) -> None:
    if result.status == ok:
        return
    if result.error_field(_SQLSTATE) is not None:
        raise error_from_result(result)
    message = (result.error_message or pgconn.error_message).decode("utf-8", "replace")
    raise psycopg.OperationalError(message.strip() or "the connection was lost")


def _rows(result: pq.abc.PGresult, readers: tuple[Reader, ...]) -> Rows:
    get = result.get_value
    rows: Rows = []
    for row in range(result.ntuples):
        rows.append(tuple([read(get(row, i)) for i, read in enumerate(readers)]))
    return rows


def _reader(oid: int) -> Reader:
    if oid in _TEXTS:
        return _text
    if oid in _INTEGERS:
        return _int
    if oid == _BOOL:
        return _bool
    if oid == _UUID:
        return _uuid
    raise TypeError(f"a direct statement returned a column of type oid {oid}")


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode()


def _int(value: bytes | None) -> int | None:
    return None if value is None else int(value)


def _bool(value: bytes | None) -> bool | None:
    return None if value is None else value == b"t"


def _uuid(value: bytes | None) -> uuid.UUID | None:
    return None if value is None else uuid.UUID(value.decode())
