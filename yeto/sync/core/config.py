"""The syncer's configuration: its flags as one dataclass, their checks, and what a resume may not change.

`SyncerConfig` describes one syncer, the core's policy and the I/O shell's settings alike, so that one object is
checked (`check`) and saved with every checkpoint. `check_resume` refuses a restart whose flags contradict the run a
checkpoint holds (`CONTRACT_FIELDS`: the run's math and wire format depend on them). Every duration is in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional

from yeto import YetoError
from yeto.sync.core.checks import check_port
from yeto.sync.core.policy import RoundPolicy
from yeto.sync.merge.aggregate import DEFAULT_CLIP_K, ROBUST_MODES
from yeto.sync.merge.rules import (DEFAULT_RULE, LORA_MERGES, MEAN, MERGE_WEIGHTS, TRIMMED_MEAN_ALONE, merge_rule,
                                   merge_rules)
from yeto.sync.wire.layout import MAX_STREAM_PARTS
from yeto.sync.wire.protocol import DEFAULT_MAX_MESSAGE_MB
from yeto.sync.wire.quant import BITS

DEFAULT_GRACE_S = 5.0  # after quorum, wait at most this long for an island predicted to push soon
DEFAULT_MAX_BASE_LAG = 4
MAX_BASE_LAG = 64  # beyond this a delta describes another model
DEFAULT_STALENESS_EXPONENT = 0.5
HEARTBEATS_PER_TIMEOUT = 4  # islands ping this many times per --island-timeout
DEFAULT_MAX_ISLANDS = 1024
# what a restart may not change: the run's math and its wire format depend on them
CONTRACT_FIELDS = ("sync_bits", "broadcast_bits", "outer_lr", "outer_momentum", "inner_steps", "round_seconds",
                   "robust", "robust_k", "merge", "merge_weight", "lora_merge", "max_base_lag", "staleness_exponent",
                   "step_normalize", "merge_alpha", "model", "model_revision", "fragments")
# fields whose flag is not the field's name in dashes (a duration is in seconds: its flag needs no unit)
FLAGS = {"grace_s": "--grace"}
# older spellings the syncer still takes (hidden; the CLI converts them), by the field they feed
OLD_FLAGS = {"--grace-ms": "grace_s", "--learners": "islands", "--max-learners": "max_islands",  # old spelling
             "--learner-timeout": "island_timeout", "--no-learner-keys": "island_keys"}  # old spelling


@dataclass
class SyncerConfig:
    port: int = 29400
    host: str = "0.0.0.0"
    islands: int = 1
    quorum: int = 1
    # plain averaging (FedAvg): DiLoCo's 0.7 / Nesterov 0.9, tuned for pre-training with hundreds of inner steps,
    # overshoots short LoRA runs (bench/convergence.py, docs/benchmarks.md: 1.51x the data-parallel loss vs 1.02x)
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    outer_steps: int = 10
    inner_steps: int = 50
    round_seconds: float = 0.0
    sync_bits: int = 4  # the islands' deltas
    broadcast_bits: Optional[int] = None  # the syncer's broadcasts (None: sync_bits)
    out: str = "runs/syncer"
    straggler_timeout: float = 120.0
    quorum_timeout: float = 1800.0
    island_timeout: float = 60.0
    max_message_mb: int = DEFAULT_MAX_MESSAGE_MB
    robust: str = "norm-clip"
    robust_k: float = DEFAULT_CLIP_K
    merge: Optional[str] = None  # yeto.sync.merge.rules.RULES (None: rda, or mean where another choice needs it)
    merge_weight: str = "loss-tokens"  # loss-tokens | tokens | steps | equal
    lora_merge: str = "factors"  # factors | product
    grace_s: float = DEFAULT_GRACE_S
    max_base_lag: Optional[int] = None  # None: DEFAULT_MAX_BASE_LAG, or 0 when streaming (--fragments > 1)
    staleness_exponent: float = DEFAULT_STALENESS_EXPONENT
    # scale each delta to the round's longest (FedNova-style): see yeto.sync.merge.rules (None: on in time-window rounds
    # under the mean, where islands of unequal speed take unequal steps)
    step_normalize: Optional[bool] = None
    merge_alpha: float = 1.0  # islands start a round from alpha x global + (1 - alpha) x their own last adapter
    # stream the adapter in this many parts, one per round (yeto.sync.wire.layout.stream_part): each round merges,
    # steps and broadcasts one part, so each part syncs every `fragments` rounds (1: the whole adapter every round)
    fragments: int = 1
    # a streamed island may push the next rounds' parts before this round's merge comes: up to `pipeline` deltas in
    # flight (each of a part the merges before its round leave alone), so slow links overlap with training
    pipeline: int = 1
    model: Optional[str] = None  # pins the run's base model (else the founding island's is the run's)
    model_revision: Optional[str] = None
    max_islands: int = DEFAULT_MAX_ISLANDS
    init_adapter: Optional[str] = None  # a new run's version 0 is this peft adapter (the shell reads it)
    # the I/O shell's (security, connections); here so that one config describes the syncer
    insecure: bool = False
    join_key: Optional[str] = None
    # on the run's first start, issue an island key to each expected id (< islands) that has none: only its own key
    # speaks for an expected id (trusted), the shared join key for the ids beyond (extra); off: the join key takes
    # expected ids too (bounded, and first come: any holder of it can take one before its island starts)
    island_keys: bool = True
    max_connections: int = 2 * DEFAULT_MAX_ISLANDS
    merge_by_default: bool = field(default=False, init=False)  # --merge unset: a resumed run keeps its own rule
    step_normalize_by_default: bool = field(default=False, init=False)  # ... and so for --step-normalize

    def __post_init__(self) -> None:
        if self.max_base_lag is None:  # a streamed round merges one part: a delta of another round's part cannot count
            self.max_base_lag = 0 if self.fragments > 1 else DEFAULT_MAX_BASE_LAG
        if self.broadcast_bits is None:
            self.broadcast_bits = self.sync_bits
        if self.step_normalize is None:  # docs/benchmarks.md, heterogeneous fleet: with a 10x slower island, mean +
            # step normalization 0.987x the fast island alone (ten runs); in one run, 0.969x against the mean's 1.025x
            rule = merge_rules().get(self.merge)  # (an unknown --merge: check names it)
            self.step_normalize = self.round_seconds > 0 and (self.merge is None or (
                rule is not None and rule.step_normalize_by_default))
            self.step_normalize_by_default = True
        if self.merge is None:  # bench/convergence.py: rda 0.98x the data-parallel loss, mean 1.02x (2 islands)
            # (rda keeps the deltas' mean norm: a slow island's short delta scaled up is mostly noise, and its norm
            # inflates the step: rda + step normalization 1.08-1.14x the fast island alone)
            mean = self.robust == "trimmed-mean" or self.lora_merge == "product" or self.step_normalize
            self.merge = MEAN if mean else DEFAULT_RULE
            self.merge_by_default = True

    def check(self) -> None:
        """Refuse a config no run can go by, naming the flag and what it takes."""
        self._check_run()
        self._check_merge()
        self._check_timing()
        if self.max_islands < self.islands or self.max_connections < 1:
            raise YetoError(f"--max-islands ({self.max_islands}) must be at least --islands ({self.islands}) and "
                            "--max-connections at least 1")

    def _check_run(self) -> None:
        """The run's shape: its port, bits, counts, rounds and timeouts."""
        check_port(self.port, "--port")
        if self.sync_bits not in BITS:
            raise YetoError(f"--sync-bits must be one of {BITS}, got {self.sync_bits}")
        if self.broadcast_bits not in BITS:
            raise YetoError(f"--broadcast-bits must be one of {BITS}, got {self.broadcast_bits}")
        if self.islands < 1 or self.quorum < 1:
            raise YetoError("--islands and --quorum must be at least 1")
        if self.quorum > self.islands:
            raise YetoError(f"--quorum {self.quorum} exceeds --islands {self.islands}: no round could ever close")
        if self.outer_steps < 1 or self.inner_steps < 1:
            raise YetoError("--outer-steps and --inner-steps must be at least 1")
        if self.round_seconds < 0:
            raise YetoError("--round-seconds must be >= 0 (0: rounds of --inner-steps steps)")
        for name in ("straggler_timeout", "quorum_timeout", "island_timeout"):
            if getattr(self, name) <= 0:
                raise YetoError(f"--{name.replace('_', '-')} must be positive")
        if self.max_message_mb < 1:
            raise YetoError("--max-message-mb must be at least 1")

    def _check_merge(self) -> None:
        """The merge rule: each choice known, and only the combinations that have a meaning."""
        if self.robust not in ROBUST_MODES:
            raise YetoError(f"--robust must be one of {', '.join(ROBUST_MODES)}, got {self.robust!r}")
        if not self.robust_k >= 1:
            raise YetoError(f"--robust-k must be at least 1 (a delta is clipped above k x the median norm), got "
                            f"{self.robust_k}")
        for flag, value, choices in (("--merge", self.merge, tuple(merge_rules())), ("--merge-weight",
                                     self.merge_weight, MERGE_WEIGHTS), ("--lora-merge", self.lora_merge, LORA_MERGES)):
            if value not in choices:
                raise YetoError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")
        if self.robust == "trimmed-mean" and self.lora_merge != "factors":  # (two merges of their own: one at most)
            raise YetoError(TRIMMED_MEAN_ALONE)
        problem = merge_rule(self.merge).check(self)  # (the rule's own: yeto.sync.merge.rules.MergeRule.check)
        if problem is not None:
            raise YetoError(problem)
        self._check_streaming()

    def _check_streaming(self) -> None:
        """--fragments: a part is a run of tensors, each merged and stepped on its own, fresh deltas only."""
        if not 1 <= self.fragments <= MAX_STREAM_PARTS:
            raise YetoError(f"--fragments must be between 1 (the whole adapter every round) and {MAX_STREAM_PARTS}, "
                            f"got {self.fragments}")
        if not 1 <= self.pipeline <= self.fragments:
            raise YetoError(f"--pipeline must be between 1 (one delta in flight) and --fragments ({self.fragments}): "
                            f"a delta pushed ahead is of a part no merge before its round touches, got {self.pipeline}")
        if self.fragments == 1:
            return
        if self.pipeline > 1 and self.round_seconds:
            raise YetoError("--pipeline pushes the next rounds' parts after their inner steps, which time-window "
                            "rounds (--round-seconds) do not fix: use --inner-steps with --pipeline, or --pipeline 1")
        if self.lora_merge == "product":
            raise YetoError("--lora-merge product needs each layer's lora_A and lora_B in one merge: use --lora-merge "
                            "factors with --fragments, or --fragments 1")
        if self.max_base_lag:
            raise YetoError(f"--fragments {self.fragments} merges only deltas of the open round's part (a late delta "
                            "is another part's): drop --max-base-lag or pass --max-base-lag 0")
        if self.merge_alpha < 1:
            raise YetoError("--merge-alpha blends the whole adapter at each round's start, and a streamed round "
                            "syncs one part: use --merge-alpha 1 with --fragments")

    def _check_timing(self) -> None:
        """The grace, and what a late delta is worth."""
        if self.grace_s < 0:
            raise YetoError(f"--grace must be >= 0 seconds (0: close a round as soon as quorum is in), got "
                            f"{self.grace_s:g}")
        if not 0 <= self.max_base_lag <= MAX_BASE_LAG:
            raise YetoError(f"--max-base-lag must be between 0 (only deltas of the open round's version) and "
                            f"{MAX_BASE_LAG}, got {self.max_base_lag}")
        if not 0 <= self.staleness_exponent <= 8:
            raise YetoError(f"--staleness-exponent must be between 0 (no discount) and 8, got "
                            f"{self.staleness_exponent}")
        if not 0 < self.merge_alpha <= 1:
            raise YetoError(f"--merge-alpha must be in (0, 1] (1: every round starts from the merged adapter), got "
                            f"{self.merge_alpha}")

    def check_resume(self, saved: dict[str, Any], version: int) -> None:
        """Refuse a restart whose flags contradict the run in the checkpoint; an unset --merge (--step-normalize)
        takes the run's own (a run started under other defaults resumes as it began)."""
        if self.merge_by_default and saved.get("merge") in tuple(merge_rules()):
            self.merge = saved["merge"]
        if self.step_normalize_by_default and saved:  # (a run from before the switch: it had none)
            self.step_normalize = saved.get("step_normalize") is True
        for name in CONTRACT_FIELDS:
            if name in saved and saved[name] != getattr(self, name):
                flag = field_flag(name)
                fix = (f"--{'' if saved[name] else 'no-'}{flag[2:]}" if isinstance(saved[name], bool)
                       else f"{flag} {saved[name]}")  # (a switch has no value)
                raise YetoError(f"{flag} {getattr(self, name)} conflicts with the checkpoint in {self.out} ({name} "
                                f"{saved[name]}): resume with {fix}, or start a new run with another --out")
        if self.outer_steps < version:
            raise YetoError(f"--outer-steps {self.outer_steps} is below the checkpoint's version {version} in "
                            f"{self.out}: pass --outer-steps {version} or more to resume")

    @property
    def heartbeat_s(self) -> float:
        return self.island_timeout / HEARTBEATS_PER_TIMEOUT

    def round_policy(self) -> RoundPolicy:
        """The round policy this config sets (what a round asks of an island is its `steps_for`)."""
        return RoundPolicy(**{f.name: getattr(self, f.name) for f in fields(RoundPolicy)})

    def policy(self) -> dict[str, Any]:
        """The welcome's `policy`: every `RoundPolicy` field, from this config (the island reads it back)."""
        return self.round_policy().wire()

    @property
    def versions_kept(self) -> int:
        """How many versions back a delta may have trained from (the round policy's)."""
        return self.round_policy().versions_kept

    @property
    def grace_cap_s(self) -> float:
        return min(self.grace_s, self.straggler_timeout)

    def pinned(self) -> dict[str, Any]:
        """The contract fields fixed by the syncer's flags rather than by the founding island."""
        pinned = {"base_model": self.model, "base_revision": self.model_revision}
        return {k: v for k, v in pinned.items() if v is not None}


def field_flag(name: str) -> str:
    """The command-line flag of the config field `name` (`yeto launch` routes the syncer's flags by it)."""
    return FLAGS.get(name, "--" + name.replace("_", "-"))
