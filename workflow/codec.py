"""One cattrs converter for inputs, outputs and context snapshots, to and from JSON.

Supported: attrs classes, dataclasses, str/int/float/bool/None, lists, tuples,
dicts, typed containers of these, `Optional`/unions cattrs can tell apart,
`datetime`/`date`, `UUID`, `Decimal` (kept exact, as a string) and enums.

The text is orjson's when orjson is installed and agrees with the standard library
(`_quick`), the standard library's otherwise.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import decimal
import functools
import json
import math
import types
import typing
import uuid
from typing import Any

import attrs
import cattrs
import cattrs.preconf.json

from workflow.errors import DecodeError, EncodeError

_orjson: types.ModuleType | None
try:
    import orjson as _orjson
except ImportError:  # a platform without its wheel: the standard library does it all
    _orjson = None

_converter = cattrs.preconf.json.make_converter()


def _unstructure_decimal(value: decimal.Decimal) -> str:
    if not value.is_finite():
        raise ValueError(f"Decimal {value} is not finite")
    return str(value)


def _structure_decimal(value: Any, _: Any) -> decimal.Decimal:
    # A string keeps the exact digits ("0.10" stays "0.10"); a float never would.
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise TypeError(f"a Decimal is stored as a string, not {type(value).__name__}")
    result = decimal.Decimal(value)
    if not result.is_finite():
        raise ValueError(f"Decimal {value!r} is not finite")
    return result


def _structure_uuid(value: Any, _: Any) -> uuid.UUID:
    if not isinstance(value, str):
        raise TypeError(f"a UUID is stored as a string, not {type(value).__name__}")
    return uuid.UUID(value)


_converter.register_unstructure_hook(decimal.Decimal, _unstructure_decimal)
_converter.register_structure_hook(decimal.Decimal, _structure_decimal)
_converter.register_unstructure_hook(uuid.UUID, str)
_converter.register_structure_hook(uuid.UUID, _structure_uuid)


def _structure_none(value: Any, _: Any) -> None:
    if value is not None:
        raise TypeError(f"expected null, not {type(value).__name__}")


_converter.register_structure_hook(type(None), _structure_none)


def _json_type(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _exact(tp: type, what: str, *, numbers: bool = False) -> Any:
    """A structure hook for the JSON scalar `tp` that never coerces.

    cattrs' own hook is `tp(value)`: str(None) == "None", int(1.5) == 1,
    bool("x") is True. Subclasses (IntEnum, str-valued enums) keep `cl(value)`.
    """

    def structure(value: Any, cl: Any) -> Any:
        if cl is not tp:
            return cl(value)
        ok = (isinstance(value, (int, float)) if numbers else isinstance(value, tp)) and (
            tp is bool or not isinstance(value, bool)
        )
        if not ok:
            raise TypeError(f"expected {what}, not {_json_type(value)}")
        return float(value) if numbers else value

    return structure


_converter.register_structure_hook(str, _exact(str, "a string"))
_converter.register_structure_hook(int, _exact(int, "an integer"))
_converter.register_structure_hook(float, _exact(float, "a number", numbers=True))
_converter.register_structure_hook(bool, _exact(bool, "true or false"))


def _unstorable(document: Any, path: str) -> str | None:
    """Where `document` holds a string PostgreSQL's jsonb refuses (NUL), or None."""
    if isinstance(document, str):
        return f"{path} (a string with a NUL character)" if "\x00" in document else None
    if isinstance(document, dict):
        for key, item in document.items():
            found = _unstorable(key, f"{path} key {key!r}") or _unstorable(
                item, f"{path}[{key!r}]"
            )
            if found:
                return found
    if isinstance(document, list):
        for i, item in enumerate(document):
            found = _unstorable(item, f"{path}[{i}]")
            if found:
                return found
    return None

_dumps = json.JSONEncoder(
    ensure_ascii=False, allow_nan=False, separators=(",", ":")
).encode


class _DuplicateKey(ValueError):
    """Two members of one encoded object have the same key."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's members, refusing two with one key: JSON makes a dict's keys text,
    so `{1: "a", "1": "b"}` would otherwise keep only one of its values."""
    members = dict(pairs)
    if len(members) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(f"two keys of one object both encode as {key!r}")
            seen.add(key)
    return members


_parse_encoded = json.JSONDecoder(object_pairs_hook=_unique_keys).decode


def _quick(plain: Any) -> tuple[str, Any] | None:
    """orjson's text for the unstructured `plain` and that text parsed, when both are what
    the standard library would give; None when orjson cannot say (then `_dumps` and
    `_parse_encoded` decide, and raise what they raise).

    orjson writes the same compact text (a number may be spelt otherwise, `1e-7` for
    `1e-07`, the same value), but it refuses some values the standard
    library takes (integers past 64 bits, keys that are not strings) and takes some it
    refuses or would write otherwise (NaN and infinities as null, datetimes, dataclass
    instances); those come back as None here, or parse to a document that differs
    from `plain`. With string keys only, no two members of an object can clash."""
    if _orjson is None:
        return None
    try:
        raw = _orjson.dumps(plain)
        document = _orjson.loads(raw)
    except (TypeError, ValueError):  # orjson's encode and decode errors are both
        return None
    if document != plain:
        return None
    return raw.decode(), document


