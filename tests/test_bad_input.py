"""Bad input (SPEC 2, 4, 11): each refused with a clear, typed error, and nothing written.

"Nothing written" is checked by counting the rows of both engine tables after the
refusal. Then property tests (hypothesis) feed arbitrary bytes and JSON to every
decoder of stored documents: `codec.decode_text`, `sealing.open_document` (with and
without a cipher), a propagator's snapshot decoder, and the executor itself, by
writing arbitrary JSON or bytes into the stored input and context of a run: the run
must park with the decode error's text (or succeed when the document is valid),
and the execution must never crash.

Decisions this file pins down:
- A wrong Python type for the workflow's input type (a str for an int, 1.5 for an
  int field, None for a str) is an `EncodeError`: the stored document must decode
  back to the very value given, not to a coerced one.
- Idempotency keys must be non-empty `str`: anything else is a `TypeError` or
  `ValueError` naming `idempotency_key`.
- `wait(timeout=0)` and `wait(timeout=-1)` (or a negative timedelta) never block:
  they return the run's status now (`RUNNING` for an unfinished run), like
  `threading.Event.wait` with a non-positive timeout. A non-duration timeout is a
  `TypeError`, NaN a `ValueError`.
- Durations in `handle()`, `Config` and `RunnerConfig` must be positive (except
  `max_in_process_backoff`, which may be 0): zero or negative is a
  `RegistrationError` / `ConfigError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import decimal
import enum
import json
import logging
import threading
import uuid
from typing import Any, Optional

import attrs
import psycopg
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from psycopg.types.json import Jsonb

import workflow
from workflow import codec
from workflow.errors import DecodeError, EncodeError
from workflow.sealing import open_document, propagate

# --- Workflows -------------------------------------------------------------------------


@attrs.frozen
class Transfer:
    account: str
    amount_cents: int


@dataclasses.dataclass(frozen=True)
class Point:
    x: float
    y: float


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@attrs.frozen
class Ctx:
    actor: str


TransferWf = workflow.Workflow("Bad.Transfer", Transfer)
NumberWf = workflow.Workflow("Bad.Number", int)
TextWf = workflow.Workflow("Bad.Text", str)
OtherWf = workflow.Workflow("Bad.Other", Transfer)
NulWf = workflow.Workflow("Bad.NulOutput", str)
step = workflow.Task("bad.step", str)
nul_step = workflow.Task("bad.nul", str)
gate = threading.Event()


def _ok(run: workflow.TaskRun[Any]) -> str:
    return "ok"


def _gated(run: workflow.TaskRun[Any]) -> str:
    gate.wait(30)
    return "ok"


def _nul(run: workflow.TaskRun[Any]) -> str:
    return "a\x00b"


def registry() -> workflow.Registry:
    reg = workflow.Registry()
    reg.register(workflow.define(TransferWf, workflow.handle(step, _ok)))
    reg.register(workflow.define(NumberWf, workflow.handle(step, _ok)))
    reg.register(workflow.define(TextWf, workflow.handle(step, _gated)))
    reg.register(
        workflow.define(
            NulWf, workflow.handle(nul_step, _nul, max_attempts=2, backoff_schedule=[0.01])
        )
    )
    return reg


def counts(db: psycopg.Connection[Any]) -> tuple[int, int]:
    """(rows in workflow_runs, rows in workflow_tasks)."""
    row = db.execute(
        "SELECT (SELECT count(*) FROM workflow_runs), (SELECT count(*) FROM workflow_tasks)"
    ).fetchone()
    assert row is not None
    return row[0], row[1]


@pytest.fixture
def mgr(make_manager: Any) -> workflow.Manager:
    return make_manager(registry())  # type: ignore[no-any-return]


# --- Unencodable input -------------------------------------------------------------------

UNENCODABLE = [
    pytest.param(Transfer(account=object(), amount_cents=1), id="object-in-a-str-field"),  # type: ignore[arg-type]
    pytest.param(Transfer(account="a", amount_cents=float("nan")), id="nan"),  # type: ignore[arg-type]
    pytest.param(Transfer(account="a", amount_cents=float("inf")), id="infinity"),  # type: ignore[arg-type]
    pytest.param(Transfer(account=b"bytes", amount_cents=1), id="bytes"),  # type: ignore[arg-type]
    pytest.param(Transfer(account="lone \ud800 surrogate", amount_cents=1), id="lone-surrogate"),
    pytest.param(Transfer(account="nul \x00 char", amount_cents=1), id="nul-char"),
]


@pytest.mark.parametrize("value", UNENCODABLE)
def test_unencodable_input_is_refused_by_start(
    mgr: workflow.Manager, db: psycopg.Connection[Any], value: Any
) -> None:
    with pytest.raises(EncodeError, match="cannot encode"):
        TransferWf.start(mgr, value)
    assert counts(db) == (0, 0)


@pytest.mark.parametrize("value", UNENCODABLE)
def test_unencodable_input_is_refused_by_start_tx_and_the_transaction_stays_usable(
    mgr: workflow.Manager, db: psycopg.Connection[Any], db_url: str, value: Any
) -> None:
    db.execute("CREATE TABLE business (id int)")
    with psycopg.connect(db_url) as conn, conn.transaction():
        conn.execute("INSERT INTO business VALUES (1)")
        with pytest.raises(EncodeError, match="cannot encode"):
            TransferWf.start_tx(conn, mgr, value)
        # Nothing was sent: the caller's transaction can still commit its own work.
        conn.execute("INSERT INTO business VALUES (2)")
    assert counts(db) == (0, 0)
    assert db.execute("SELECT count(*) FROM business").fetchone() == (2,)


# --- Wrong input type for the workflow ---------------------------------------------------


@pytest.mark.parametrize(
    ("wf", "value"),
    [
        pytest.param(TransferWf, {"account": "a", "amount_cents": 1}, id="dict-for-a-class"),
        pytest.param(TransferWf, "Transfer(a, 1)", id="str-for-a-class"),
        pytest.param(TransferWf, None, id="none-for-a-class"),
        pytest.param(TransferWf, Point(1.0, 2.0), id="another-class"),
        pytest.param(NumberWf, "5", id="str-for-int"),
        pytest.param(NumberWf, 1.5, id="float-for-int"),
        pytest.param(NumberWf, None, id="none-for-int"),
        pytest.param(NumberWf, [1], id="list-for-int"),
        pytest.param(TransferWf, Transfer(account=5, amount_cents=1), id="int-in-a-str-field"),  # type: ignore[arg-type]
        pytest.param(
            TransferWf,
            Transfer(account="a", amount_cents=1.5),
            id="float-in-an-int-field",  # type: ignore[arg-type]
        ),
        pytest.param(TransferWf, Transfer(account=None, amount_cents=1), id="none-in-a-str-field"),  # type: ignore[arg-type]
        pytest.param(TransferWf, Transfer(account="a", amount_cents="1"), id="str-in-an-int-field"),  # type: ignore[arg-type]
    ],
)
def test_wrong_input_type_is_an_encode_error_and_nothing_is_written(
    mgr: workflow.Manager, db: psycopg.Connection[Any], wf: workflow.Workflow[Any], value: Any
) -> None:
    # The stored document must decode back to the value given: a coerced value
    # (int("5"), int(1.5), str(None)) would hand the handler something else.
    with pytest.raises(EncodeError):
        wf.start(mgr, value)
    assert counts(db) == (0, 0)


# --- Run ids ----------------------------------------------------------------------------

BOGUS_IDS = [
    pytest.param(str(uuid.uuid4()), id="unknown-uuid"),
    pytest.param("not-a-run-id", id="text"),
    pytest.param("", id="empty"),
    pytest.param(str(uuid.uuid4()) + "0", id="uuid-plus-one"),
    pytest.param("'; DROP TABLE workflow_runs; --", id="sql"),
    pytest.param(None, id="none"),
    pytest.param(42, id="int"),
    pytest.param(b"\x00" * 16, id="bytes"),
]


@pytest.mark.parametrize("run_id", BOGUS_IDS)
def test_unknown_and_malformed_run_ids_raise_run_not_found(
    mgr: workflow.Manager, db: psycopg.Connection[Any], run_id: Any
) -> None:
    with pytest.raises(workflow.RunNotFound):
        mgr.run(run_id)
    with pytest.raises(workflow.RunNotFound):
        TransferWf.input(mgr, run_id)
    handle = workflow.Run(mgr, run_id)
    with pytest.raises(workflow.RunNotFound):
        handle.status()
    with pytest.raises(workflow.RunNotFound):
        handle.wait(timeout=5)
    with pytest.raises(workflow.RunNotFound):
        handle.wait(timeout=-1)
    assert counts(db) == (0, 0)


def test_input_of_a_run_of_another_workflow_is_run_not_found(
    mgr: workflow.Manager, db: psycopg.Connection[Any]
) -> None:
    run = NumberWf.start(mgr, 7)
    assert run.wait(timeout=30) is workflow.Status.SUCCEEDED
    with pytest.raises(workflow.RunNotFound):
        TransferWf.input(mgr, run.id)
    assert NumberWf.input(mgr, run.id) == 7
    assert counts(db) == (1, 1)


# --- Idempotency keys -------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    [
        pytest.param(5, id="int"),
        pytest.param("", id="empty"),
        pytest.param(b"key", id="bytes"),
        pytest.param(1.5, id="float"),
        pytest.param(["k"], id="list"),
        pytest.param(uuid.uuid4(), id="uuid-object"),
    ],
)
def test_malformed_idempotency_keys_are_refused_and_nothing_is_written(
    mgr: workflow.Manager, db: psycopg.Connection[Any], db_url: str, key: Any
) -> None:
    value = Transfer("a", 1)
    with pytest.raises((TypeError, ValueError), match="idempotency_key"):
        TransferWf.start(mgr, value, idempotency_key=key)
    with psycopg.connect(db_url) as conn, conn.transaction():
        with pytest.raises((TypeError, ValueError), match="idempotency_key"):
            TransferWf.start_tx(conn, mgr, value, idempotency_key=key)
        conn.execute("SELECT 1")  # the transaction is still usable
    assert counts(db) == (0, 0)


# --- Timeouts ---------------------------------------------------------------------------

NON_POSITIVE = [0, -1, -0.5, datetime.timedelta(0), datetime.timedelta(seconds=-1)]


@pytest.mark.parametrize("timeout", NON_POSITIVE)
def test_handle_with_a_non_positive_timeout_is_refused_at_registration(timeout: Any) -> None:
    reg = workflow.Registry()
    wf = workflow.Workflow("Bad.Timeout", str)
    with pytest.raises(workflow.RegistrationError, match="timeout must be positive"):
        reg.register(workflow.define(wf, workflow.handle(step, _ok, timeout=timeout)))
    assert reg.names() == []


@pytest.mark.parametrize("budget", [0, -1, True, 1.5])
def test_handle_with_a_bad_attempt_budget_is_refused_at_registration(budget: Any) -> None:
    reg = workflow.Registry()
    wf = workflow.Workflow("Bad.Budget", str)
    with pytest.raises(workflow.RegistrationError, match="max_attempts"):
        reg.register(workflow.define(wf, workflow.handle(step, _ok, max_attempts=budget)))


@pytest.mark.parametrize(
    "field",
    ["default_task_timeout", "backoff_base", "backoff_max", "sweep_max_age"],
)
@pytest.mark.parametrize("value", NON_POSITIVE)
def test_config_refuses_non_positive_durations(field: str, value: Any) -> None:
    with pytest.raises(workflow.ConfigError, match=field):
        workflow.Config(**{field: value})


@pytest.mark.parametrize("value", [-1, datetime.timedelta(seconds=-1), "5", float("nan")])
def test_config_refuses_a_negative_or_non_duration_in_process_backoff(value: Any) -> None:
    with pytest.raises(workflow.ConfigError, match="max_in_process_backoff"):
        workflow.Config(max_in_process_backoff=value)
    assert workflow.Config(max_in_process_backoff=0).max_in_process_backoff == 0


@pytest.mark.parametrize("field", ["poll_interval", "sweep_interval"])
@pytest.mark.parametrize("value", [*NON_POSITIVE, "1", float("nan")])
def test_runner_config_refuses_non_positive_or_non_duration_intervals(
    field: str, value: Any
) -> None:
    with pytest.raises(workflow.ConfigError, match=field):
        workflow.RunnerConfig(**{field: value})


@pytest.mark.parametrize("field", ["batch_size", "concurrency"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_runner_config_refuses_bad_counts(field: str, value: Any) -> None:
    with pytest.raises(workflow.ConfigError, match=field):
        workflow.RunnerConfig(**{field: value})


def _wait_in_thread(run: workflow.Run, timeout: Any) -> workflow.Status:
    """`run.wait(timeout)` on a thread, which must return within 15 s (it must not block)."""
    box: list[Any] = []
    thread = threading.Thread(target=lambda: box.append(run.wait(timeout=timeout)), daemon=True)
    thread.start()
    thread.join(15)
    assert not thread.is_alive(), f"wait(timeout={timeout!r}) blocked"
    return box[0]  # type: ignore[no-any-return]


def test_wait_with_zero_or_negative_timeout_returns_the_status_now(
    mgr: workflow.Manager, db: psycopg.Connection[Any]
) -> None:
    gate.clear()
    try:
        run = TextWf.start(mgr, "held")  # its handler waits for the gate
        for timeout in (0, -1, -0.001, datetime.timedelta(seconds=-5)):
            assert _wait_in_thread(run, timeout) is workflow.Status.RUNNING
        with pytest.raises(TypeError, match="timeout"):
            run.wait(timeout="1")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="NaN"):
            run.wait(timeout=float("nan"))
    finally:
        gate.set()
    assert run.wait(timeout=30) is workflow.Status.SUCCEEDED
    for timeout in (0, -1):
        assert _wait_in_thread(run, timeout) is workflow.Status.SUCCEEDED
    assert counts(db) == (1, 1)


# --- Registries and managers ------------------------------------------------------------


def test_registering_into_a_registry_frozen_by_a_manager_is_refused(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    reg = registry()
    mgr = make_manager(reg)
    assert reg.frozen
    with pytest.raises(workflow.RegistrationError, match="frozen"):
        reg.register(workflow.define(OtherWf, workflow.handle(step, _ok)))
    assert OtherWf.name not in reg.names()
    # A registry built after the manager holds the workflow, but this manager
    # does not know it: starting it is refused, and nothing is written.
    later = workflow.Registry()
    later.register(workflow.define(OtherWf, workflow.handle(step, _ok)))
    with pytest.raises(workflow.WorkflowError, match="not registered"):
        OtherWf.start(mgr, Transfer("a", 1))
    assert counts(db) == (0, 0)


def test_starting_a_workflow_not_registered_with_the_manager_writes_nothing(
    mgr: workflow.Manager, db: psycopg.Connection[Any], db_url: str
) -> None:
    with pytest.raises(workflow.WorkflowError, match="not registered"):
        OtherWf.start(mgr, Transfer("a", 1))
    with psycopg.connect(db_url) as conn, conn.transaction():
        with pytest.raises(workflow.WorkflowError, match="not registered"):
            OtherWf.start_tx(conn, mgr, Transfer("a", 1))
        conn.execute("SELECT 1")
    with pytest.raises(workflow.RunNotFound):
        OtherWf.input(mgr, str(uuid.uuid4()))
    assert counts(db) == (0, 0)


def test_a_manager_needs_a_registry_and_a_config(pool: Any) -> None:
    with pytest.raises(TypeError, match="Registry"):
        workflow.Manager(pool, "not a registry")  # type: ignore[arg-type]
    with pytest.raises(workflow.ConfigError, match="Config"):
        workflow.Manager(pool, registry(), {"sweep_max_age": 3})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ConnectionPool"):
        workflow.Manager(42, registry())  # type: ignore[arg-type]


# --- start_tx with an unusable connection -----------------------------------------------


def test_start_tx_refuses_an_autocommit_connection(
    mgr: workflow.Manager, db: psycopg.Connection[Any], db_url: str
) -> None:
    with (
        psycopg.connect(db_url, autocommit=True) as conn,
        pytest.raises(workflow.WorkflowError, match="inside a transaction"),
    ):
        TransferWf.start_tx(conn, mgr, Transfer("a", 1))
    assert counts(db) == (0, 0)


def test_start_tx_refuses_a_failed_transaction(
    mgr: workflow.Manager, db: psycopg.Connection[Any], db_url: str
) -> None:
    with psycopg.connect(db_url) as conn:
        with pytest.raises(psycopg.errors.DivisionByZero):
            conn.execute("SELECT 1 / 0")
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR
        with pytest.raises(workflow.WorkflowError, match="has failed"):
            TransferWf.start_tx(conn, mgr, Transfer("a", 1))
        conn.rollback()
    assert counts(db) == (0, 0)


def test_start_tx_refuses_a_closed_connection_and_a_non_connection(
    mgr: workflow.Manager, db: psycopg.Connection[Any], db_url: str
) -> None:
    conn = psycopg.connect(db_url)
    conn.close()
    with pytest.raises(workflow.WorkflowError):
        TransferWf.start_tx(conn, mgr, Transfer("a", 1))
    with pytest.raises(TypeError, match=r"psycopg\.Connection"):
        TransferWf.start_tx(db_url, mgr, Transfer("a", 1))  # type: ignore[arg-type]
    assert counts(db) == (0, 0)


def test_start_tx_rolled_back_leaves_nothing(
    mgr: workflow.Manager, db: psycopg.Connection[Any], db_url: str
) -> None:
    with psycopg.connect(db_url) as conn, conn.transaction(force_rollback=True):
        TransferWf.start_tx(conn, mgr, Transfer("a", 1))
    assert counts(db) == (0, 0)


# --- A handler output that cannot be stored ---------------------------------------------


def test_an_output_postgres_cannot_store_fails_the_attempt_and_parks(
    mgr: workflow.Manager, db: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    # jsonb refuses "\u0000": the output must be refused as an EncodeError, spending
    # attempts, rather than failing the write and being re-executed for ever.
    run = NulWf.start(mgr, "x")
    assert run.wait(timeout=10) is workflow.Status.PARKED
    failure = run.status().failure
    assert failure is not None and failure.attempts == 2
    assert "encode" in failure.error


# --- Property tests: arbitrary documents to every decoder -------------------------------

SETTINGS = settings(max_examples=200, deadline=None)
DB_SETTINGS = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

# JSON documents PostgreSQL's jsonb can hold (no NUL in strings, no lone surrogates).
TEXT = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)))
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63)
    | st.floats(allow_nan=False, allow_infinity=False)
    | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)
# Documents shaped like the declared types more often than chance would make them.
NEAR_TRANSFER = st.fixed_dictionaries(
    {"account": JSON | TEXT, "amount_cents": JSON | st.integers()},
    optional={"extra": JSON},
)


class Reject(Exception):
    """The reference decoder refuses the document."""


def expected(doc: Any, tp: Any) -> Any:
    """What a strict decoder must make of `doc` as `tp`; `Reject` when it must refuse."""
    if tp is int:
        if isinstance(doc, bool) or not isinstance(doc, int):
            raise Reject
        return doc
    if tp is float:
        if isinstance(doc, bool) or not isinstance(doc, (int, float)):
            raise Reject
        return float(doc)
    if tp in (str, bool):
        if type(doc) is not tp:
            raise Reject
        return doc
    if tp == Optional[str]:  # noqa: UP045
        return None if doc is None else expected(doc, str)
    if tp == list[int]:
        if not isinstance(doc, list):
            raise Reject
        return [expected(x, int) for x in doc]
    if tp == dict[str, int]:
        if not isinstance(doc, dict):
            raise Reject
        return {k: expected(v, int) for k, v in doc.items()}
    if tp == tuple[int, str]:
        if not isinstance(doc, list) or len(doc) != 2:
            raise Reject
        return (expected(doc[0], int), expected(doc[1], str))
    if tp is Transfer:
        if not isinstance(doc, dict) or not {"account", "amount_cents"} <= doc.keys():
            raise Reject
        return Transfer(expected(doc["account"], str), expected(doc["amount_cents"], int))
    raise AssertionError(tp)


def same(a: Any, b: Any) -> bool:
    """Deep equality that tells bool from int and int from float."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if attrs.has(type(a)):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in attrs.fields(type(a)))
    return bool(a == b)


