"""The codec (SPEC section 2): supported types round-trip exactly through JSON text.

Anything `decode_text` cannot read raises `DecodeError`, never another exception;
anything `encode` cannot write raises `EncodeError` naming the field.

Every test here runs twice: with orjson writing and parsing the text (when it is
installed) and with the standard library alone, as on a platform without orjson.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import enum
import json
import math
import uuid
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workflow import DecodeError, EncodeError, codec
from workflow.codec import decode, decode_text, encode, encode_document

try:
    import orjson
except ImportError:  # the standard library's path is tested all the same
    orjson = None  # type: ignore[assignment]


@pytest.fixture(scope="module", autouse=True, params=["orjson", "stdlib"])
def json_library(request: pytest.FixtureRequest) -> Iterator[str]:
    """Which library writes the text: orjson, or the standard library alone."""
    if request.param == "orjson" and orjson is None:
        pytest.skip("orjson is not installed")
    saved = codec._orjson
    codec._orjson = orjson if request.param == "orjson" else None
    try:
        yield request.param
    finally:
        codec._orjson = saved

# --- the types under test ------------------------------------------------------------


class Color(str, enum.Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Level(enum.Enum):
    LOW = 1
    MEDIUM = 2
    HIGH = 3


class Priority(enum.IntEnum):
    NORMAL = 0
    URGENT = 10


@attrs.frozen
class Reserved:
    id: str


@attrs.frozen
class Money:
    amount: Decimal
    currency: str


@dataclasses.dataclass(frozen=True)
class Point:
    x: int
    y: float
    label: str | None = None


@attrs.frozen
class Leaf:
    id: uuid.UUID
    at: datetime.datetime
    tags: list[str]
    money: Money


@attrs.frozen
class Record:
    count: int
    name: str
    ratio: float
    flag: bool
    amount: Decimal
    id: uuid.UUID
    at: datetime.datetime
    day: datetime.date
    color: Color
    level: Level
    priority: Priority
    numbers: list[int]
    scores: dict[str, float]
    pair: tuple[int, str]
    maybe_count: int | None
    maybe_leaf: Leaf | None
    leaf: Leaf
    leaves: list[Leaf]
    by_name: dict[str, Leaf]
    point: Point


@attrs.frozen
class Plain:
    """Everything but Decimal and UUID, so a failure there does not hide the rest."""

    count: int
    name: str
    ratio: float
    flag: bool
    at: datetime.datetime
    day: datetime.date
    color: Color
    level: Level
    numbers: list[int]
    scores: dict[str, float]
    pair: tuple[int, str]
    maybe_point: Point | None
    children: list[Reserved]
    by_name: dict[str, Reserved]


@attrs.frozen
class Loose:
    name: str
    extra: Any


@attrs.frozen
class Holder:
    loose: Loose
    items: list[Loose]


@attrs.frozen
class Ratio:
    value: float


@attrs.frozen
class HasRatio:
    ratio: Ratio


# --- helpers -------------------------------------------------------------------------


def roundtrip(value: Any, tp: Any) -> Any:
    """Encode, check the text is JSON, decode from str and bytes, and re-encode identically."""
    text = encode(value, tp)
    assert isinstance(text, str)
    json.loads(text)
    decoded = decode_text(text, tp)
    assert decode_text(text.encode("utf-8"), tp) == decoded
    assert decode(json.loads(text), tp) == decoded
    assert encode(decoded, tp) == text, "the decoded value encodes differently"
    return decoded


def assert_roundtrips(value: Any, tp: Any) -> None:
    decoded = roundtrip(value, tp)
    assert decoded == value
    assert type(decoded) is type(value)


UTC = datetime.timezone.utc
A_UUID = uuid.UUID("12345678-1234-5678-1234-567812345678")
A_TIME = datetime.datetime(2024, 2, 29, 23, 59, 58, 123456, tzinfo=UTC)


def a_leaf(**changes: Any) -> Leaf:
    leaf = Leaf(id=A_UUID, at=A_TIME, tags=["a", "b"], money=Money(Decimal("0.10"), "EUR"))
    return attrs.evolve(leaf, **changes)


def a_record(**changes: Any) -> Record:
    record = Record(
        count=3,
        name="zoë ✓",
        ratio=0.1,
        flag=True,
        amount=Decimal("1234.50"),
        id=A_UUID,
        at=A_TIME,
        day=datetime.date(2024, 2, 29),
        color=Color.GREEN,
        level=Level.HIGH,
        priority=Priority.URGENT,
        numbers=[1, -2, 3],
        scores={"a": 1.5, "b": -0.0},
        pair=(7, "seven"),
        maybe_count=None,
        maybe_leaf=a_leaf(),
        leaf=a_leaf(tags=[]),
        leaves=[a_leaf(), a_leaf(tags=["x"])],
        by_name={"first": a_leaf()},
        point=Point(1, 2.5),
    )
    return attrs.evolve(record, **changes)


# --- round trips of examples ---------------------------------------------------------


def a_plain(**changes: Any) -> Plain:
    plain = Plain(
        count=3,
        name="zoë ✓",
        ratio=0.1,
        flag=True,
        at=A_TIME,
        day=datetime.date(2024, 2, 29),
        color=Color.GREEN,
        level=Level.HIGH,
        numbers=[1, -2, 3],
        scores={"a": 1.5, "b": -0.0},
        pair=(7, "seven"),
        maybe_point=Point(1, 2.5, "p"),
        children=[Reserved("a"), Reserved("b")],
        by_name={"c": Reserved("c")},
    )
    return attrs.evolve(plain, **changes)


def test_attrs_class_round_trips() -> None:
    assert_roundtrips(Reserved(id="r-1"), Reserved)
    assert_roundtrips(a_plain(), Plain)
    assert_roundtrips(a_plain(maybe_point=None, children=[], by_name={}), Plain)


def test_record_with_every_supported_type_round_trips() -> None:
    assert_roundtrips(a_record(), Record)
    assert_roundtrips(a_record(maybe_count=0, maybe_leaf=None), Record)


def test_encoded_attrs_class_is_a_json_object() -> None:
    assert json.loads(encode(Reserved(id="r-1"), Reserved)) == {"id": "r-1"}


def test_dataclass_round_trips() -> None:
    assert_roundtrips(Point(1, 2.0), Point)
    assert_roundtrips(Point(-1, -0.5, "p"), Point)
    assert json.loads(encode(Point(1, 2.0, "p"), Point)) == {"x": 1, "y": 2.0, "label": "p"}


@pytest.mark.parametrize(
    ("value", "tp"),
    [
        ("", str),
        ('naïve \u2603 \U0001f600 "quoted" \\ \n', str),
        (0, int),
        (-(2**70), int),
        (2**63, int),
        (0.1, float),
        (-0.0, float),
        (1e308, float),
        (5e-324, float),
        (True, bool),
        (False, bool),
        (None, type(None)),
    ],
)
def test_builtins_round_trip(value: Any, tp: Any) -> None:
    assert_roundtrips(value, tp)


def test_negative_zero_keeps_its_sign() -> None:
    assert math.copysign(1.0, roundtrip(-0.0, float)) == -1.0


@pytest.mark.parametrize(
    ("value", "tp"),
    [
        ([1, 2, 3], list[int]),
        ([], list[int]),
        ([[1], [], [2, 3]], list[list[int]]),
        ({"a": 1, "": 2}, dict[str, int]),
        ({"r": Reserved("1"), "s": Reserved("2")}, dict[str, Reserved]),
        ({"p": Point(1, 1.0)}, dict[str, Point]),
        ((1, "a", 2.5), tuple[int, str, float]),
        ((1, 2, 3), tuple[int, ...]),
        ((), tuple[int, ...]),
        ([Reserved("1")], list[Reserved]),
        ({"k": [1, None]}, dict[str, list[int | None]]),
    ],
)
def test_typed_containers_round_trip(value: Any, tp: Any) -> None:
    assert_roundtrips(value, tp)


@pytest.mark.parametrize(
    ("value", "tp"),
    [
        (None, int | None),
        (5, int | None),
        (None, Reserved | None),
        (Reserved("x"), Reserved | None),
        (None, Decimal | None),
        (Decimal("1.00"), Decimal | None),
    ],
)
def test_optional_round_trips(value: Any, tp: Any) -> None:
    assert_roundtrips(value, tp)


@pytest.mark.parametrize(
    "value",
    [
        datetime.datetime(2024, 1, 2, 3, 4, 5, 678901, tzinfo=UTC),
        datetime.datetime(
            2024, 1, 2, 3, 4, 5, tzinfo=datetime.timezone(datetime.timedelta(hours=5, minutes=30))
        ),
        datetime.datetime(
            1, 1, 1, tzinfo=datetime.timezone(-datetime.timedelta(hours=23, minutes=59))
        ),
        datetime.datetime(2024, 1, 2, 3, 4, 5),
        datetime.datetime(9999, 12, 31, 23, 59, 59, 999999),
    ],
)
def test_datetime_round_trips(value: datetime.datetime) -> None:
    decoded = roundtrip(value, datetime.datetime)
    assert decoded == value
    assert decoded.utcoffset() == value.utcoffset()
    assert (decoded.tzinfo is None) == (value.tzinfo is None)


def test_naive_datetime_stays_naive() -> None:
    decoded = roundtrip(datetime.datetime(2024, 5, 6, 7, 8, 9), datetime.datetime)
    assert decoded.tzinfo is None


@pytest.mark.parametrize(
    "value", [datetime.date(2024, 2, 29), datetime.date(1, 1, 1), datetime.date(9999, 12, 31)]
)
def test_date_round_trips(value: datetime.date) -> None:
    assert_roundtrips(value, datetime.date)


@pytest.mark.parametrize("value", [A_UUID, uuid.UUID(int=0), uuid.uuid4()])
def test_uuid_round_trips(value: uuid.UUID) -> None:
    assert_roundtrips(value, uuid.UUID)


@pytest.mark.parametrize(
    "text", ["0.10", "0", "-0", "1234.50", "0.000001", "1E+3", "-99999999999999999999.99"]
)
def test_decimal_round_trips_exactly(text: str) -> None:
    decoded = roundtrip(Decimal(text), Decimal)
    assert isinstance(decoded, Decimal)
    assert str(decoded) == text


def test_decimal_in_a_record_keeps_its_digits() -> None:
    decoded = roundtrip(Money(Decimal("0.10"), "EUR"), Money)
    assert str(decoded.amount) == "0.10"
    assert "0.10" in encode(Money(Decimal("0.10"), "EUR"), Money)


@pytest.mark.parametrize("value", list(Color) + list(Level) + list(Priority))
def test_enums_round_trip(value: enum.Enum) -> None:
    decoded = roundtrip(value, type(value))
    assert decoded is value


def test_enums_are_stored_by_value() -> None:
    assert json.loads(encode(Color.RED, Color)) == "red"
    assert json.loads(encode(Level.HIGH, Level)) == 3
    assert json.loads(encode(Priority.URGENT, Priority)) == 10


def test_text_is_compact_and_keeps_non_ascii() -> None:
    assert encode({"k": "é"}, dict[str, str]) == '{"k":"é"}'


# --- property tests: any supported value round-trips ----------------------------------

PROPERTY = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])

offsets = st.integers(min_value=-(24 * 60 - 1), max_value=24 * 60 - 1).map(
    lambda m: datetime.timezone(datetime.timedelta(minutes=m))
)
naive_datetimes = st.datetimes()
aware_datetimes = st.datetimes(timezones=offsets)
datetimes = naive_datetimes | aware_datetimes
finite_floats = st.floats(allow_nan=False, allow_infinity=False)
decimals = st.decimals(allow_nan=False, allow_infinity=False)
# PostgreSQL's jsonb cannot hold NUL, and UTF-8 cannot carry a lone surrogate:
# such strings are refused by encode (tests/test_bad_input.py), not round-tripped.
storable = st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",))
texts = st.text(storable)
keys = st.text(storable, max_size=8)

moneys = st.builds(Money, amount=decimals, currency=texts)
points = st.builds(Point, x=st.integers(), y=finite_floats, label=st.none() | texts)
leaves = st.builds(
    Leaf, id=st.uuids(), at=datetimes, tags=st.lists(texts, max_size=4), money=moneys
)
plains = st.builds(
    Plain,
    count=st.integers(),
    name=texts,
    ratio=finite_floats,
    flag=st.booleans(),
    at=datetimes,
    day=st.dates(),
    color=st.sampled_from(Color),
    level=st.sampled_from(Level),
    numbers=st.lists(st.integers()),
    scores=st.dictionaries(keys, finite_floats, max_size=5),
    pair=st.tuples(st.integers(), texts),
    maybe_point=st.none() | points,
    children=st.lists(st.builds(Reserved, id=texts), max_size=3),
    by_name=st.dictionaries(keys, st.builds(Reserved, id=texts), max_size=3),
)
records = st.builds(
    Record,
    count=st.integers(),
    name=texts,
    ratio=finite_floats,
    flag=st.booleans(),
    amount=decimals,
    id=st.uuids(),
    at=datetimes,
    day=st.dates(),
    color=st.sampled_from(Color),
    level=st.sampled_from(Level),
    priority=st.sampled_from(Priority),
    numbers=st.lists(st.integers()),
    scores=st.dictionaries(keys, finite_floats, max_size=5),
    pair=st.tuples(st.integers(), texts),
    maybe_count=st.none() | st.integers(),
    maybe_leaf=st.none() | leaves,
    leaf=leaves,
    leaves=st.lists(leaves, max_size=3),
    by_name=st.dictionaries(keys, leaves, max_size=3),
    point=points,
)

SUPPORTED: list[tuple[str, Any, st.SearchStrategy[Any]]] = [
    ("int", int, st.integers()),
    ("str", str, texts),
    ("float", float, finite_floats),
    ("bool", bool, st.booleans()),
    ("Decimal", Decimal, decimals),
    ("UUID", uuid.UUID, st.uuids()),
    ("naive datetime", datetime.datetime, naive_datetimes),
    ("aware datetime", datetime.datetime, aware_datetimes),
    ("date", datetime.date, st.dates()),
    ("str enum", Color, st.sampled_from(Color)),
    ("int enum", Level, st.sampled_from(Level)),
    ("IntEnum", Priority, st.sampled_from(Priority)),
    ("list[int]", list[int], st.lists(st.integers())),
    ("dict[str, float]", dict[str, float], st.dictionaries(keys, finite_floats)),
    ("tuple[int, str]", tuple[int, str], st.tuples(st.integers(), texts)),
    ("int | None", int | None, st.none() | st.integers()),
    ("Money | None", Money | None, st.none() | moneys),
    ("dataclass", Point, points),
    ("attrs", Plain, plains),
    ("attrs with Decimal", Money, moneys),
    ("nested attrs", Leaf, leaves),
    ("dict[str, nested attrs]", dict[str, Leaf], st.dictionaries(keys, leaves, max_size=3)),
]


@pytest.mark.parametrize(
    ("tp", "strategy"), [(tp, s) for _, tp, s in SUPPORTED], ids=[n for n, _, _ in SUPPORTED]
)
@PROPERTY
@given(data=st.data())
def test_any_value_of_a_supported_type_round_trips(
    tp: Any, strategy: st.SearchStrategy[Any], data: st.DataObject
) -> None:
    value = data.draw(strategy)
    assert roundtrip(value, tp) == value


@PROPERTY
@given(records)
def test_any_record_round_trips(value: Record) -> None:
    decoded = roundtrip(value, Record)
    assert decoded == value
    assert str(decoded.amount) == str(value.amount)
    assert decoded.at.utcoffset() == value.at.utcoffset()


# --- property tests: undecodable input raises DecodeError and nothing else -------------

TARGETS: list[Any] = [
    int,
    str,
    float,
    bool,
    Decimal,
    uuid.UUID,
    datetime.datetime,
    datetime.date,
    Color,
    Level,
    list[int],
    dict[str, int],
    tuple[int, str],
    Money | None,
    Point,
    Leaf,
    Plain,
    Record,
]
TARGET_IDS = [t.__name__ if isinstance(t, type) else str(t) for t in TARGETS]


def decodes_or_raises_decode_error(document: str | bytes, tp: Any) -> None:
    """Decoding either succeeds or raises DecodeError; any other exception fails the test."""
    try:
        json.loads(document)
    except ValueError:
        with pytest.raises(DecodeError):
            decode_text(document, tp)
        return
    with contextlib.suppress(DecodeError):
        decode_text(document, tp)


@pytest.mark.parametrize("tp", TARGETS, ids=TARGET_IDS)
@PROPERTY
@given(data=st.binary())
def test_arbitrary_bytes_raise_decode_error_only(tp: Any, data: bytes) -> None:
    decodes_or_raises_decode_error(data, tp)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | finite_floats | texts,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(keys, children, max_size=4),
    max_leaves=12,
)


@pytest.mark.parametrize("tp", TARGETS, ids=TARGET_IDS)
@PROPERTY
@given(document=json_values)
def test_arbitrary_json_raises_decode_error_only(tp: Any, document: Any) -> None:
    decodes_or_raises_decode_error(json.dumps(document), tp)


@PROPERTY
@given(text=st.text())
def test_arbitrary_text_raises_decode_error_only(text: str) -> None:
    for tp in TARGETS:
        decodes_or_raises_decode_error(text, tp)


RECORD_TYPES = pytest.mark.parametrize(
    ("tp", "strategy"), [(Plain, plains), (Record, records)], ids=["Plain", "Record"]
)


@RECORD_TYPES
@PROPERTY
@given(data=st.data())
def test_corrupted_record_raises_decode_error_only(
    tp: Any, strategy: st.SearchStrategy[Any], data: st.DataObject
) -> None:
    document = json.loads(encode(data.draw(strategy), tp))
    field = data.draw(st.sampled_from(sorted(document)))
    if data.draw(st.booleans()):
        del document[field]
        with pytest.raises(DecodeError):
            decode(document, tp)
    else:
        document[field] = data.draw(json_values)
        decodes_or_raises_decode_error(json.dumps(document), tp)


@RECORD_TYPES
@PROPERTY
@given(data=st.data())
def test_truncated_text_raises_decode_error(
    tp: Any, strategy: st.SearchStrategy[Any], data: st.DataObject
) -> None:
    text = encode(data.draw(strategy), tp)
    cut = data.draw(st.integers(min_value=0, max_value=len(text) - 1))
    with pytest.raises(DecodeError):
        decode_text(text[:cut], tp)


def test_decode_errors_name_the_type() -> None:
    with pytest.raises(DecodeError, match="Money"):
        decode_text('{"amount": "1"}', Money)
    with pytest.raises(DecodeError, match="Money"):
        decode_text(b"\xff\xfe\xfd", Money)


@pytest.mark.parametrize(
    ("document", "tp"),
    [
        ('"not a uuid"', uuid.UUID),
        ('"1.2.3"', Decimal),
        ('"purple"', Color),
        ("7", Level),
        ('"2024-13-01"', datetime.date),
        ('"yesterday"', datetime.datetime),
        ('{"x": "one", "y": 1.0}', Point),
        ('{"id": "x"}', Leaf),
        ("[1, 2]", dict[str, int]),
        ('["a"]', list[int]),
        ("", int),
        ("{", Money),
    ],
)
def test_bad_documents_raise_decode_error(document: str, tp: Any) -> None:
    with pytest.raises(DecodeError):
        decode_text(document, tp)


# --- encode failures -----------------------------------------------------------------


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_float_is_refused(value: float) -> None:
    with pytest.raises(EncodeError):
        encode(value, float)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_float_field_is_named(value: float) -> None:
    with pytest.raises(EncodeError) as info:
        encode(a_plain(ratio=value), Plain)
    assert "ratio" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_non_finite_float_in_a_nested_field_is_named() -> None:
    with pytest.raises(EncodeError) as info:
        encode(HasRatio(Ratio(math.nan)), HasRatio)
    assert "ratio.value" in str(info.value)


@pytest.mark.parametrize(
    ("value", "tp"),
    [
        (Point(1, 2.0), Reserved),
        (Reserved("x"), Money),
        ({"id": "x"}, Reserved),
        ("x", Reserved),
        (None, Reserved),
        (Reserved("x"), Point),
    ],
)
def test_object_of_the_wrong_class_is_refused(value: Any, tp: Any) -> None:
    with pytest.raises(EncodeError) as info:
        encode(value, tp)
    assert tp.__name__ in str(info.value)


@pytest.mark.parametrize(
    ("value", "tp"),
    [
        ("abc", int),
        (None, int),
        (Color.RED, Level),
        ("purple", Color),
        ([1, "x"], list[int]),
    ],
)
def test_value_that_would_not_decode_back_is_refused(value: Any, tp: Any) -> None:
    with pytest.raises(EncodeError):
        encode(value, tp)


def test_field_of_the_wrong_type_is_refused() -> None:
    with pytest.raises(EncodeError) as info:
        encode(a_plain(count="three"), Plain)
    assert "count" in str(info.value)


def test_non_serialisable_field_is_named() -> None:
    with pytest.raises(EncodeError) as info:
        encode(Loose(name="a", extra=object()), Loose)
    message = str(info.value)
    assert "extra" in message
    assert "Loose" in message


def test_non_serialisable_nested_field_path_is_named() -> None:
    value = Holder(loose=Loose("a", 1), items=[Loose("b", 2), Loose("c", object())])
    with pytest.raises(EncodeError) as info:
        encode(value, Holder)
    assert "items[1].extra" in str(info.value)


def test_encode_error_keeps_the_cause() -> None:
    with pytest.raises(EncodeError) as info:
        encode(Loose(name="a", extra=object()), Loose)
    assert info.value.__cause__ is not None


@attrs.frozen
class Branch:
    """A record that holds itself: the shape check of a tree must not build for ever."""

    name: str
    children: list[Branch] = attrs.field(factory=list)
    tags: dict[str, tuple[int, str]] = attrs.field(factory=dict)


def test_a_record_that_holds_itself_round_trips_and_a_deep_misshape_is_named() -> None:
    tree = Branch("a", [Branch("b", [Branch("c", tags={"t": (1, "x")})])])
    assert decode_text(encode(tree, Branch), Branch) == tree
    bad = '{"name": "a", "children": [{"name": "b", "children": [{"name": "c", "children": "x"}]}]}'
    with pytest.raises(DecodeError, match=r"\$\.children\[0\]\.children\[0\]\.children: "
                                          r"expected an array, not str"):
        decode_text(bad, Branch)
    short = '{"name": "a", "tags": {"t": [1]}}'
    with pytest.raises(DecodeError, match=r"\$\.tags\['t'\]: expected 2 items, not 1"):
        decode_text(short, Branch)


# --- orjson and the standard library agree ------------------------------------------

# Values orjson writes otherwise than the standard library, or refuses where the
# standard library does not: NaN and infinities (null in orjson), integers past 64
# bits, keys that are not strings (two of which may encode alike), tuples, lone
# surrogates, NUL, datetimes and records in an `Any`, nesting past orjson's depth.
any_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=2**63 - 2, max_value=2**64 + 2)
    | st.floats()
    | st.text()
    | st.datetimes()
    | st.builds(Reserved, id=st.text(max_size=3))
)
any_documents = st.recursive(
    any_scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=4) | st.integers(-3, 3) | st.booleans(), inner, max_size=4),
    max_leaves=12,
)


def _outcome(value: Any, tp: Any) -> Any:
    """What encoding `value` gives: the document its text holds, or the error.

    The two libraries may spell a number differently (`1e-7` against `1e-07`): the
    text stored as jsonb, or sealed and parsed again, reads the same either way."""
    try:
        text, document, decoded = encode_document(value, tp)
    except EncodeError as e:
        return f"EncodeError: {e}"
    assert json.loads(text) == document
    assert decoded == document
    return document


def _alone_and_quick(value: Any) -> tuple[Any, Any]:
    """`_outcome` of `value` as `Any` with the standard library alone, then with orjson."""
    saved = codec._orjson
    try:
        codec._orjson = None
        alone = _outcome(value, Any)
        codec._orjson = orjson
        return alone, _outcome(value, Any)
    finally:
        codec._orjson = saved


@PROPERTY
@given(value=any_documents)
def test_orjson_and_the_standard_library_write_and_refuse_alike(value: Any) -> None:
    if orjson is None:
        pytest.skip("orjson is not installed")
    alone, quick = _alone_and_quick(value)
    assert quick == alone


@pytest.mark.parametrize(
    "value",
    [
        {"a": math.nan},
        [math.inf],
        {1: "a", "1": "b"},
        {"n": 2**64},
        ("a", 1),
        {"s": "lone \ud800"},
        {"s": "nul \x00"},
        {"at": datetime.datetime(2026, 1, 1)},
        [Reserved("x")],
        [1],
    ],
    ids=["nan", "infinity", "keys-alike", "big-int", "tuple", "surrogate", "nul", "datetime",
         "record", "plain"],
)
def test_values_orjson_would_write_otherwise_get_the_standard_librarys_answer(value: Any) -> None:
    if orjson is None:
        pytest.skip("orjson is not installed")
    deep = value  # and the same nested past orjson's limit of 255 levels
    for _ in range(300):
        deep = [deep]
    for v in (value, deep):
        alone, quick = _alone_and_quick(v)
        assert quick == alone