def encode(value: Any, tp: Any) -> str:
    """JSON text for `value` as type `tp`.

    Raises `EncodeError` naming the field that could not be encoded, when the
    value is not an instance of a declared class, or when it would not decode
    back into `tp` (so nothing is stored that a handler could not read).
    """
    return encode_document(value, tp)[0]


def encode_document(value: Any, tp: Any) -> tuple[str, Any, Any]:
    """`encode`, also returning the parsed document and the value decoded from it.

    Decoding the text back is the check that it reads as `tp`; the decoded value
    shares nothing with `value`, so later changes to `value` cannot leak into it.
    """
    if isinstance(tp, type) and _is_record(tp) and not isinstance(value, tp):
        raise EncodeError(
            f"cannot encode {type(value).__name__} as {_name(tp)}: expected an instance of "
            f"{_name(tp)}"
        )
    try:
        plain = _converter.unstructure(value, unstructure_as=tp)
        quick = _quick(plain)
        if quick is None:
            text = _dumps(plain)
            text.encode("utf-8")  # an unpaired surrogate cannot be sent to PostgreSQL
            document = _parse_encoded(text)
        else:
            text, document = quick
    except RecursionError:
        raise EncodeError(f"cannot encode {_name(tp)}: the value is nested too deep") from None
    except _DuplicateKey as e:
        raise EncodeError(f"cannot encode {_name(tp)}: {e}") from None
    except Exception as e:
        try:
            where = _find_unencodable(value, _name(tp))
        except RecursionError:
            where = "a value nested too deep to say which"
        raise EncodeError(f"cannot encode {_name(tp)}: {where}: {e}") from e
    if "\\u0000" in text:
        unstorable = _unstorable(document, _name(tp))
        if unstorable is not None:
            raise EncodeError(f"cannot encode {_name(tp)}: PostgreSQL cannot store {unstorable}")
    try:
        decoded = _converter.structure(document, tp)
    except RecursionError:
        raise EncodeError(f"cannot encode {_name(tp)}: the value is nested too deep") from None
    except Exception as e:
        raise EncodeError(
            f"cannot encode {_name(tp)}: the value would not decode back: {_explain(e)}"
        ) from e
    return text, document, decoded


_ARRAYS = (
    list,
    tuple,
    set,
    frozenset,
    collections.abc.Sequence,
    collections.abc.MutableSequence,
    collections.abc.Set,
    collections.abc.MutableSet,
)
_OBJECTS = (dict, collections.abc.Mapping, collections.abc.MutableMapping)


@functools.lru_cache(maxsize=1024)
def _hints(tp: type) -> dict[str, Any]:
    return typing.get_type_hints(tp)


class _ShapeError(TypeError):
    """A JSON value of the wrong kind for its type (its message names kinds, not values)."""


def _check_shape(document: Any, tp: Any, path: str, keys: bool = True) -> None:
    """Refuse a JSON value whose container kind does not fit `tp`.

    cattrs iterates whatever it is given: a string or an object's keys would become
    a list. `keys=False` leaves a map's keys out of the paths in its messages
    (they are data, which a sealed document must not leak).
    """
    check = _shape_check(tp)
    if check is not None:
        check(document, path, keys)


_ShapeCheck = typing.Callable[[Any, str, bool], None]
_SHAPE_CHECKS: dict[Any, _ShapeCheck | None] = {}
_SHAPE_CHECKS_KEPT = 1024


def _shape_check(tp: Any) -> _ShapeCheck | None:
    """The check of a document against `tp`, None when there is nothing to check (a
    scalar, a union): built once per type, since reading a type's form and hints cost
    more than the check itself on every input and output."""
    try:
        return _SHAPE_CHECKS[tp]
    except KeyError:
        if len(_SHAPE_CHECKS) >= _SHAPE_CHECKS_KEPT:  # types made at run time: start over
            _SHAPE_CHECKS.clear()
        check = _SHAPE_CHECKS[tp] = _build_shape_check(tp)
        return check
    except TypeError:  # a type form that cannot be hashed: built each time
        return _build_shape_check(tp)


def _build_shape_check(tp: Any) -> _ShapeCheck | None:
    # The checks of the parts are looked up when a document is checked, not here: a
    # record may hold itself (a tree), and its check must not build for ever.
    origin = typing.get_origin(tp) or tp
    args = typing.get_args(tp)
    if origin in _ARRAYS:
        if origin is tuple and args and args[-1] is not Ellipsis:
            return functools.partial(_check_fixed_array, args)
        return functools.partial(_check_array, args[0] if args else None)
    if origin in _OBJECTS:
        return functools.partial(_check_object, args[1] if len(args) == 2 else None)
    if isinstance(tp, type) and _is_record(tp):
        return functools.partial(_check_record, tp)
    return None


