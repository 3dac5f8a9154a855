"""Proving a run from its tape: `audit` runs the core's `TapeFold` (yeto.sync.core.fold, which lists the
invariants) strictly over a whole tape and returns the first event that breaks one; `audit_run` also checks the
checkpoint on disk against the tape's last merge."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

from yeto.sync.core.fold import AuditViolation, TapeFold

__all__ = ["AuditReport", "AuditViolation", "TapeFold", "audit", "audit_run"]


@dataclass
class AuditReport:
    events: int
    merges: int
    deltas: int
    restarts: int
    rollbacks: int
    discards: int
    version: int
    digest: Optional[str]
    violation: Optional[AuditViolation] = None

    @property
    def ok(self) -> bool:
        return self.violation is None

    def summary(self) -> str:
        if self.violation is not None:
            return f"audit FAILED at {self.violation}"
        return (f"audit OK: {self.events} events, {self.merges} merges (version {self.version}), {self.deltas} deltas "
                f"accepted, {self.restarts} restart(s), {self.rollbacks} rollback(s), {self.discards} discard(s)")


def audit(events: Iterable[dict[str, Any]]) -> AuditReport:
    """Run every invariant over a tape; the report names the first violation, if any."""
    fold = TapeFold(strict=True)
    events = list(events)
    violation = None if events else AuditViolation(0, "the tape is empty: no syncer has run here (nothing to prove)")
    for e in events:
        try:
            fold.feed(e)
        except AuditViolation as v:
            violation = v
            break
    c = fold.counts
    return AuditReport(fold.next_seq, len(fold.merged), c.get("delta", 0), c.get("resume", 0), c.get("rollback", 0),
                       c.get("discard", 0), fold.version, fold.digests.get(fold.version), violation)


def audit_run(path: str | Path) -> AuditReport:
    """Audit a syncer's --out directory (or its tape); where the checkpoint is there too, also check that it holds
    the tape's last merge."""
    from yeto.sync.shell.tape import read_tape

    report = audit(read_tape(path))
    state = Path(path) / "state.safetensors"
    if report.ok and state.is_file():
        from yeto.sync.shell.store import read_checkpoint

        try:
            ck = read_checkpoint(state)
        except Exception as e:  # damage can surface as any parser's error
            report.violation = AuditViolation("end", f"the checkpoint {state} cannot be read: {e}")
            return report
        if (ck.version, ck.digest) != (report.version, report.digest):
            report.violation = AuditViolation("end", f"the checkpoint holds version {ck.version} ({ck.digest}), the "
                                                     f"tape's last merge is version {report.version} ({report.digest})")
    return report
