"""The bounded in-memory store behind the Responses API's `store` / `previous_response_id`.

One per app (built by build_app, never a module global). Least recently used responses go first once
`capacity` are held; capacity 0 keeps nothing (the server is stateless, OpenAI's `store` is then ignored).
The event loop is the only user, so no lock is needed.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class StoredResponse:
    body: dict  # the response object as it was returned
    conversation: list[dict]  # chat messages up to and including this response's output (no instructions)


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def put(self, response_id: str, item: StoredResponse) -> None:
        if not self.enabled:
            return
        self._items[response_id] = item
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)
        return item

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None