def _require(document: Any, kind: type, what: str, path: str) -> None:
    if not isinstance(document, kind):
        raise _ShapeError(f"{path}: expected {what}, not {_json_type(document)}")


def _check_fixed_array(args: tuple[Any, ...], document: Any, path: str, keys: bool) -> None:
    _require(document, list, "an array", path)
    if len(document) != len(args):
        raise _ShapeError(f"{path}: expected {len(args)} items, not {len(document)}")
    for i, (item, arg) in enumerate(zip(document, args, strict=True)):
        _check_shape(item, arg, f"{path}[{i}]", keys)


def _check_array(item_tp: Any, document: Any, path: str, keys: bool) -> None:
    _require(document, list, "an array", path)
    check = None if item_tp is None else _shape_check(item_tp)
    if check is not None:
        for i, item in enumerate(document):
            check(item, f"{path}[{i}]", keys)


def _check_object(value_tp: Any, document: Any, path: str, keys: bool) -> None:
    _require(document, dict, "an object", path)
    check = None if value_tp is None else _shape_check(value_tp)
    if check is not None:
        for key, item in document.items():
            check(item, f"{path}[{key!r}]" if keys else f"{path}[...]", keys)


def _check_record(tp: type, document: Any, path: str, keys: bool) -> None:
    _require(document, dict, "an object", path)
    hints = _hints(tp)
    for key, item in document.items():
        hint = hints.get(key)  # get_type_hints gives NoneType, never None, for `None`
        check = None if hint is None else _shape_check(hint)
        if check is not None:
            check(item, f"{path}.{key}", keys)


def decode(document: Any, tp: Any, *, redact: bool = False) -> Any:
    """Build a `tp` from an already parsed JSON document; `DecodeError` on any mismatch.

    `redact=True` (for a document that was sealed) says only where and against
    which type decoding failed, never a value: no map key in a path, no message
    of the failing conversion (which may quote its input), and no exception chain.
    """
    try:
        _check_shape(document, tp, "$", keys=not redact)
        return _converter.structure(document, tp)
    except Exception as e:
        if redact:
            raise DecodeError(f"cannot decode {_name(tp)}: {_redacted(e)}") from None
        raise DecodeError(f"cannot decode {_name(tp)}: {_explain(e)}") from e


def decode_text(text: str | bytes, tp: Any) -> Any:
    """Parse JSON text (or UTF-8 bytes) and build a `tp`; `DecodeError` on anything bad."""
    try:
        document = json.loads(text)
    except Exception as e:
        raise DecodeError(f"cannot decode {_name(tp)}: not JSON: {e}") from e
    return decode(document, tp)


def _is_record(tp: type) -> bool:
    return attrs.has(tp) or dataclasses.is_dataclass(tp)


def _name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__qualname__
    return repr(tp)


def _explain(e: Exception) -> str:
    if isinstance(e, (cattrs.BaseValidationError)):
        return "; ".join(cattrs.transform_error(e))
    return f"{type(e).__name__}: {e}"


def _redacted(e: BaseException) -> str:
    """Where and against which type each leaf of a decoding error failed, with no value."""
    return "; ".join(_redacted_leaves(e, "$", None))


def _redacted_leaves(e: BaseException, path: str, expected: Any) -> list[str]:
    if isinstance(e, (cattrs.ClassValidationError, cattrs.IterableValidationError)):
        leaves: list[str] = []
        with_notes, without = e.group_exceptions()
        for inner, note in with_notes:
            if isinstance(note, cattrs.AttributeValidationNote):
                where = f"{path}.{note.name}"
            else:
                where = f"{path}[...]"  # a list index or a map key: a key is data
            leaves += _redacted_leaves(inner, where, note.type)
        for inner in without:
            leaves += _redacted_leaves(inner, path, expected)
        return leaves
    if isinstance(e, cattrs.BaseValidationError):
        return [leaf for inner in e.exceptions for leaf in _redacted_leaves(inner, path, expected)]
    if isinstance(e, _ShapeError):
        return [str(e)]  # a path (keys left out) and JSON kinds: no value
    wanted = "" if expected is None else f"expected {_name(expected)}, "
    return [f"{path}: {wanted}failed with {type(e).__name__}"]


def _find_unencodable(value: Any, path: str) -> str:
    """The path of the first leaf inside `value` that JSON cannot carry."""
    children: list[tuple[str, Any]] = []
    if attrs.has(type(value)):
        children = [(f"{path}.{a.name}", getattr(value, a.name)) for a in attrs.fields(type(value))]
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        children = [(f"{path}.{f.name}", getattr(value, f.name)) for f in dataclasses.fields(value)]
    elif isinstance(value, dict):
        children = [(f"{path}[{k!r}]", v) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        children = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    for child_path, child in children:
        try:
            _dumps(_converter.unstructure(child))
        except Exception:
            return _find_unencodable(child, child_path)
    if isinstance(value, float) and not math.isfinite(value):
        return f"field {path} (a non-finite float)"
    return f"field {path} ({type(value).__name__})"
