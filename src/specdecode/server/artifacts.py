"""The artifacts a request may pick, by name: requests never name files.

Some config fields name what a proposer loads: ``heads`` (hydra, clover, eagle), ``adapters``
(early_exit, del) and ``draft`` (draft_model, dyspec). From the command line they take a path;
from an HTTP request a path would let any client make the server open any file on its disk (and
learn from the error whether it exists and what it holds). So the server builds a catalogue at
start: the artifacts trained for its target in the package and the user cache
(:func:`~specdecode.artifacts.find_artifacts`' folders), plus those given with
``specdecode serve --artifact NAME=PATH``, each under a name (a file's stem, or NAME). A request
gives a name from the catalogue, or a keyword the method resolves itself (``auto``, ``none``,
``distilled``); anything else gets the same 400, whatever is on the disk.

The catalogue also knows each artifact's size, so the server can refuse a config whose
proposer would not fit its memory budget before loading anything (:mod:`.limits`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specdecode.errors import SpecDecodeError, require
from specdecode.server.protocol import ApiError

#: config field -> the keywords it takes besides an artifact name (resolved by the method)
ARTIFACT_FIELDS: dict[str, tuple[str, ...]] = {
    "heads": ("auto",),
    "adapters": ("auto", "none"),
    "draft": ("distilled",),
}
#: the kind of a Hugging Face checkpoint folder (``draft`` takes one)
CHECKPOINT = "checkpoint"
#: loaded size / file size, an upper bound: int8 matrices are loaded as float32
LOADED_PER_STORED_BYTE = 4


@dataclass(frozen=True)
class Entry:
    name: str
    path: Path
    #: the artifact's kind (``eagle_heads``, ``exit_adapters``, ``draft_model``, ``checkpoint``)
    kind: str
    #: upper estimate of its size once loaded
    loaded_bytes: int


def field_kinds(method, field: str) -> tuple[str, ...]:
    """The artifact kinds config ``field`` of registry method ``method`` loads."""
    if field == "heads":
        from specdecode.heads.artifact import artifact_kind

        return (artifact_kind(method.proposer.head_kind),)
    if field == "adapters":
        from specdecode.drafting.exit_adapters import KIND

        return (KIND,)
    if field == "draft":
        from specdecode.drafting.artifacts import ARTIFACT_KIND

        return (ARTIFACT_KIND, CHECKPOINT)
    return ()


class Catalogue:
    """name -> :class:`Entry`, fixed at start."""

    def __init__(self, entries: list[Entry] = ()):
        self.entries: dict[str, Entry] = {}
        for entry in entries:
            require(entry.name not in self.entries,
                    f"two artifacts are named {entry.name!r}; give one of them another name "
                    "with --artifact NAME=PATH")
            self.entries[entry.name] = entry

    @classmethod
    def for_target(cls, fingerprint: str, given: dict[str, str] | None = None) -> Catalogue:
        """The artifacts found for the target ``fingerprint`` (user cache, package) and those
        ``given`` as name -> path by the operator (checked here: a bad path fails at start)."""
        from specdecode.artifacts import packaged_dir, read_metadata, user_dir

        entries, seen = [], set()
        for folder in (user_dir(), packaged_dir()):
            for path in folder.glob("*.safetensors") if folder.is_dir() else ():
                try:
                    kind, found, _ = read_metadata(path)
                except SpecDecodeError:
                    continue  # not an artifact: not ours to judge
                if found == fingerprint and path.stem not in seen:
                    seen.add(path.stem)
                    entries.append(Entry(path.stem, path, kind, _loaded_bytes(path)))
        for name, spec in (given or {}).items():
            path = Path(spec).expanduser()
            require(path.exists(), f"--artifact {name}={spec}: no such file or folder")
            if path.is_dir():
                entries = [e for e in entries if e.name != name]
                entries.append(Entry(name, path, CHECKPOINT, _loaded_bytes(path)))
                continue
            kind, found, _ = read_metadata(path)
            require(found == fingerprint,
                    f"--artifact {name}={spec} was trained for another target "
                    f"({found!r}), not the served model ({fingerprint!r})")
            entries = [e for e in entries if e.name != name]  # the operator's name wins
            entries.append(Entry(name, path, kind, _loaded_bytes(path)))
        return cls(entries)

    def names(self, kinds: tuple[str, ...]) -> list[str]:
        return sorted(e.name for e in self.entries.values() if e.kind in kinds)

    def resolve(self, method, field: str, value) -> str:
        """The value the config gets for a request's ``field``: a keyword of the field as it
        is, a catalogued artifact's name as its path; a 400 for anything else. The answer never
        depends on the disk, only on the catalogue."""
        kinds = field_kinds(method, field)
        keywords = ARTIFACT_FIELDS[field]
        if value in keywords:
            return value
        entry = self.entries.get(value) if isinstance(value, str) else None
        if entry is None or entry.kind not in kinds:
            offered = ", ".join(map(repr, list(keywords) + self.names(kinds)))
            raise ApiError(400, f"config field '{field}' of method '{method.name}' takes one of "
                                f"{offered}: requests pick artifacts by name, never by path (the "
                                "server's operator offers more with `specdecode serve "
                                "--artifact NAME=PATH`)", param=f"specdecode.config.{field}")
        return str(entry.path)

    def loaded_bytes(self, method, field: str, value: str) -> int:
        """Upper estimate of what a config's (resolved) ``field`` loads: a keyword, at most the
        largest artifact of its kind the method could pick ('none': nothing); a path, its
        catalogue entry's size, or the file's (a path the operator set with ``-c``)."""
        if value == "none":
            return 0
        kinds = field_kinds(method, field)
        if value in ARTIFACT_FIELDS[field]:
            return max((e.loaded_bytes for e in self.entries.values() if e.kind in kinds),
                       default=0)
        for entry in self.entries.values():
            if str(entry.path) == value:
                return entry.loaded_bytes
        path = Path(value)
        return _loaded_bytes(path) if path.exists() else 0


def _loaded_bytes(path: Path) -> int:
    if path.is_dir():  # a checkpoint: bfloat16/float16 files load as float32
        return 2 * sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return LOADED_PER_STORED_BYTE * path.stat().st_size
