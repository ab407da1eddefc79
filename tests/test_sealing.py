"""SPEC section 7: sealing the input and the calling context at rest.

`AESGCMCipher` on its own (key sizes, rotation, tampering), then end to end: a
sealed run leaves no plaintext in its rows, runs sealed with an old key still run
after rotation, and every document that does not open parks its run without
spending an attempt, logged at ALERT.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import context_apps
import psycopg
import pytest
from context_apps import CALLER, Caller, CallerPropagator
from hypothesis import given
from hypothesis import strategies as st

import workflow
from workflow.sealing import open_document, seal_document

WAIT = 30
KEY_A = bytes(range(32))
KEY_B = bytes(range(100, 132))
KEY_C = hashlib.sha256(b"another key").digest()


# --- AESGCMCipher on its own ---------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 16, 24, 31, 33, 64])
def test_keys_must_be_32_bytes(size: int) -> None:
    with pytest.raises(ValueError):
        workflow.AESGCMCipher([b"k" * size])
    with pytest.raises(ValueError):
        workflow.AESGCMCipher([KEY_A, b"k" * size])


@pytest.mark.parametrize("keys", [[], (), KEY_A, ["x" * 32], [None]])
def test_keys_must_be_a_non_empty_sequence_of_bytes(keys: Any) -> None:
    with pytest.raises(ValueError):
        workflow.AESGCMCipher(keys)


def test_an_empty_iterable_of_keys_is_refused_up_front() -> None:
    """Not a cipher that builds and then fails at the first seal (inside `start`)."""
    with pytest.raises(ValueError):
        workflow.AESGCMCipher(iter([]))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        workflow.AESGCMCipher(k for k in ())  # type: ignore[arg-type]


def test_aesgcm_cipher_is_a_cipher() -> None:
    cipher = workflow.AESGCMCipher([KEY_A])
    assert isinstance(cipher, workflow.Cipher)
    workflow.Config(cipher=cipher)
    with pytest.raises(workflow.ConfigError):
        workflow.Config(cipher=object())  # type: ignore[arg-type]


@pytest.mark.parametrize("plaintext", [b"", b"x", b'{"account": "secret"}', bytes(range(256)) * 9])
def test_seal_and_open_round_trip(plaintext: bytes) -> None:
    cipher = workflow.AESGCMCipher([KEY_A])
    sealed = cipher.seal(plaintext)
    assert cipher.open(sealed) == plaintext
    assert workflow.AESGCMCipher([KEY_A]).open(sealed) == plaintext
    if len(plaintext) > 4:
        assert plaintext not in sealed


def test_each_seal_uses_a_fresh_nonce() -> None:
    cipher = workflow.AESGCMCipher([KEY_A])
    envelopes = {cipher.seal(b"same plaintext") for _ in range(20)}
    assert len(envelopes) == 20


def test_rotation_opens_old_envelopes_and_seals_with_the_first_key() -> None:
    old = workflow.AESGCMCipher([KEY_A])
    rotated = workflow.AESGCMCipher([KEY_B, KEY_A])
    envelope_a = old.seal(b"sealed before rotation")
    assert rotated.open(envelope_a) == b"sealed before rotation"

    envelope_b = rotated.seal(b"sealed after rotation")
    assert workflow.AESGCMCipher([KEY_B]).open(envelope_b) == b"sealed after rotation"
    with pytest.raises(ValueError):
        old.open(envelope_b)
    # Keys can be reordered: the envelope names its key.
    reordered = workflow.AESGCMCipher([KEY_A, KEY_B])
    assert reordered.open(envelope_a) == b"sealed before rotation"
    assert reordered.open(envelope_b) == b"sealed after rotation"


def test_an_envelope_from_an_unknown_key_does_not_open() -> None:
    envelope = workflow.AESGCMCipher([KEY_A]).seal(b"payload")
    with pytest.raises(ValueError):
        workflow.AESGCMCipher([KEY_B]).open(envelope)
    with pytest.raises(ValueError):
        workflow.AESGCMCipher([KEY_B, KEY_C]).open(envelope)


def test_a_tampered_envelope_does_not_open() -> None:
    cipher = workflow.AESGCMCipher([KEY_A, KEY_B])
    envelope = cipher.seal(b"the amount is 100")
    for i in range(len(envelope)):
        for flip in (0x01, 0x80):
            tampered = bytearray(envelope)
            tampered[i] ^= flip
            with pytest.raises(ValueError):
                cipher.open(bytes(tampered))
    for bad in (envelope[:-1], envelope + b"\x00", envelope[:20], b"", envelope[1:]):
        with pytest.raises(ValueError):
            cipher.open(bad)


# --- arbitrary bytes -----------------------------------------------------------------

CIPHER = workflow.AESGCMCipher([KEY_A, KEY_B])
RUN_ID = uuid.UUID("12345678-1234-5678-1234-567812345678")

_envelope_shaped = st.builds(
    lambda key, nonce, body: b"\x01" + hashlib.sha256(key).digest()[:4] + nonce + body,
    st.sampled_from([KEY_A, KEY_B, KEY_C]),
    st.binary(min_size=12, max_size=12),
    st.binary(min_size=0, max_size=80),
)
_arbitrary = st.one_of(st.binary(max_size=120), _envelope_shaped)


@given(_arbitrary)
def test_aesgcm_open_raises_value_error_for_arbitrary_bytes(data: bytes) -> None:
    with pytest.raises(ValueError):
        CIPHER.open(data)


@given(_arbitrary)
def test_open_document_raises_decode_error_for_arbitrary_bytes(data: bytes) -> None:
    with pytest.raises(workflow.DecodeError):
        open_document(None, data, RUN_ID, CIPHER, "input")


@given(st.binary(max_size=120))
def test_open_document_of_arbitrary_sealed_plaintext_returns_or_raises_decode_error(
    plaintext: bytes,
) -> None:
    sealed = CIPHER.seal(plaintext)
    try:
        document = open_document(None, sealed, RUN_ID, CIPHER, "input")
    except workflow.DecodeError:
        return
    assert plaintext[:16] == RUN_ID.bytes
    assert document == json.loads(plaintext[16:])


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


@given(_json, st.uuids(), st.uuids())
def test_sealed_documents_round_trip_and_are_bound_to_their_run(
    document: Any, run_id: uuid.UUID, other: uuid.UUID
) -> None:
    text = json.dumps(document)
    plain, sealed = seal_document(text, run_id, CIPHER)
    assert plain is None and sealed is not None
    assert open_document(plain, sealed, run_id, CIPHER, "input") == document
    if other != run_id:
        with pytest.raises(workflow.DecodeError):
            open_document(plain, sealed, other, CIPHER, "input")
    with pytest.raises(workflow.DecodeError):
        open_document(plain, sealed, run_id, None, "input")
    with pytest.raises(workflow.DecodeError):
        open_document(plain, sealed, run_id, workflow.AESGCMCipher([KEY_C]), "input")


# --- end to end ----------------------------------------------------------------------


@attrs.frozen
class Payment:
    account: str
    note: str


@attrs.frozen
class Receipt:
    length: int


Pay = workflow.Workflow("sealing.Pay", Payment)
charge = workflow.Task("sealing.charge")
receipt = workflow.Task("sealing.receipt", Receipt)


class Recorder:
    """Handlers that record what they saw (inputs, calling context) in this process."""

    def __init__(self) -> None:
        self.inputs: list[tuple[str, Payment]] = []
        self.callers: list[Caller | None] = []
        self._lock = threading.Lock()

    def charge(self, run: workflow.TaskRun[Payment]) -> None:
        with self._lock:
            self.inputs.append((run.run_id, run.input))
            self.callers.append(CALLER.get())

    def receipt(self, run: workflow.TaskRun[Payment]) -> Receipt:
        with self._lock:
            self.callers.append(CALLER.get())
        return Receipt(length=len(run.input.account))

    def registry(self) -> workflow.Registry:
        reg = workflow.Registry()
        reg.register(
            workflow.define(
                Pay, workflow.handle(charge, self.charge), workflow.handle(receipt, self.receipt)
            )
        )
        return reg

    def calls_for(self, run_id: str) -> list[Payment]:
        return [payment for rid, payment in self.inputs if rid == run_id]


def config(keys: list[bytes] | None, *, context: bool = True) -> workflow.Config:
    return workflow.Config(
        cipher=workflow.AESGCMCipher(keys) if keys is not None else None,
        context=workflow.propagate(CallerPropagator()) if context else None,
    )


@contextlib.contextmanager
def calling_as(caller: Caller) -> Iterator[None]:
    token = CALLER.set(caller)
    try:
        yield
    finally:
        CALLER.reset(token)


def start_tx(db_url: str, mgr: workflow.Manager, payment: Payment) -> workflow.Run:
    with psycopg.connect(db_url) as conn, conn.transaction():
        return Pay.start_tx(conn, mgr, payment)


def dump(db: psycopg.Connection[Any]) -> list[str]:
    runs = db.execute("SELECT r::text FROM workflow_runs r").fetchall()
    tasks = db.execute("SELECT t::text FROM workflow_tasks t").fetchall()
    return [row[0] for row in runs + tasks]


def assert_nowhere(marker: str, db: psycopg.Connection[Any]) -> None:
    rows = dump(db)
    assert rows
    for row in rows:
        assert marker not in row
        # A bytea column dumps as hex: plaintext bytes stored "sealed" would show here.
        assert marker.encode().hex() not in row


def stored(db: psycopg.Connection[Any], run_id: str) -> tuple[Any, Any, Any, Any]:
    row = db.execute(
        "SELECT input, input_sealed, context, context_sealed FROM workflow_runs WHERE id = %s",
        (run_id,),
    ).fetchone()
    assert row is not None
    return row[0], row[1], row[2], row[3]


def alerts(caplog: pytest.LogCaptureFixture, run_id: str) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.levelno == workflow.ALERT and getattr(r, "run_id", None) == run_id
    ]


def assert_parked_without_spending(
    run: workflow.Run,
    db: psycopg.Connection[Any],
    caplog: pytest.LogCaptureFixture,
    recorder: Recorder,
    *secrets: str,
) -> None:
    status = run.status()
    assert status.status is workflow.Status.PARKED
    assert status.failure is not None
    assert status.failure.task == charge.name
    assert status.failure.attempts == 0
    assert status.finished_at is not None
    for secret in secrets:
        assert secret not in status.failure.error
    attempts = db.execute(
        "SELECT attempts FROM workflow_tasks WHERE run_id = %s ORDER BY seq", (run.id,)
    ).fetchall()
    assert [a for (a,) in attempts] == [0, 0]
    assert recorder.calls_for(run.id) == []
    records = alerts(caplog, run.id)
    assert len(records) == 1, [r.getMessage() for r in caplog.records]
    assert records[0].levelname == "ALERT"
    assert records[0].getMessage().startswith("workflow: ")
    for secret in secrets:
        assert secret not in records[0].getMessage()


def marker() -> str:
    return f"PII-MARKER-{uuid.uuid4().hex}"


@pytest.mark.parametrize("path", ["fast", "kick"])
def test_a_sealed_run_leaves_no_plaintext_in_its_rows(
    make_manager: Any, db_url: str, db: psycopg.Connection[Any], path: str
) -> None:
    recorder = Recorder()
    mgr = make_manager(recorder.registry(), config([KEY_A]))
    secret, actor = marker(), marker()
    payment = Payment(account=secret, note="transfer")

    with calling_as(Caller(actor=actor, request_id="req-1")):
        run = Pay.start(mgr, payment) if path == "fast" else start_tx(db_url, mgr, payment)
    assert mgr.run(run.id).wait(WAIT) is workflow.Status.SUCCEEDED

    assert recorder.calls_for(run.id) == [payment]
    assert recorder.callers == [Caller(actor=actor, request_id="req-1")] * 2
    assert Pay.input(mgr, run.id) == payment
    plain_input, sealed_input, plain_context, sealed_context = stored(db, run.id)
    assert plain_input is None and sealed_input is not None
    assert plain_context is None and sealed_context is not None
    assert secret.encode() not in bytes(sealed_input)
    assert actor.encode() not in bytes(sealed_context)
    assert_nowhere(secret, db)
    assert_nowhere(actor, db)
    # Outputs stay plain.
    output = db.execute(
        "SELECT output FROM workflow_tasks WHERE run_id = %s AND seq = 2", (run.id,)
    ).fetchone()
    assert output == ({"length": len(secret)},)


def test_runs_sealed_with_an_old_key_still_run_after_rotation(
    make_manager: Any, db_url: str, db: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    recorder = Recorder()
    before = make_manager(recorder.registry(), config([KEY_A]))
    with calling_as(Caller(actor="ivan", request_id="req-4")):
        old_runs = [
            start_tx(db_url, before, Payment(account=f"acct-{i}", note="old")) for i in range(3)
        ]

    after = make_manager(recorder.registry(), config([KEY_B, KEY_A]))
    for i, run in enumerate(old_runs):
        assert Pay.input(after, run.id) == Payment(account=f"acct-{i}", note="old")
        assert after.run(run.id).wait(WAIT) is workflow.Status.SUCCEEDED
        assert recorder.calls_for(run.id) == [Payment(account=f"acct-{i}", note="old")]
    assert set(recorder.callers) == {Caller(actor="ivan", request_id="req-4")}

    # New runs are sealed with the new first key: a manager with only the new key opens
    # them, one with only the old key cannot.
    new_run = start_tx(db_url, after, Payment(account="acct-new", note="new"))
    only_b = make_manager(recorder.registry(), config([KEY_B]))
    assert Pay.input(only_b, new_run.id) == Payment(account="acct-new", note="new")
    only_a = make_manager(recorder.registry(), config([KEY_A]))
    with pytest.raises(workflow.DecodeError):
        Pay.input(only_a, new_run.id)
    assert only_b.run(new_run.id).wait(WAIT) is workflow.Status.SUCCEEDED
    assert alerts(caplog, new_run.id) == []


@pytest.mark.parametrize("column", ["input_sealed", "context_sealed"])
def test_a_sealed_document_moved_to_another_run_does_not_open(
    make_manager: Any,
    db_url: str,
    db: psycopg.Connection[Any],
    caplog: pytest.LogCaptureFixture,
    column: str,
) -> None:
    recorder = Recorder()
    mgr = make_manager(recorder.registry(), config([KEY_A]))
    donor_secret = marker()
    with calling_as(Caller(actor=donor_secret, request_id="req-donor")):
        donor = start_tx(db_url, mgr, Payment(account=donor_secret, note="donor"))
    with calling_as(Caller(actor="judy", request_id="req-target")):
        target = start_tx(db_url, mgr, Payment(account="acct-target", note="target"))

    db.execute(
        f"UPDATE workflow_runs SET {column} = (SELECT {column} FROM workflow_runs WHERE id = %s)"
        " WHERE id = %s",
        (donor.id, target.id),
    )
    if column == "input_sealed":
        with pytest.raises(workflow.DecodeError):
            Pay.input(mgr, target.id)

    assert mgr.run(target.id).wait(WAIT) is workflow.Status.PARKED
    assert_parked_without_spending(target, db, caplog, recorder, donor_secret)

    # The donor itself is untouched and still runs.
    assert mgr.run(donor.id).wait(WAIT) is workflow.Status.SUCCEEDED
    assert recorder.calls_for(donor.id) == [Payment(account=donor_secret, note="donor")]


def test_a_sealed_document_with_no_cipher_configured_parks_without_spending(
    make_manager: Any, db_url: str, db: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    recorder = Recorder()
    sealer = make_manager(recorder.registry(), config([KEY_A]))
    secret = marker()
    run = start_tx(db_url, sealer, Payment(account=secret, note="sealed"))

    plain = make_manager(recorder.registry(), config(None))
    with pytest.raises(workflow.DecodeError):
        Pay.input(plain, run.id)
    assert plain.run(run.id).wait(WAIT) is workflow.Status.PARKED
    assert_parked_without_spending(run, db, caplog, recorder, secret)


def test_a_sealed_context_with_no_cipher_configured_parks_without_spending(
    make_manager: Any, db_url: str, db: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Input plain (written before sealing), context sealed: the context does not open."""
    recorder = Recorder()
    sealer = make_manager(recorder.registry(), config([KEY_A]))
    secret = marker()
    with calling_as(Caller(actor=secret, request_id="req-6")):
        run = start_tx(db_url, sealer, Payment(account="acct", note="n"))
    db.execute(
        "UPDATE workflow_runs SET input = '{\"account\": \"acct\", \"note\": \"n\"}'::jsonb, "
        "input_sealed = NULL WHERE id = %s",
        (run.id,),
    )

    plain = make_manager(recorder.registry(), config(None))
    assert plain.run(run.id).wait(WAIT) is workflow.Status.PARKED
    assert_parked_without_spending(run, db, caplog, recorder, secret)


