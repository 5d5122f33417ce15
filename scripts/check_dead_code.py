"""Fail when a function, method, property or class of the tree is never used: dead code, found by vulture.

`make lint` runs it over the packages, tests, bench, scripts and examples together, so code that only a test uses
counts as used (an accessor a test of behaviour reads, a counterpart such as ``seal`` of ``unseal``). Unused
imports and variables are ruff's (F401, F841); vulture's guesses about attributes and variables (pydantic fields,
enum members) are not reported here.

What only a framework calls (a torch storage reader's ``read_data``, an asyncio protocol's ``data_received``, an
HTTP handler's ``log_message``, an entry point) cannot be seen as used: IGNORED_NAMES and IGNORED_DECORATORS below
name them, each with its caller.

Usage: python scripts/check_dead_code.py. Prints ``path:line: unused method 'name'`` for each and exits 1 if any.
"""

from __future__ import annotations

import sys
from pathlib import Path

import vulture

ROOT = Path(__file__).resolve().parent.parent
PATHS = ["api", "common", "operator", "trainer", "tests", "bench", "scripts", "examples"]
REPORTED = ("function", "method", "property", "class")

IGNORED_DECORATORS = [
    "@pytest.fixture",  # pytest calls fixtures by name (or for every test: autouse)
    "@field_validator",  # pydantic calls validators
    "@atexit.register",  # the interpreter calls them at exit
]
IGNORED_NAMES = [
    "pytest_*",  # pytest's hooks, in conftest.py files and tests/plugins/
    # torch.distributed.checkpoint StorageReader / StorageWriter (trainer/checkpoint/storage.py, replicas/reader.py)
    "set_up_storage_reader",
    "prepare_local_plan",
    "prepare_global_plan",
    "validate_checkpoint_id",
    "read_data",
    "write_data",
    # c10d Store methods torch calls on a Python store (trainer/store/)
    "deleteKey",
    "getNumKeys",
    # asyncio protocols (operator/pulses.py, trainer/store/splice.py)
    "connection_made",
    "data_received",
    "eof_received",
    "connection_lost",
    "pause_writing",
    "resume_writing",
    # http.server handlers and socketserver (api/metricsserver.py, operator/election.py, tests' servers)
    "do_GET",
    "log_message",
    "handle_error",
    # pickle.Unpickler (trainer/agent/heartbeats.py): restricts what a rendezvous state may load
    "find_class",
    # the torchrun.handlers entry point in pyproject.toml; a module's lazy attributes (trainer/__init__.py)
    "handler_creator",
    "__getattr__",
]


def dead_code() -> list[vulture.core.Item]:
    finder = vulture.Vulture(ignore_names=IGNORED_NAMES, ignore_decorators=IGNORED_DECORATORS)
    finder.scavenge([str(ROOT / p) for p in PATHS])
    return [item for item in finder.get_unused_code(min_confidence=60) if item.typ in REPORTED]


def main() -> int:
    unused = [f"{Path(item.filename).relative_to(ROOT)}:{item.first_lineno}: {item.message}" for item in dead_code()]
    if not unused:
        return 0
    print("\n".join(unused))
    sys.exit(f"{len(unused)} unused definitions: remove them, or name what calls one in scripts/check_dead_code.py")


if __name__ == "__main__":
    sys.exit(main())
