"""What an island's core says in answer to one event: the actions, in order, each message carrying its ids."""

from __future__ import annotations

from typing import Any

from yeto.sync.core.actions import IslandAction, Log, Out


class IslandOutbox:
    """The actions one event produces; every part of the core that sends or logs appends here, and the core hands the
    list to its shell when the event is done."""

    def __init__(self, island_id: int, session: str):
        self.island_id = island_id
        self.session = session
        self.actions: list[IslandAction] = []

    def ids(self, header: dict[str, Any]) -> dict[str, Any]:
        """A message header with who sends it (island id and session) in front."""
        return {"island": self.island_id, "session": self.session, **header}

    def send(self, msg_type: str, header: dict[str, Any], frames: tuple[bytes, ...] = ()) -> None:
        self.actions.append(Out(msg_type, self.ids(header), frames))

    def log(self, level: str, text: str) -> None:
        self.actions.append(Log(level, text))

    def add(self, action: IslandAction) -> None:
        self.actions.append(action)

    def clear(self) -> None:
        """A new event begins: nothing said yet."""
        self.actions = []

    def flush(self) -> list[IslandAction]:
        """The event's actions, handed over (the outbox is empty again)."""
        out, self.actions = self.actions, []
        return out
