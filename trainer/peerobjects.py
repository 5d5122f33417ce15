"""Objects a rank receives from its peers are decoded with an allow-list, never by a free unpickle.

Why: ``all_gather_object``, ``broadcast_object_list`` and the other object collectives (the trainer's agreements and
DCP's save and load planning) ship pickles between ranks, and torch decodes them with a plain ``pickle.Unpickler``:
whoever gets bytes into a group's connection would run code in every rank. torch keeps the decoder in one module
attribute (``distributed_c10d._unpickler``); :func:`install` replaces it with :class:`PeerUnpickler`, whose
``find_class`` admits only plain data:

* builtin containers and scalars (no builtin function: no ``eval`` or ``__import__``, and ``getattr`` only for an
  enum member by name, as newer Pythons pickle one), and paths;
* what a tensor is built from (torch's own weights-only list: dtypes, sizes, devices, the tensor rebuild functions);
  a storage's bytes are read with ``torch.load(weights_only=True)`` instead of torch's free ``torch.load``;
* exceptions of a module this process has imported, with their traceback summaries: what DCP gathers when a
  rank's save or load failed (so every rank raises the same error instead of one timing out in the next collective);
* the dataclasses, named tuples and enums of DCP (``torch.distributed.checkpoint``) and of DTensor
  (``torch.distributed.tensor``), and its placements (``Shard``, ``Replicate``, ...): constructing one assigns
  fields, nothing else.

Anything else is refused with ``pickle.UnpicklingError`` naming the global, so a collective that ships a new kind of
object fails loudly in the tests rather than silently widening the list.
"""

from __future__ import annotations

import _compat_pickle
import dataclasses
import enum
import importlib
import io
import pickle
import sys
from typing import Any

import torch
import torch.distributed.distributed_c10d as c10d
from torch import _weights_only_unpickler as weights_only
from torch.distributed.tensor.placement_types import Placement

_BUILTINS = frozenset(
    {"bool", "bytearray", "bytes", "complex", "dict", "float", "frozenset", "int", "list", "range", "set", "slice"}
    | {"str", "tuple"}
)
_COLLECTIONS = frozenset({"OrderedDict", "Counter", "defaultdict", "deque"})
_PATHS = frozenset({"PurePath", "PurePosixPath", "PosixPath", "Path"})
_TRACEBACKS = frozenset({"StackSummary", "FrameSummary"})
_DATA_MODULES = ("torch.distributed.checkpoint.", "torch.distributed.tensor.")


def _load_storage(data: bytes) -> Any:
    """``torch.storage._load_from_bytes`` with the weights-only decoder."""
    return torch.load(io.BytesIO(data), weights_only=True)


def _enum_member(cls: Any, name: str) -> Any:
    """``getattr`` as pickle uses it for an enum member (Python's newer enums pickle by name): nothing else."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls.__members__[name]
    raise pickle.UnpicklingError(f"a peer sent getattr({cls!r}, {name!r}), which is no enum member: refused")


def _is_plain_data_class(value: Any) -> bool:
    if not isinstance(value, type):
        return False
    if dataclasses.is_dataclass(value) or issubclass(value, (enum.Enum, Placement)):
        return True
    return issubclass(value, tuple) and hasattr(value, "_fields")  # a NamedTuple


def allowed_global(module: str, name: str) -> Any:
    """The object pickle's ``GLOBAL module name`` stands for, when it is plain data; raises otherwise."""
    module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))  # protocol 2's Python 2 names
    module = _compat_pickle.IMPORT_MAPPING.get(module, module)
    if (module, name) == ("builtins", "getattr"):
        return _enum_member
    if module == "builtins" and name in _BUILTINS:
        return getattr(__import__("builtins"), name)
    if module == "collections" and name in _COLLECTIONS:
        return getattr(importlib.import_module("collections"), name)
    if module == "pathlib" and name in _PATHS:  # a path names a file; making one touches none
        return getattr(importlib.import_module("pathlib"), name)
    if (module, name) == ("torch.storage", "_load_from_bytes"):
        return _load_storage
    known = weights_only._get_allowed_globals().get(f"{module}.{name}")
    if known is not None:
        return known
    if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
        return getattr(torch, name)
    if module == "traceback" and name in _TRACEBACKS:
        return getattr(importlib.import_module("traceback"), name)
    error = getattr(sys.modules.get(module), name, None)  # only a module this process imported: no import runs here
    if isinstance(error, type) and issubclass(error, BaseException):
        return error
    if (module + ".").startswith(_DATA_MODULES) and "." not in name:
        value = getattr(importlib.import_module(module), name, None)
        if _is_plain_data_class(value):
            return value
    raise pickle.UnpicklingError(f"a peer sent an object of {module}.{name}, which is not plain data: refused")


class PeerUnpickler(pickle.Unpickler):
    """A ``pickle.Unpickler`` that resolves globals only through :func:`allowed_global`."""

    def find_class(self, module: str, name: str) -> Any:
        return allowed_global(module, name)


def install() -> None:
    """Decode every object collective of this process with :class:`PeerUnpickler` (idempotent)."""
    c10d._unpickler = PeerUnpickler
