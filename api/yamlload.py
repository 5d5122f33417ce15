"""The one YAML loader for manifests (``disttrain validate``, ``convert``, ``local run``/``scale``/``status``).

A manifest is untrusted input: PyYAML's ``safe_load`` refuses code, but not cost. A 549-byte alias bomb
(9 anchors of 9 references each) kept ``disttrain validate`` busy for over 120 s and 1.2 GB before this loader;
deep nesting and non-UTF-8 bytes ended in raw tracebacks. This loader bounds each of them before anything walks
the data, and reports every refusal as :class:`ManifestInputError`, one line naming the problem and the limit:

- size: at most :data:`MAX_MANIFEST_BYTES` (1 MiB, the order of the API server's request limit);
- encoding: UTF-8 (a BOM is allowed); the first bad byte and its offset are named;
- expansion: the file, with every alias expanded, has at most :data:`MAX_EXPANDED_NODES` nodes and
  :data:`MAX_DOCUMENTS` documents. Anchors and
  aliases stay allowed (kubectl accepts them and people share env lists with them); only their blow-up is
  refused. Counted while composing, in time linear in the file, so a bomb is refused in milliseconds;
- recursion: an alias inside its own anchor (a cyclic object) is refused;
- depth: at most :data:`MAX_DEPTH` nested collections (real manifests stay under 20).
"""

from __future__ import annotations

import pathlib
from typing import Any

import yaml
from yaml import nodes

MAX_MANIFEST_BYTES = 1024 * 1024
"""Largest manifest file read, in bytes."""
MAX_EXPANDED_NODES = 200_000
"""Most YAML nodes of a whole file once aliases are expanded (a job is about 100; a 1 MiB file without aliases
can reach 500k only as a bare list of one-digit numbers)."""
MAX_DOCUMENTS = 1000
"""Most YAML documents in one file (each is validated in a few milliseconds)."""
MAX_DEPTH = 100
"""Most nested collections in one document."""


class ManifestInputError(ValueError):
    """A file refused before it is parsed into objects: too big, not UTF-8, not YAML, or past a limit.

    ``part`` is ``<file>`` (size, encoding, reading) or ``<yaml>`` (syntax, limits while parsing)."""

    def __init__(self, message: str, part: str = "<yaml>") -> None:
        super().__init__(message)
        self.part = part


class _Bounds(yaml.composer.Composer):
    """PyYAML's composer, counting nesting depth and the expanded size of each node (aliases included)."""

    def _init_bounds(self) -> None:
        self._depth = 0
        self._total = 0
        """Expanded nodes of the documents composed so far."""
        self._documents = 0
        self._sizes: dict[int, int] = {}
        """Expanded node count of each finished node, by id(): an alias counts its anchor's whole subtree."""
        self._open: set[int] = set()
        """Collections being composed: an alias to one of them would make a cyclic object."""

    def compose_document(self) -> nodes.Node | None:
        self._documents += 1
        if self._documents > MAX_DOCUMENTS:
            raise ManifestInputError(f"more than {MAX_DOCUMENTS} YAML documents (the limit for one file)")
        self.anchors = _OpenAnchors(self)  # PyYAML resets it to {} after each document
        node = super().compose_document()
        if node is not None:
            self._total += self._sizes.get(id(node), 1)
            self._check_total(node, self._total)
        self._sizes.clear()
        return node

    def compose_node(self, parent: nodes.Node | None, index: Any) -> nodes.Node | None:
        event = self.peek_event()  # type: ignore[attr-defined]  # the parser's, mixed in below
        if isinstance(event, yaml.AliasEvent):
            target = self.anchors.get(event.anchor)
            if target is not None and id(target) in self._open:
                raise ManifestInputError(
                    f"{_where(event.start_mark)}alias *{event.anchor} refers to its own anchor "
                    "(a recursive structure); manifests must be finite trees"
                )
            return super().compose_node(parent, index)
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise ManifestInputError(
                f"{_where(event.start_mark)}nesting deeper than {MAX_DEPTH} levels (the limit for a manifest)"
            )
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if node is not None:
            self._open.discard(id(node))
            self._count(node)
        return node

    def _count(self, node: nodes.Node) -> None:
        if isinstance(node, nodes.MappingNode):
            size = 1 + sum(self._sizes.get(id(k), 1) + self._sizes.get(id(v), 1) for k, v in node.value)
        elif isinstance(node, nodes.SequenceNode):
            size = 1 + sum(self._sizes.get(id(item), 1) for item in node.value)
        else:
            size = 1
        self._check_total(node, self._total + size)
        self._sizes[id(node)] = size

    @staticmethod
    def _check_total(node: nodes.Node, total: int) -> None:
        if total > MAX_EXPANDED_NODES:
            raise ManifestInputError(
                f"{_where(node.start_mark)}the file holds more than {MAX_EXPANDED_NODES} YAML nodes once "
                "aliases are expanded (the limit for a manifest; an alias bomb?)"
            )


