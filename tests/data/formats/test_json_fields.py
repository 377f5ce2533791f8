"""Typed reads of a JSON object: each wrong type is the format's own error, naming origin and field."""

import math

import pytest

from ds_trhash.data.formats.json_fields import JsonFields, kind
from ds_trhash.errors import UserError


class Oops(UserError, ValueError):
    pass


class Fields(JsonFields):
    error, fix = Oops, "fix it"


def test_each_reader_accepts_its_type_and_names_the_field_otherwise():
    r = Fields({"n": 3, "b": True, "s": "x", "l": [], "t": {}, "f": math.nan, "h": "0" * 64, "z": None}, "f.json",
               "outer")
    assert (r.integer("n"), r.text("s"), r.array("l"), r.table("t"), r.sha256("h")) == (3, "x", [], {}, "0" * 64)
    assert r.integer("missing", required=False) is None and r.integer("z", required=False) is None
    for call, needle in [(lambda: r.integer("b"), "outer.b' is True (a boolean)"),
                         (lambda: r.integer("n", minimum=4), "must be >= 4"),
                         (lambda: r.number("f"), "finite number"),
                         (lambda: r.text("n"), "non-empty string"),
                         (lambda: r.array("t"), "is an object; it must be a list"),
                         (lambda: r.choice("s", ("a",)), "allowed: 'a'"),
                         (lambda: r.name("l"), "must be a string"),
                         (lambda: r.integer("absent"), "outer.absent' is missing")]:
        with pytest.raises(Oops, match="^f.json field 'outer") as info:
            call()
        assert needle in str(info.value) and str(info.value).endswith("; fix it")
    with pytest.raises(Oops, match="^f.json field 'outer' must be a JSON object, got a list"):
        Fields([], "f.json", "outer")
    assert kind(None) == "null" and kind(1.0) == "a number"