EXACT_TYPES = [
    int,
    float,
    str,
    bool,
    Optional[str],  # noqa: UP045
    list[int],
    dict[str, int],
    tuple[int, str],
    Transfer,
]
LOOSE_TYPES = [uuid.UUID, datetime.datetime, decimal.Decimal, Color, Point]


@SETTINGS
@given(doc=JSON | NEAR_TRANSFER, tp=st.sampled_from(EXACT_TYPES))
def test_decode_text_of_arbitrary_json_is_exact_or_a_decode_error(doc: Any, tp: Any) -> None:
    text = json.dumps(doc)
    try:
        want = expected(doc, tp)
    except Reject:
        with pytest.raises(DecodeError):
            got = codec.decode_text(text, tp)
            pytest.fail(f"decoded {text} as {tp} into {got!r}; it should be refused")
        return
    assert same(codec.decode_text(text, tp), want)
    assert same(codec.decode_text(text.encode("utf-8"), tp), want)


@SETTINGS
@given(doc=JSON, tp=st.sampled_from(LOOSE_TYPES))
def test_decode_text_of_arbitrary_json_as_other_types_is_a_value_or_a_decode_error(
    doc: Any, tp: Any
) -> None:
    try:
        value = codec.decode_text(json.dumps(doc), tp)
    except DecodeError:
        return
    assert isinstance(value, tp)


