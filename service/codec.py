"""The service's wire format: JSON for the store's arguments and answers, records and times included.

Why not pickle: the service reads what any user sends. Only plain JSON values, datetimes, tuples, maps with
non-string keys and the frozen records of db.records (by name, from a fixed list) come back as objects; any
other tag is refused."""
from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any

from db import records

RECORDS: dict[str, type] = {c.__name__: c for c in vars(records).values()
                            if isinstance(c, type) and dataclasses.is_dataclass(c) and c.__module__ == records.__name__}


class CodecError(ValueError):
    """A value the wire format does not carry."""


def encode(value: Any) -> Any:
    """`value` as JSON-able data (see decode)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, datetime):
        return {"$dt": value.isoformat()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        name = type(value).__name__
        if RECORDS.get(name) is not type(value):
            raise CodecError(f"{name} is not a record the service carries")
        return {"$rec": name, "v": {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, tuple):
        return {"$tuple": [encode(v) for v in value]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: encode(v) for k, v in value.items()}
        return {"$map": [[encode(k), encode(v)] for k, v in value.items()]}
    raise CodecError(f"a {type(value).__name__} cannot be sent to the service")


def decode(data: Any) -> Any:
    """The value `encode` wrote."""
    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict):
        return data
    tags = [k for k in data if k.startswith("$")]
    if not tags:
        return {k: decode(v) for k, v in data.items()}
    tag = tags[0]
    if tag == "$dt":
        return datetime.fromisoformat(data["$dt"])
    if tag == "$tuple":
        return tuple(decode(v) for v in data["$tuple"])
    if tag == "$map":
        return {_key(decode(k)): decode(v) for k, v in data["$map"]}
    if tag == "$rec" and data["$rec"] in RECORDS:
        return RECORDS[data["$rec"]](**{k: decode(v) for k, v in data["v"].items()})
    raise CodecError(f"unknown tag {tag!r} (or record {str(data.get('$rec'))[:40]!r})")


def _key(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key