@pytest.mark.parametrize("context", [True, False], ids=["with-context", "no-context"])
def test_a_plain_document_written_before_a_cipher_was_configured_still_opens(
    make_manager: Any, db_url: str, db: psycopg.Connection[Any], context: bool
) -> None:
    recorder = Recorder()
    before = make_manager(recorder.registry(), config(None, context=context))
    payment = Payment(account="acct-plain", note="before sealing")
    with calling_as(Caller(actor="kim", request_id="req-11")):
        run = start_tx(db_url, before, payment)
    plain_input, sealed_input, plain_context, sealed_context = stored(db, run.id)
    assert plain_input == {"account": "acct-plain", "note": "before sealing"}
    assert sealed_input is None and sealed_context is None
    assert (plain_context is not None) is context

    sealing = make_manager(recorder.registry(), config([KEY_A]))
    assert Pay.input(sealing, run.id) == payment
    assert sealing.run(run.id).wait(WAIT) is workflow.Status.SUCCEEDED
    assert recorder.calls_for(run.id) == [payment]
    expected = Caller(actor="kim", request_id="req-11") if context else None
    assert recorder.callers == [expected, expected]


@pytest.mark.parametrize("keys", [[KEY_B], [KEY_C, KEY_B]], ids=["other-key", "other-keys"])
def test_a_cipher_that_cannot_open_parks_without_spending(
    make_manager: Any,
    db_url: str,
    db: psycopg.Connection[Any],
    caplog: pytest.LogCaptureFixture,
    keys: list[bytes],
) -> None:
    recorder = Recorder()
    sealer = make_manager(recorder.registry(), config([KEY_A]))
    secret = marker()
    run = start_tx(db_url, sealer, Payment(account=secret, note="sealed with A"))

    stranger = make_manager(recorder.registry(), config(keys))
    with pytest.raises(workflow.DecodeError):
        Pay.input(stranger, run.id)
    assert stranger.run(run.id).wait(WAIT) is workflow.Status.PARKED
    assert_parked_without_spending(run, db, caplog, recorder, secret)


