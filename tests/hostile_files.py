"""Setups for tests/test_bad_inputs*.py that forge artifacts: a trace whose metadata or timeline was edited, and
JSON files no parser should be trusted with (nested 100 000 deep, a 5000-digit integer)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

Setup = Callable[[Path, Path], None]
DEEP = 100_000


def edited_trace(name: str, meta: Callable[[dict], None] | None = None,
                 table: Callable[[pa.Table], pa.Table] | None = None) -> Setup:
    """The shared trace ({A}/t.parquet) with its hplan metadata edited by `meta` and its table by `table`."""
    def make(a: Path, d: Path) -> None:
        t = pq.read_table(a / "t.parquet")
        data = json.loads(t.schema.metadata[b"hplan"])
        if meta is not None:
            meta(data)
        if table is not None:
            t = table(t)
        kv = dict(t.schema.metadata or {})
        kv[b"hplan"] = json.dumps(data).encode()  # json.dumps writes NaN as NaN, as a careless editor would
        pq.write_table(t.replace_schema_metadata(kv), d / name)
    return make


def trace_metadata_text(name: str, text: str) -> Setup:
    """The shared trace with `text` (anything, not necessarily JSON) as its hplan metadata."""
    def make(a: Path, d: Path) -> None:
        t = pq.read_table(a / "t.parquet")
        kv = dict(t.schema.metadata or {})
        kv[b"hplan"] = text.encode()
        pq.write_table(t.replace_schema_metadata(kv), d / name)
    return make


def column_as_strings(column: str) -> Callable[[pa.Table], pa.Table]:
    def edit(t: pa.Table) -> pa.Table:
        values = pa.array([str(v) for v in t.column(column).to_pylist()])
        return t.set_column(t.schema.get_field_index(column), column, values)
    return edit


def column_replaced(column: str, values: Callable[[pa.Table], pa.Array]) -> Callable[[pa.Table], pa.Table]:
    return lambda t: t.set_column(t.schema.get_field_index(column), column, values(t))


def only_a_long_column(rows: int) -> Callable[[pa.Table], pa.Table]:
    """A table of one unused column of `rows` zeros (a few hundred KB compressed), the schema metadata kept."""
    return lambda t: pa.table({"junk": np.zeros(rows, dtype=np.int64)}).replace_schema_metadata(t.schema.metadata)


def edited_metrics(name: str, edit: Callable[[pa.Table], pa.Table]) -> Setup:
    def make(a: Path, d: Path) -> None:
        pq.write_table(edit(pq.read_table(a / "m.parquet")), d / name)
    return make


def deep_json(name: str) -> Setup:
    """A file of arrays nested DEEP deep: Python's json recurses once per level."""
    return lambda a, d: (d / name).write_text("[" * DEEP + "]" * DEEP)


def plan_with(name: str, edit: Callable[[str], str]) -> Setup:
    """The shared plan ({A}/p.json) with its text edited (to forge what json.dumps cannot write)."""
    return lambda a, d: (d / name).write_text(edit((a / "p.json").read_text()))


def deep_value(text: str) -> str:
    """A plan whose options hold a value nested DEEP deep (the file stays an object with every field)."""
    obj = json.loads(text)
    obj["options"] = {"x": "@"}
    return json.dumps(obj).replace('"@"', "[" * DEEP + "]" * DEEP)


def long_integer(text: str) -> str:
    """A plan whose first region's bytes have 5000 digits (Python refuses ints of over 4300 digits)."""
    obj = json.loads(text)
    obj["regions"][0]["bytes"] = "@"
    return json.dumps(obj).replace('"@"', "9" * 5000)
