"""The quorum a run keeps once islands are given up (the syncer's core applies it; the audit recomputes it)."""


def quorum_after_give_ups(quorum: int, islands: int, given_up: int) -> int:
    """The quorum once `given_up` of the run's `islands` are not coming back: lowered so that the run can go on,
    never below 1, never above --quorum."""
    return max(1, min(quorum, islands - given_up))
