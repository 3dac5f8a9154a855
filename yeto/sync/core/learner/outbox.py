"""What a learner's core says in answer to one event: the actions, in order, each message carrying its ids."""

from __future__ import annotations

from typing import Any

from yeto.sync.core.actions import LearnerAction, Log, Out


class LearnerOutbox:
    """The actions one event produces; every part of the core that sends or logs appends here, and the core hands the
    list to its shell when the event is done."""

    def __init__(self, learner_id: int, session: str):
        self.learner_id = learner_id
        self.session = session
        self.actions: list[LearnerAction] = []

    def ids(self, header: dict[str, Any]) -> dict[str, Any]:
        """A message header with who sends it (learner id and session) in front."""
        return {"learner": self.learner_id, "session": self.session, **header}

    def send(self, msg_type: str, header: dict[str, Any], frames: tuple[bytes, ...] = ()) -> None:
        self.actions.append(Out(msg_type, self.ids(header), frames))

    def log(self, level: str, text: str) -> None:
        self.actions.append(Log(level, text))

    def add(self, action: LearnerAction) -> None:
        self.actions.append(action)

    def clear(self) -> None:
        """A new event begins: nothing said yet."""
        self.actions = []

    def flush(self) -> list[LearnerAction]:
        """The event's actions, handed over (the outbox is empty again)."""
        out, self.actions = self.actions, []
        return out
