"""What a request may ask of a method's config: the server-side ranges of its numeric fields,
the fields only the operator sets, and the proposer memory a config will take.

A method's config dataclass checks that a value makes sense (``candidates >= 1``); the server
also needs it to be affordable for a stranger to ask: one request must not allocate gigabytes
(``recycling`` keeps a ``vocabulary x candidates`` matrix) or make every verify step search
thousands of nodes. Each config field declares its own limits where it is defined
(:func:`specdecode.registry.param`: ``bounds``, ``startup_only``, ``memory``); this module
reads them, so a new method brings its limits with it and nothing here names a method. A test
fails when a registered method has a numeric field a request may set without bounds.

Start-up-only fields shape state that the whole server shares (the suffix global tree's depth
and size) or name its files and cores: ``specdecode serve -c`` sets them, a request naming them
gets a 400.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from specdecode.registry import Entry
from specdecode.server.protocol import ApiError

#: longest value of a free-text config field (``tree``, ``candidate_layers``, ...)
MAX_TEXT_FIELD = 64

#: proposer state of a method whose config does not size it (n-gram tables, small trees)
BASE_PROPOSER_BYTES = 1 << 20


def is_numeric(field: dataclasses.Field) -> bool:
    return isinstance(field.default, (int, float)) and not isinstance(field.default, bool)


def bounds(field: dataclasses.Field) -> tuple[float, float] | None:
    """The inclusive range a request may ask of ``field``, None where it declares none."""
    return field.metadata.get("bounds")


def startup_only(field: dataclasses.Field) -> bool:
    return field.metadata.get("startup_only", False)


def check_overrides(method: Entry, overrides: dict[str, Any]) -> None:
    """Refuse a request's config fields that only the operator sets, and over-long text, with a
    400 naming the field (before the config is built)."""
    fields = {f.name: f for f in dataclasses.fields(method.config)}
    for name, value in overrides.items():
        if name in fields and startup_only(fields[name]):
            raise ApiError(400, f"config field '{name}' of method '{method.name}' is set when "
                                f"the server starts (`specdecode serve -c {name}=...`), not per "
                                "request; leave it out", param=f"specdecode.config.{name}")
        if isinstance(value, str) and len(value) > MAX_TEXT_FIELD:
            raise ApiError(400, f"config field '{name}' is longer than {MAX_TEXT_FIELD} "
                                "characters", param=f"specdecode.config.{name}")


def check_ranges(method: Entry, config, asked) -> None:
    """Refuse a built config whose fields the request ``asked`` for are outside their bounds,
    with a 400 naming the field. It reads the config, not the request, so a number sent as a
    string (which the config coerces, as from the command line) is checked too; building a
    config allocates nothing, its proposer does."""
    for field in dataclasses.fields(config):
        if field.name not in asked or bounds(field) is None:
            continue
        value = getattr(config, field.name)
        low, high = bounds(field)
        if not (math.isfinite(value) and low <= value <= high):
            raise ApiError(400, f"config field '{field.name}' of method '{method.name}' must be "
                                f"in {_number(low)}..{_number(high)} on this server, got "
                                f"{value!r}", param=f"specdecode.config.{field.name}")


def proposer_bytes(config, vocab_size: int, artifact_bytes: int = 0) -> int:
    """An upper estimate of the memory one proposer of ``config`` holds: what its fields size
    (their ``memory``) plus the artifact it loads (``artifact_bytes``, from the server's
    catalogue, :mod:`.artifacts`)."""
    sized = sum(f.metadata["memory"](getattr(config, f.name), vocab_size)
                for f in dataclasses.fields(config) if "memory" in f.metadata)
    return BASE_PROPOSER_BYTES + sized + artifact_bytes


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)