@pytest.mark.parametrize("column", ["input_sealed", "context_sealed"])
def test_a_tampered_sealed_column_parks_without_spending(
    make_manager: Any,
    db_url: str,
    db: psycopg.Connection[Any],
    caplog: pytest.LogCaptureFixture,
    column: str,
) -> None:
    recorder = Recorder()
    mgr = make_manager(recorder.registry(), config([KEY_A]))
    with calling_as(Caller(actor="leo", request_id="req-12")):
        run = start_tx(db_url, mgr, Payment(account="acct", note="tamper"))
    (value,) = db.execute(f"SELECT {column} FROM workflow_runs WHERE id = %s", (run.id,)).fetchone()
    tampered = bytearray(value)
    tampered[-1] ^= 0x01
    db.execute(f"UPDATE workflow_runs SET {column} = %s WHERE id = %s", (bytes(tampered), run.id))

    assert mgr.run(run.id).wait(WAIT) is workflow.Status.PARKED
    assert_parked_without_spending(run, db, caplog, recorder)


def test_a_sealed_run_resumes_in_a_worker_process_with_the_key(
    make_manager: Any, db_url: str, db: psycopg.Connection[Any]
) -> None:
    """The factory builds its cipher from its own environment (context_apps.app)."""
    tests = str(Path(__file__).resolve().parent)
    mgr = make_manager(context_apps.registry(), config([KEY_A]))
    secret = marker()
    with (
        calling_as(Caller(actor="mia", request_id=secret)),
        psycopg.connect(db_url) as conn,
        conn.transaction(),
    ):
        run = context_apps.Audit.start_tx(conn, mgr, context_apps.Order(item="sealed item"))
    assert_nowhere(secret, db)

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tests, env.get("PYTHONPATH", "")) if p)
    env["CONTEXT_APPS_KEYS"] = ",".join(k.hex() for k in (KEY_B, KEY_A))
    done = subprocess.run(
        [sys.executable, "-m", "context_apps.resume", db_url, run.id, "kick"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["status"] == "succeeded"
    outputs = db.execute(
        "SELECT output FROM workflow_tasks WHERE run_id = %s ORDER BY seq", (run.id,)
    ).fetchall()
    assert [(o["actor"], o["request_id"], o["item"]) for (o,) in outputs] == [
        ("mia", secret, "sealed item")
    ] * 2


# --- Sealed means sealed, in error texts too ----------------------------------------

import datetime  # noqa: E402
import enum  # noqa: E402
from contextvars import ContextVar  # noqa: E402


class Tier(enum.Enum):
    GOLD = "gold"


@attrs.frozen
class SignupV1:
    email: str
    tags: dict[str, str]
    card: str


@attrs.frozen
class SignupV2:
    """A later deploy's input type: every field changed so the stored input fails in it."""

    email: datetime.datetime
    tags: dict[str, int]
    card: Tier


@attrs.frozen
class WhoV1:
    actor: dict[str, str]


@attrs.frozen
class WhoV2:
    actor: dict[str, datetime.date]


WHO: ContextVar[Any] = ContextVar("test_sealing_who", default=None)


class WhoPropagator:
    def __init__(self, snapshot_type: type) -> None:
        self.snapshot_type = snapshot_type

    def capture(self) -> Any:
        return WHO.get()

    def restore(self, snapshot: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()


PII = ("alice@example.com", "bob@example.org", "4111111111111111", "carol@example.net")
SIGNUP = SignupV1(email=PII[0], tags={PII[1]: "vip"}, card=PII[2])


def signup_registry(input_type: type) -> tuple[workflow.Registry, Any]:
    wf = workflow.Workflow("sealed.Signup", input_type)
    reg = workflow.Registry()
    reg.register(workflow.define(wf, workflow.handle(workflow.Task("sealed.welcome"),
                                                     lambda run: None)))
    return reg, wf


def assert_no_pii(text: str, where: str) -> None:
    for value in PII:
        assert value not in text, f"{value!r} in {where}: {text}"


def all_log_text(records: list[logging.LogRecord]) -> str:
    formatter = logging.Formatter("%(levelname)s %(message)s")
    return "\n".join(formatter.format(record) for record in records)


@pytest.mark.parametrize("document", ["input", "context"])
def test_a_sealed_document_that_no_longer_decodes_leaves_no_value_in_any_error(
    make_manager: Any, db: psycopg.Connection[Any], logs: Any, document: str
) -> None:
    """The error says which type and field failed, never what the value was: not in the
    database, not in `Failure.error`, not in any log record, not in `input()`'s error."""
    logger, records = logs
    cipher = workflow.AESGCMCipher([KEY_A])
    old_reg, old_wf = signup_registry(SignupV1)
    new_input = SignupV2 if document == "input" else SignupV1
    new_reg, new_wf = signup_registry(new_input)
    old = make_manager(old_reg, workflow.Config(
        cipher=cipher, context=workflow.propagate(WhoPropagator(WhoV1))))
    new = make_manager(new_reg, workflow.Config(
        cipher=cipher, context=workflow.propagate(WhoPropagator(WhoV2))), logger=logger)
    token = WHO.set(WhoV1(actor={PII[3]: "not a date"}))
    try:
        with db.transaction():
            run = old_wf.start_tx(db, old, SIGNUP)
    finally:
        WHO.reset(token)

    assert new.run(run.id).wait(timeout=WAIT) is workflow.Status.PARKED
    failure = new.run(run.id).status().failure
    assert failure is not None and failure.attempts == 0
    assert_no_pii(failure.error, "Failure.error")
    assert ("SignupV2" if document == "input" else "WhoV2") in failure.error
    assert ("email" if document == "input" else "actor") in failure.error
    for row in dump(db):
        assert_no_pii(row, "the database")
    assert records.alerts(), "the park was not logged at ALERT"
    assert_no_pii(all_log_text(records.records), "the logs")
    if document == "input":
        with pytest.raises(workflow.DecodeError) as info:
            new_wf.input(new, run.id)
        import traceback

        shown = "".join(traceback.format_exception(info.value))
        assert_no_pii(shown, "input()'s error and its chain")
        assert "SignupV2" in str(info.value)


def test_a_plain_document_that_no_longer_decodes_still_says_what_was_wrong(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    """Unsealed, the full explanation stays: nothing was hidden at rest either."""
    old_reg, old_wf = signup_registry(SignupV1)
    new_reg, _ = signup_registry(SignupV2)
    old, new = make_manager(old_reg), make_manager(new_reg)
    with db.transaction():
        run = old_wf.start_tx(db, old, SIGNUP)
    assert new.run(run.id).wait(timeout=WAIT) is workflow.Status.PARKED
    failure = new.run(run.id).status().failure
    assert failure is not None and PII[1] in failure.error
