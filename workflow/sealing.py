"""Calling context carried across processes, and documents sealed at rest.

A `Propagator` captures what a handler should see of its caller (an actor, a
request id) when a run starts, and restores it around each handler call, in
whatever process runs it. A `Cipher` seals the input and that snapshot in the
database. The engine binds every sealed document to its run: the run id is
sealed with the document and checked on opening, so a document copied onto
another run does not open.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Generic, Protocol, TypeVar, cast, runtime_checkable

from workflow import codec
from workflow.errors import DecodeError

T = TypeVar("T")


@runtime_checkable
class Cipher(Protocol):
    """Seals bytes at rest. `open` raises for anything it did not seal."""

    def seal(self, plaintext: bytes, /) -> bytes:
        """Encrypt and authenticate `plaintext`."""
        ...

    def open(self, sealed: bytes, /) -> bytes:
        """Return the plaintext of a `seal`ed document; raise when it does not open."""
        ...


class Propagator(Protocol[T]):
    """Captures the calling context at start and restores it around each handler call.

    `snapshot_type` is the type of what `capture()` returns; it is stored as JSON
    with the run (use a cipher: it usually carries personal data). `restore`
    returns a context manager, typically setting `contextvars`.
    """

    @property
    def snapshot_type(self) -> type[T]:
        """The type of the snapshot, for the codec."""
        ...

    def capture(self) -> T:
        """The calling context now, as a snapshot."""
        ...

    def restore(self, snapshot: T) -> AbstractContextManager[Any]:
        """A context manager that makes `snapshot` the current context inside it."""
        ...


class Propagation(Generic[T]):
    """A propagator wrapped by `propagate()`, as `Config.context` takes it."""

    def __init__(self, propagator: Propagator[T]) -> None:
        self.propagator = propagator
        self.snapshot_type = propagator.snapshot_type

    def capture_document(self) -> str:
        """The current context as JSON text (`EncodeError` when it cannot be encoded)."""
        return codec.encode(self.propagator.capture(), self.snapshot_type)

    def decode_snapshot(self, document: Any, *, redact: bool = False) -> T:
        """A stored snapshot, decoded (`DecodeError` when it no longer decodes).

        `redact`: the snapshot was sealed, so the error names no value.
        """
        snapshot: T = codec.decode(document, self.snapshot_type, redact=redact)
        return snapshot


def propagate(propagator: Propagator[T]) -> Propagation[T]:
    """Wrap a propagator for `Config(context=...)`."""
    for name in ("capture", "restore"):
        if not callable(getattr(propagator, name, None)):
            raise TypeError(f"propagate() needs an object with {name}(); got {propagator!r}")
    if not hasattr(propagator, "snapshot_type"):
        raise TypeError(f"propagate() needs an object with snapshot_type; got {propagator!r}")
    return Propagation(propagator)


def seal_document(
    text: str, run_id: uuid.UUID, cipher: Cipher | None
) -> tuple[str | None, bytes | None]:
    """(plain, sealed) columns for a JSON document: plain without a cipher, sealed with one."""
    if cipher is None:
        return text, None
    return None, cipher.seal(run_id.bytes + text.encode("utf-8"))


def open_document(
    plain: Any, sealed: bytes | None, run_id: uuid.UUID, cipher: Cipher | None, what: str
) -> Any:
    """The parsed JSON of a stored document, opening it when sealed.

    Raises `DecodeError` for a sealed document with no cipher configured, one the
    cipher cannot open, one sealed for another run, or bytes that are not JSON.
    """
    if sealed is None:
        return plain
    if cipher is None:
        raise DecodeError(f"the {what} is sealed and this manager has no cipher configured")
    try:
        raw = cipher.open(bytes(sealed))
    except Exception as e:
        raise DecodeError(f"the {what} does not open with the configured cipher: {e}") from e
    if raw[:16] != run_id.bytes:
        raise DecodeError(f"the {what} was sealed for another run")
    try:
        return json.loads(raw[16:])
    except Exception as e:
        raise DecodeError(f"the {what} is not JSON once opened: {e}") from e


class AESGCMCipher:
    """AES-256-GCM sealing with key rotation (extra `crypto`, the `cryptography` package).

    `keys` is a non-empty sequence of 32-byte keys: the first seals, any opens.
    Each envelope carries a random 96-bit nonce and a 4-byte key id (a SHA-256
    prefix of the key), so keys can be reordered. Raises `ValueError` for a key
    of another length and `ImportError` without the `crypto` extra.
    """

    _VERSION = b"\x01"

    def __init__(self, keys: Sequence[bytes]) -> None:
        try:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        except ImportError as e:  # pragma: no cover - depends on the extra
            raise ImportError(
                "AESGCMCipher needs the cryptography package: pip install 'pgworkflow[crypto]'"
            ) from e
        if isinstance(cast(object, keys), (bytes, bytearray, str)):
            raise ValueError("AESGCMCipher needs a non-empty sequence of 32-byte keys")
        keys = list(keys)
        if not keys:
            raise ValueError("AESGCMCipher needs a non-empty sequence of 32-byte keys")
        self._keys: dict[bytes, Any] = {}
        self._first = b""
        for key in keys:
            if not isinstance(key, (bytes, bytearray)) or len(key) != 32:
                size = len(key) if isinstance(key, (bytes, bytearray)) else type(key).__name__
                raise ValueError(f"AESGCMCipher keys must be 32 bytes (AES-256), got {size}")
            key_id = hashlib.sha256(bytes(key)).digest()[:4]
            self._keys.setdefault(key_id, AESGCM(bytes(key)))
            self._first = self._first or key_id

    def seal(self, plaintext: bytes, /) -> bytes:
        """Encrypt with the first key: version, key id, nonce, ciphertext and tag."""
        nonce = os.urandom(12)
        sealed: bytes = self._keys[self._first].encrypt(nonce, plaintext, self._first)
        return self._VERSION + self._first + nonce + sealed

    def open(self, sealed: bytes, /) -> bytes:
        """Decrypt with the key named in the envelope; `ValueError` when it does not open."""
        if len(sealed) < 1 + 4 + 12 + 16 or sealed[:1] != self._VERSION:
            raise ValueError("not an AESGCMCipher envelope")
        key_id, nonce, body = sealed[1:5], sealed[5:17], sealed[17:]
        aead = self._keys.get(key_id)
        if aead is None:
            raise ValueError(f"sealed with a key not configured here (key id {key_id.hex()})")
        try:
            opened: bytes = aead.decrypt(nonce, body, key_id)
        except Exception as e:
            raise ValueError("the envelope failed authentication") from e
        return opened
