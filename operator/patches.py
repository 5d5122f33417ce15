"""JSON documents as the API server sends them: merge patches (RFC 7386), the one way the operator writes status
(as kopf keeps ``_cogs/structs/patches.py``), and copies.

The reconcile core computes the patch from the status it read to the status it decided, so the adapter sends only
what changed and the patch is empty when nothing did.
"""

from __future__ import annotations

import copy
from typing import Any, TypeVar

Document = TypeVar("Document")


def copy_json(value: Document) -> Document:
    """A deep copy of a JSON document (dicts, lists and immutable scalars), as ``copy.deepcopy`` makes it.

    Why not ``copy.deepcopy``: it dispatches on every value's type and keeps a memo of every object it copied, for
    shared references and cycles that decoded JSON never has. The operator copies every watched job, on every
    watch event (about 50 a second at 500 jobs): this is 2-3 times faster on those objects.
    """
    kind = type(value)
    if kind is dict:
        return {key: copy_json(item) for key, item in value.items()}  # type: ignore[attr-defined,return-value]
    if kind is list:
        return [copy_json(item) for item in value]  # type: ignore[attr-defined,return-value]
    if kind in _IMMUTABLE_SCALARS:
        return value
    return copy.deepcopy(value)  # not decoded JSON (a view, a subclass): the general copy


_IMMUTABLE_SCALARS = (str, int, float, bool, type(None))


def merge_patch(old: Any, new: Any) -> Any:
    """RFC 7386 merge patch turning ``old`` into ``new`` (dicts recurse; removed keys become None)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    patch: dict[str, Any] = {}
    for key in old.keys() - new.keys():
        patch[key] = None
    for key, value in new.items():
        if key not in old:
            patch[key] = value
        elif old[key] != value:
            patch[key] = merge_patch(old[key], value)
    return patch


def apply_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: ``target`` with ``patch`` applied (a new object; None in the patch removes the key)."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = apply_merge_patch(result.get(key), value)
    return result
