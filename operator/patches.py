"""JSON merge patches (RFC 7386): the one way the operator writes status, as kopf keeps ``_cogs/structs/patches.py``.

The reconcile core computes the patch from the status it read to the status it decided, so the adapter sends only
what changed and the patch is empty when nothing did.
"""

from __future__ import annotations

from typing import Any


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