class _PureLoader(_Bounds, yaml.SafeLoader):
    """The pure-Python loader, used where PyYAML was built without libyaml."""

    def __init__(self, stream: str) -> None:
        yaml.SafeLoader.__init__(self, stream)
        self._init_bounds()

    def fetch_flow_collection_start(self, TokenClass: Any) -> None:
        # The scanner looks back over every open flow level for each token: refuse deep flow nesting here, before
        # 500k "[" in a 1 MiB file cost quadratic time, not only later in the composer.
        if self.flow_level >= MAX_DEPTH:
            raise ManifestInputError(
                f"line {self.line + 1}: nesting deeper than {MAX_DEPTH} levels (the limit for a manifest)"
            )
        super().fetch_flow_collection_start(TokenClass)


_Loader: type[_Bounds] = _PureLoader
if yaml.__with_libyaml__:
    from yaml._yaml import CParser

    class _CLoader(_Bounds, CParser, yaml.constructor.SafeConstructor, yaml.resolver.Resolver):
        """libyaml's scanner and parser (a 900 KB scalar: 0.15 s instead of 9 s; it stops nesting at 1000 levels)
        under the same counting composer: :class:`_Bounds` comes first, so its composer replaces libyaml's."""

        def __init__(self, stream: str) -> None:
            CParser.__init__(self, stream)
            yaml.constructor.SafeConstructor.__init__(self)
            yaml.resolver.Resolver.__init__(self)
            yaml.composer.Composer.__init__(self)
            self._init_bounds()

    _Loader = _CLoader


class _OpenAnchors(dict[str, nodes.Node]):
    """The loader's anchors while composing a document: PyYAML stores an anchored collection here before it
    composes the children, so each one is marked open until :meth:`_Bounds.compose_node` finishes it."""

    def __init__(self, loader: _Bounds) -> None:
        super().__init__()
        self._loader = loader

    def __setitem__(self, key: str, value: nodes.Node) -> None:
        super().__setitem__(key, value)
        self._loader._open.add(id(value))


def decode(data: bytes, source: str) -> str:
    """``data`` as text: UTF-8 (with or without BOM) within the size cap, or ManifestInputError."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestInputError(
            f"larger than {MAX_MANIFEST_BYTES} bytes (1 MiB, the limit for a manifest)", part="<file>"
        )
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise ManifestInputError(
            f"not UTF-8 text: byte 0x{data[error.start]:02x} at offset {error.start} ({source} must be UTF-8)",
            part="<file>",
        ) from None


def read(path: pathlib.Path) -> str:
    """The text of a manifest file, read no further than the size cap."""
    try:
        with path.open("rb") as stream:
            data = stream.read(MAX_MANIFEST_BYTES + 1)
    except OSError as error:
        raise ManifestInputError(error.strerror or str(error), part="<file>") from None
    return decode(data, "a manifest")


def load_all(text: str) -> list[Any]:
    """Every document of ``text`` as plain objects (safe tags only), within the limits above."""
    loader: Any = _Loader(text)  # type: ignore[call-arg]
    try:
        documents = []
        while loader.check_data():
            documents.append(loader.get_data())
        return documents
    except ManifestInputError:
        raise
    except yaml.YAMLError as error:
        raise ManifestInputError(f"not valid YAML: {_one_line(str(error))}") from None
    except (ValueError, OverflowError, TypeError) as error:  # e.g. a timestamp 2024-13-45 fails in datetime()
        raise ManifestInputError(f"a value YAML cannot construct: {_one_line(str(error))}") from None
    except RecursionError:
        raise ManifestInputError(f"nesting too deep (limit {MAX_DEPTH})") from None
    finally:
        loader.dispose()


def load_file(path: pathlib.Path) -> list[Any]:
    """Every document of the manifest at ``path`` (empty documents kept as None)."""
    return load_all(read(path))


def _where(mark: Any) -> str:
    """``line N: `` of a PyYAML mark ("" when there is none)."""
    return f"line {mark.line + 1}: " if mark is not None else ""


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(text.replace('in "<unicode string>", ', "").split())
    return line if len(line) <= limit else line[: limit - 3] + "..."