@SETTINGS
@given(raw=st.binary(max_size=64), tp=st.sampled_from(EXACT_TYPES + LOOSE_TYPES))
def test_decode_text_of_arbitrary_bytes_is_a_value_or_a_decode_error(raw: bytes, tp: Any) -> None:
    for data in (raw, raw.decode("latin-1")):
        with contextlib.suppress(DecodeError):
            codec.decode_text(data, tp)


class _IdentityCipher:
    def seal(self, plaintext: bytes, /) -> bytes:
        return plaintext

    def open(self, sealed: bytes, /) -> bytes:
        return sealed


class _ExplodingCipher:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def seal(self, plaintext: bytes, /) -> bytes:
        return plaintext

    def open(self, sealed: bytes, /) -> bytes:
        raise self.exc


KEY = bytes(range(32))
CIPHERS = [
    None,
    workflow.AESGCMCipher([KEY]),
    _IdentityCipher(),
    _ExplodingCipher(KeyError("k")),
    _ExplodingCipher(ValueError("v")),
    _ExplodingCipher(UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad")),
]


@SETTINGS
@given(
    sealed=st.binary(max_size=96),
    cipher=st.sampled_from(CIPHERS),
    bound=st.booleans(),
)
def test_open_document_of_arbitrary_bytes_is_json_or_a_decode_error(
    sealed: bytes, cipher: Any, bound: bool
) -> None:
    run_id = uuid.uuid4()
    if bound:  # bytes that name the right run, to reach the JSON parse
        sealed = run_id.bytes + sealed
    try:
        document = open_document(None, sealed, run_id, cipher, "input")
    except DecodeError as e:
        assert "input" in str(e)
        return
    assert isinstance(cipher, _IdentityCipher)
    assert document == json.loads(sealed[16:])


@SETTINGS
@given(payload=st.binary(max_size=64), doc=JSON)
def test_open_document_of_sealed_non_json_or_foreign_documents_is_a_decode_error(
    payload: bytes, doc: Any
) -> None:
    cipher = workflow.AESGCMCipher([KEY])
    run_id, other = uuid.uuid4(), uuid.uuid4()
    text = json.dumps(doc).encode("utf-8")
    assert open_document(None, cipher.seal(run_id.bytes + text), run_id, cipher, "input") == doc
    with pytest.raises(DecodeError, match="another run"):
        open_document(None, cipher.seal(other.bytes + text), run_id, cipher, "input")
    with pytest.raises(DecodeError, match="no cipher"):
        open_document(None, cipher.seal(run_id.bytes + text), run_id, None, "input")
    with pytest.raises(DecodeError, match="does not open"):
        open_document(
            None,
            cipher.seal(run_id.bytes + text),
            run_id,
            workflow.AESGCMCipher([bytes(32)]),
            "input",
        )
    try:
        json.loads(payload)
    except ValueError:
        with pytest.raises(DecodeError, match="not JSON"):
            open_document(None, cipher.seal(run_id.bytes + payload), run_id, cipher, "input")
    # A plain document is returned as it is, whatever the cipher.
    assert open_document(doc, None, run_id, cipher, "input") == doc


class CtxPropagator:
    snapshot_type = Ctx

    def capture(self) -> Ctx:
        return Ctx(actor="tester")

    def restore(self, snapshot: Ctx) -> Any:
        return contextlib.nullcontext()


@SETTINGS
@given(doc=JSON)
def test_snapshot_decoder_of_arbitrary_json_is_a_snapshot_or_a_decode_error(doc: Any) -> None:
    propagation = propagate(CtxPropagator())
    try:
        snapshot = propagation.decode_snapshot(doc)
    except DecodeError:
        return
    assert isinstance(snapshot, Ctx)


# --- The executor's input and context paths, on stored arbitrary documents --------------

ExecWf = workflow.Workflow("Bad.Exec", Transfer)
exec_step = workflow.Task("bad.exec", str)


def _exec_registry() -> workflow.Registry:
    reg = workflow.Registry()
    reg.register(workflow.define(ExecWf, workflow.handle(exec_step, _ok)))
    return reg


@pytest.fixture
def exec_logger(caplog: pytest.LogCaptureFixture) -> logging.Logger:
    caplog.set_level(logging.INFO, logger="bad_input.engine")
    return logging.getLogger("bad_input.engine")


def _crashes(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "bad_input.engine" and r.levelno >= logging.ERROR and r.exc_info
    ]


def _start_pending(db_url: str, mgr: workflow.Manager) -> str:
    with psycopg.connect(db_url) as conn, conn.transaction():
        return ExecWf.start_tx(conn, mgr, Transfer("a", 1)).id


def _settle(mgr: workflow.Manager, run_id: str) -> workflow.RunStatus:
    status = mgr.run(run_id).wait(timeout=30)
    assert status.terminal, f"run {run_id} did not settle: {status}"
    return mgr.run(run_id).status()


@DB_SETTINGS
@given(doc=JSON | NEAR_TRANSFER)
def test_executor_parks_a_run_whose_stored_input_does_not_decode(
    make_manager: Any,
    db: psycopg.Connection[Any],
    db_url: str,
    exec_logger: logging.Logger,
    caplog: pytest.LogCaptureFixture,
    doc: Any,
) -> None:
    mgr = _manager(make_manager, exec_logger)
    run_id = _start_pending(db_url, mgr)
    db.execute("UPDATE workflow_runs SET input = %s WHERE id = %s", (Jsonb(doc), run_id))
    stored = db.execute("SELECT input FROM workflow_runs WHERE id = %s", (run_id,)).fetchone()
    assert stored is not None
    status = _settle(mgr, run_id)
    try:
        codec.decode(stored[0], Transfer)
    except DecodeError as e:
        assert status.status is workflow.Status.PARKED
        assert status.failure is not None
        assert status.failure.error == f"the run's input no longer opens: {e}"
        assert status.failure.attempts == 0
    else:
        assert status.status is workflow.Status.SUCCEEDED
    assert _crashes(caplog) == []


@DB_SETTINGS
@given(doc=JSON | st.fixed_dictionaries({"actor": JSON}))
@example(doc=1e16)  # stored by jsonb as an integer
def test_executor_parks_a_run_whose_stored_context_does_not_decode(
    make_manager: Any,
    db: psycopg.Connection[Any],
    db_url: str,
    exec_logger: logging.Logger,
    caplog: pytest.LogCaptureFixture,
    doc: Any,
) -> None:
    mgr = _manager(make_manager, exec_logger, context=propagate(CtxPropagator()))
    run_id = _start_pending(db_url, mgr)
    db.execute("UPDATE workflow_runs SET context = %s WHERE id = %s", (Jsonb(doc), run_id))
    # As the engine reads it back: jsonb normalizes numbers (1e16 comes back as
    # the integer 10000000000000000).
    stored = db.execute(
        "SELECT context::text FROM workflow_runs WHERE id = %s", (run_id,)
    ).fetchone()
    assert stored is not None
    status = _settle(mgr, run_id)
    try:
        propagate(CtxPropagator()).decode_snapshot(json.loads(stored[0]))
    except DecodeError as e:
        assert status.status is workflow.Status.PARKED
        assert status.failure is not None
        assert status.failure.error == f"the run's calling context no longer opens: {e}"
        assert status.failure.attempts == 0
    else:
        assert status.status is workflow.Status.SUCCEEDED
    assert _crashes(caplog) == []


@DB_SETTINGS
@given(
    sealed=st.binary(max_size=80),
    with_cipher=st.booleans(),
    column=st.sampled_from(["input", "context"]),
)
def test_executor_parks_a_run_whose_sealed_document_does_not_open(
    make_manager: Any,
    db: psycopg.Connection[Any],
    db_url: str,
    exec_logger: logging.Logger,
    caplog: pytest.LogCaptureFixture,
    sealed: bytes,
    with_cipher: bool,
    column: str,
) -> None:
    mgr = _manager(
        make_manager,
        exec_logger,
        cipher=workflow.AESGCMCipher([KEY]) if with_cipher else None,
        context=propagate(CtxPropagator()),
    )
    run_id = _start_pending(db_url, mgr)
    db.execute(
        f"UPDATE workflow_runs SET {column} = NULL, {column}_sealed = %s WHERE id = %s",
        (sealed, run_id),
    )
    status = _settle(mgr, run_id)
    assert status.status is workflow.Status.PARKED
    assert status.failure is not None and status.failure.attempts == 0
    what = "input" if column == "input" else "calling context"
    assert status.failure.error.startswith(f"the run's {what} no longer opens: the {what} ")
    reason = "does not open" if with_cipher else "no cipher configured"
    assert reason in status.failure.error
    assert _crashes(caplog) == []


def _manager(make_manager: Any, logger: logging.Logger, **config: Any) -> workflow.Manager:
    """A manager per example (each example's runs are independent)."""
    return make_manager(_exec_registry(), workflow.Config(**config), logger=logger)  # type: ignore[no-any-return]


# --- Keys, names, shapes and databases the schema cannot carry ------------------------

DictWf = workflow.Workflow("Bad.Dict", dict)
ListWf = workflow.Workflow("Bad.List", list)


def registry_with_containers() -> workflow.Registry:
    reg = registry()
    reg.register(workflow.define(DictWf, workflow.handle(step, _ok)))
    reg.register(workflow.define(ListWf, workflow.handle(step, _ok)))
    return reg


UNSTORABLE_KEYS = [
    pytest.param("order\x00-7", id="nul"),
    pytest.param(b"caf\xe9".decode("utf-8", "surrogateescape"), id="lone-surrogate"),
    pytest.param("k" * 1025, id="too-long"),
    pytest.param("é" * 513, id="too-long-in-utf8"),
]


@pytest.mark.parametrize("key", UNSTORABLE_KEYS)
def test_an_idempotency_key_the_index_cannot_carry_is_an_encode_error_before_any_sql(
    mgr: workflow.Manager, db: psycopg.Connection[Any], db_url: str, key: str
) -> None:
    value = Transfer("a", 1)
    with pytest.raises(EncodeError, match="idempotency_key"):
        TransferWf.start(mgr, value, idempotency_key=key)
    with psycopg.connect(db_url) as conn, conn.transaction():
        with pytest.raises(EncodeError, match="idempotency_key"):
            TransferWf.start_tx(conn, mgr, value, idempotency_key=key)
        conn.execute("SELECT 1")  # the caller's transaction is still usable
    assert counts(db) == (0, 0)


def test_the_longest_idempotency_key_is_accepted(
    mgr: workflow.Manager, db: psycopg.Connection[Any]
) -> None:
    key = "k" * 1024
    run = TransferWf.start(mgr, Transfer("a", 1), idempotency_key=key)
    assert run.wait(timeout=20) is workflow.Status.SUCCEEDED
    assert TransferWf.start(mgr, Transfer("a", 1), idempotency_key=key) == run


@pytest.mark.parametrize(
    ("name", "words"),
    [
        pytest.param("W" * 256, "255", id="too-long"),
        pytest.param("é" * 128, "255", id="too-long-in-utf8"),
        pytest.param("Bad\x00Name", "NUL", id="nul"),
        pytest.param("Bad\ud800", "surrogate", id="lone-surrogate"),
    ],
)
def test_a_workflow_name_the_schema_cannot_carry_is_refused(name: str, words: str) -> None:
    with pytest.raises(workflow.RegistrationError, match=words):
        workflow.Registry().register(
            workflow.define(workflow.Workflow(name, str), workflow.handle(step, _ok))
        )


@pytest.mark.parametrize("name", ["bad\x00task", "t" * 256, "\udc80"])
def test_a_task_name_the_schema_cannot_carry_is_refused(name: str) -> None:
    with pytest.raises(workflow.RegistrationError, match="task name"):
        workflow.Registry().register(
            workflow.define(
                workflow.Workflow("Fine", str), workflow.handle(workflow.Task(name), _ok)
            )
        )


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    inner = value
    for _ in range(depth):
        inner.append([])
        inner = inner[0]
    return value


def test_an_input_nested_too_deep_is_an_encode_error(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    mgr = make_manager(registry_with_containers())
    with pytest.raises(EncodeError, match="deep"):
        ListWf.start(mgr, _nested(5000))
    assert counts(db) == (0, 0)


def test_dict_keys_that_collide_once_encoded_are_an_encode_error(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    mgr = make_manager(registry_with_containers())
    with pytest.raises(EncodeError, match="'1'"):
        DictWf.start(mgr, {1: "a", "1": "b"})
    with pytest.raises(EncodeError, match="key"):
        DictWf.start(mgr, {"x": {True: 1, "true": 2}})
    assert counts(db) == (0, 0)


def test_start_tx_on_a_connection_to_another_database_names_both(
    mgr: workflow.Manager, db: psycopg.Connection[Any], pg_url: str, template_db: str
) -> None:
    from conftest import create_database, drop_database, with_dbname

    other = create_database(pg_url, template_db)  # migrated: the tables are there too
    try:
        with psycopg.connect(with_dbname(pg_url, other)) as conn:
            with conn.transaction():
                with pytest.raises(workflow.WorkflowError) as info:
                    TransferWf.start_tx(conn, mgr, Transfer("a", 1))
                message = str(info.value)
                assert other in message and db.info.dbname in message
            row = conn.execute("SELECT count(*) FROM workflow_runs").fetchone()
            assert row == (0,), "the run was committed in the other database"
    finally:
        drop_database(pg_url, other)
    assert counts(db) == (0, 0)


def test_start_tx_on_a_connection_to_an_unmigrated_database_says_so(
    mgr: workflow.Manager, empty_db_url: str
) -> None:
    with (
        psycopg.connect(empty_db_url) as conn,
        conn.transaction(),
        pytest.raises(workflow.WorkflowError, match="start_tx"),
    ):
        TransferWf.start_tx(conn, mgr, Transfer("a", 1))


@pytest.mark.parametrize(
    ("url", "words"),
    [
        pytest.param(
            "postgresql://postgres@127.0.0.1:1/postgres", "cannot connect", id="no-server"
        ),
        pytest.param("not a url at all ===", "invalid database URL", id="malformed"),
    ],
)
def test_manager_on_a_database_it_cannot_reach_raises_with_the_reason_at_once(
    url: str, words: str
) -> None:
    import time

    began = time.monotonic()
    with pytest.raises(workflow.WorkflowError, match=words):
        workflow.Manager(url, registry())
    assert time.monotonic() - began < 15


def test_manager_on_a_missing_database_names_it(pg_url: str) -> None:
    from conftest import with_dbname

    missing = f"workflow_missing_{uuid.uuid4().hex[:8]}"
    with pytest.raises(workflow.WorkflowError, match=missing):
        workflow.Manager(with_dbname(pg_url, missing), registry())


INFINITE_DURATIONS = [float("inf"), 1e300, datetime.timedelta.max]


@pytest.mark.parametrize("value", INFINITE_DURATIONS, ids=["inf", "1e300", "timedelta.max"])
@pytest.mark.parametrize(
    "field",
    ["default_task_timeout", "backoff_base", "backoff_max", "max_in_process_backoff",
     "sweep_max_age"],
)
def test_config_refuses_durations_out_of_range(field: str, value: Any) -> None:
    with pytest.raises(workflow.ConfigError, match=field):
        workflow.Config(**{field: value})


@pytest.mark.parametrize("value", INFINITE_DURATIONS, ids=["inf", "1e300", "timedelta.max"])
@pytest.mark.parametrize("field", ["poll_interval", "sweep_interval"])
def test_runner_config_refuses_durations_out_of_range(field: str, value: Any) -> None:
    with pytest.raises(workflow.ConfigError, match=field):
        workflow.RunnerConfig(**{field: value})
