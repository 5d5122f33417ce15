"""A store client wrapper that records the requests made through it: tests that count round trips use it."""

from __future__ import annotations

from typing import Any


class CountingClient:
    """``client`` (a raw TCPStore client), recording the name of every operation called on it (one request each)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.client, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return method(*args, **kwargs)

        return call
