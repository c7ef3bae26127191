"""Method registry: name -> proposer class + its frozen config dataclass.

A method is one file in ``specdecode/proposers/`` that decorates its proposer with
:func:`register`. The CLI, the server, the benchmark and the tests read this registry; nothing
dispatches on method names anywhere else.

A method marked ``lossy=True`` trades exactness for speed on purpose (``specdecode/lossy/``,
see docs/lossy.md): it is never the default, ``specdecode methods`` lists it apart, the server
runs it only for a request that opts in, the bench reports it in a table of its own with its
agreement with ``ar``, and the exactness tests skip it by this marker.

Config fields carry their documentation in ``field(metadata={"help": ...})`` (see :func:`param`)
so ``specdecode methods`` can print every default with its reason, and what a server lets one
request ask of them: the range of a number, whether only the operator sets it, the memory it
makes the proposer take. The server reads these from the field, never from a table of methods.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specdecode.errors import SpecDecodeError

#: used when the user names no method: the fastest exact method measured on the default model
DEFAULT_METHOD = "suffix"


def param(default: Any, help: str, *, bounds: tuple[float, float] | None = None,
          startup_only: bool = False, memory: Callable[[Any, int], int] | None = None) -> Any:
    """A config field with its documentation (shown by ``specdecode methods``) and its limits
    on a server (:mod:`specdecode.server.limits`).

    ``bounds``: the inclusive range one request may ask for, well above the paper's setting and
    the default; every number a request may set needs one, so that one request cannot make
    every verify step search thousands of nodes. ``startup_only``: the field shapes state that
    every request shares, or names a file or cores of the server, so only ``specdecode serve
    -c`` sets it. ``memory(value, vocabulary size)``: the bytes the proposer allocates for the
    value, where it is large enough to count against the server's proposer memory."""
    metadata: dict[str, Any] = {"help": help, "startup_only": startup_only}
    if bounds is not None:
        metadata["bounds"] = bounds
    if memory is not None:
        metadata["memory"] = memory
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Entry:
    """One registered class (a method's proposer, a diffusion policy) with its frozen config."""

    name: str
    cls: type
    config: type
    paper: str
    summary: str

    def make_config(self, overrides: dict[str, Any] | None = None):
        """Build the frozen config, rejecting unknown fields with the list of known ones."""
        overrides = dict(overrides or {})
        known = {f.name: f for f in dataclasses.fields(self.config)}
        unknown = sorted(set(overrides) - set(known))
        if unknown:
            raise SpecDecodeError(
                f"method '{self.name}' has no config field {', '.join(map(repr, unknown))}; "
                f"known fields: {', '.join(known) or '(none)'}"
            )
        for key, value in overrides.items():
            overrides[key] = _coerce(self.name, known[key], value)
        return self.config(**overrides)

    def defaults(self) -> list[tuple[str, Any, str]]:
        return [
            (f.name, f.default, f.metadata.get("help", ""))
            for f in dataclasses.fields(self.config)
        ]


@dataclass(frozen=True)
class Method(Entry):
    #: output differs from ``ar``'s on purpose (``specdecode/lossy/``); False for every
    #: speculative method
    lossy: bool = False

    @property
    def proposer(self) -> type:
        return self.cls


def _coerce(method: str, f: dataclasses.Field, value: Any) -> Any:
    """Accept strings from the CLI for typed fields; reject values of the wrong type."""
    kind = type(f.default)
    if kind is bool:
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        if isinstance(value, bool):
            return value
    elif kind in (int, float, str):
        if isinstance(value, bool):
            pass
        elif isinstance(value, kind) or (kind is float and isinstance(value, int)):
            return kind(value)
        elif isinstance(value, str):
            try:
                return kind(value)
            except ValueError:
                pass
    elif kind is tuple and isinstance(value, (tuple, list)):
        return tuple(value)
    else:
        return value
    raise SpecDecodeError(
        f"config field '{f.name}' of method '{method}' must be {kind.__name__}, got {value!r}"
    )


class Registry:
    """name -> :class:`Entry`, filled by a class decorator in every module of some packages,
    which are imported on the first read (so adding a file is all it takes to add an entry)."""

    def __init__(self, kind: str, plural: str, entry: type[Entry], packages: tuple[str, ...],
                 first: str, attribute: str):
        self.kind, self.plural, self.entry, self.packages = kind, plural, entry, packages
        #: the reference entry, listed first; the class attribute that gets the entry's name
        self.first, self.attribute = first, attribute
        self._entries: dict[str, Entry] = {}
        self._loaded = False

    def register(self, name: str, config: type, paper: str, summary: str, **marks):
        """Class decorator recording ``cls`` under ``name`` (``marks``: the entry's own fields)."""

        def wrap(cls):
            if name in self._entries:
                raise RuntimeError(f"{self.kind} {name!r} registered twice")
            setattr(cls, self.attribute, name)
            self._entries[name] = self.entry(name, cls, config, paper, summary, **marks)
            return cls

        return wrap

    def _load_all(self) -> None:
        if self._loaded:
            return
        for package_name in self.packages:
            package = importlib.import_module(package_name)
            for module in pkgutil.iter_modules(package.__path__):
                importlib.import_module(f"{package_name}.{module.name}")
        self._loaded = True

    def names(self, **marks) -> list[str]:
        """Every entry whose marks equal ``marks`` (a mark given as None matches any), the
        reference entry first."""
        self._load_all()
        chosen = [n for n, e in self._entries.items()
                  if all(v is None or getattr(e, k) == v for k, v in marks.items())]
        return sorted(chosen, key=lambda n: (n != self.first, n))

    def get(self, name: str) -> Entry:
        self._load_all()
        if name not in self._entries:
            raise SpecDecodeError(f"unknown {self.kind} {name!r}; known {self.plural}: "
                                  f"{', '.join(self.names())}")
        return self._entries[name]


_METHODS = Registry("method", "methods", Method, ("specdecode.proposers", "specdecode.lossy"),
                    first="ar", attribute="method_name")


def register(name: str, config: type, paper: str, summary: str, lossy: bool = False):
    """Class decorator: ``@register("ngram", NgramConfig, paper=..., summary=...)``; a lossy
    method's class is a :class:`specdecode.lossy.base.LossyMethod`, not a proposer."""
    return _METHODS.register(name, config, paper, summary, lossy=lossy)


def names(lossy: bool | None = None) -> list[str]:
    """Every method (``lossy`` None), or only the lossy (True) or the exact ones (False)."""
    return _METHODS.names(lossy=lossy)


def get(name: str) -> Method:
    return _METHODS.get(name)
