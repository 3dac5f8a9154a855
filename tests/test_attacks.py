"""A join-key holder trying to steer the merge, on a real CURVE syncer on loopback (docs/SECURITY.md's threat table).

Honest islands push along one direction (+0.01 on every value, as the red team's did); the attacker pushes against
it with claims and deltas chosen to pull hardest. Each test measures the global's move along the honest direction
after ROUNDS merges and asserts the bound docs/SECURITY.md states: per merge, one island among n moves the global
by at most its bounded weight x k x the clip's reference norm (k = --robust-k, the reference at most an honest norm),
and no claim raises its weight above the round's median delta's.
"""

from dataclasses import dataclass

import numpy as np
import pytest

from tests.peers import QuadraticIsland, RawIsland, wait_until
from yeto.sync.merge.aggregate import DEFAULT_CLIP_K
from yeto.sync.shell.audit import audit
from yeto.sync.shell.keys import Keyring
from yeto.sync.merge.rules import MAX_UNTRUSTED_STEP_GAIN
from yeto.sync.shell.tape import read_tape

ROUNDS = 10
HONEST_STEP = 0.01  # each honest delta: +0.01 on every value (a norm of 0.01 x sqrt(numel))
HONEST_TOKENS = 100
MERGE_TIMEOUT_S = 10.0


@dataclass
class Attack:
    """What the attacker declares and pushes each round: `against` x HONEST_STEP on every value (negative: against
    the honest direction), with these claims."""

    against: float
    tokens: int = HONEST_TOKENS
    steps: int = 2
    tokens_per_step: int = 64
    steer: float = 0.0  # plus this share of its length across the honest direction (alternating signs per tensor)
    ids: int = 1  # island ids it holds, all pushing the same
    extra: bool = False  # its ids are beyond --islands (the run expects the honest islands only)


def run(start_syncer, tmp_path, honest: int, attack: Attack | None, trusted: bool = False,
        **syncer_kw) -> tuple[float, list[dict], float]:
    """ROUNDS merges of `honest` islands (and the attacker, last, on the join key): the global's mean move, the
    tape's merges, and how far (L2) the global ends from where the honest islands alone take it. `trusted`: the
    honest islands on keys of their own (as `yeto launch` starts them), else the join key."""
    n = honest + (attack.ids if attack is not None else 0)
    expected = honest if attack is not None and attack.extra else n
    out = tmp_path / f"syncer-{honest}-{attack}-{trusted}"
    own = {i: Keyring.ensure(out).own_key(i) for i in range(honest)} if trusted else {}
    syncer, port = start_syncer(insecure=False, islands=expected, quorum=expected, outer_steps=ROUNDS, sync_bits=32,
                                outer_lr=1.0, outer_momentum=0.0, out=out, **syncer_kw)
    state = QuadraticIsland(0.0, 1).state
    peers = [RawIsland(port, i, key=own.get(i, syncer.keys.join)) for i in range(n)]
    try:
        layout = peers[0].found(state)
        for i, p in enumerate(peers[1:], start=1):
            tps = attack.tokens_per_step if attack is not None and i >= honest else 64
            p.ctl.send_multipart(p.hello_parts(state, tokens_per_step=tps)[0])
            assert p.recv(want="welcome")
        g0 = syncer.global_.copy()
        for r in range(1, ROUNDS + 1):
            for i, p in enumerate(peers):
                hostile = attack is not None and i >= honest
                value = HONEST_STEP * (attack.against if hostile else 1.0)
                tokens, steps = (attack.tokens, attack.steps) if hostile else (HONEST_TOKENS, 2)
                delta = np.full(layout.numel, value, np.float32)
                if hostile and attack.steer:
                    delta += (abs(value) * attack.steer * across(layout.numel)).astype(np.float32)
                parts = p.delta_parts(layout, r, r - 1, delta, tokens=tokens, loss_tokens=tokens, steps=steps)
                assert p.ask(parts, bulk=True, want="ack", timeout=MERGE_TIMEOUT_S).header["merge_round"] == r
            assert wait_until(lambda: syncer.version == r, MERGE_TIMEOUT_S), f"round {r} never merged"
        assert wait_until(lambda: sum(e["event"] == "merge" for e in read_tape(syncer.cfg.out)) == ROUNDS)
        tape = read_tape(syncer.cfg.out)
        assert audit(tape).ok, audit(tape).summary()  # (the audit checks each merge's bounds from the tape)
        shift = float(np.linalg.norm(syncer.global_ - (g0 + ROUNDS * HONEST_STEP)))
        return float(np.mean(syncer.global_ - g0)), [e for e in tape if e["event"] == "merge"], shift
    finally:
        for p in peers:
            p.close()


def across(numel: int) -> np.ndarray:
    """+1, -1, +1, ...: orthogonal to the honest direction (all +1) in every tensor of an even size."""
    return np.where(np.arange(numel) % 2 == 0, 1.0, -1.0)


def honest_delta_norm() -> float:
    """The L2 norm of one honest delta (HONEST_STEP on every value of the islands' adapter)."""
    return HONEST_STEP * float(np.sqrt(sum(v.size for v in QuadraticIsland(0.0, 1).state.values())))


def bound(honest: int) -> float:
    """How far one attacker among honest + 1 islands can pull the global from where the honest islands alone take
    it in ROUNDS merges (docs/SECURITY.md): per merge, its weight is at most 1/n of it, which it takes from the
    honest delta (h) and gives to its own, clipped to at most k x the reference (an honest norm): (1 + k) h / n."""
    return ROUNDS * (1 + DEFAULT_CLIP_K) * HONEST_STEP / (honest + 1)


def assert_fair_weights(merges: list[dict], attacker: int) -> None:
    """The attacker's counted claim is at most the round's low median (here an honest claim)."""
    for m in merges:
        counted = dict(zip(m["responders"], m["counted"]))
        assert counted[attacker] <= min(c for lid, c in counted.items() if lid != attacker)


def test_a_weight_claim_buys_no_more_than_the_median_weight(start_syncer, tmp_path):
    """The red team's 'weight by claim': no declared tokens per step, 2^40 tokens claimed per delta, a delta 3.99x the
    honest norm (under the clip) against the honest direction. It had weights [9e-11, 9e-11, 1.0] and moved the global
    -0.40 in 10 rounds; now it weighs as the median delta."""
    alone, _, _ = run(start_syncer, tmp_path, 2, None, inner_steps=2)
    assert alone == pytest.approx(ROUNDS * HONEST_STEP, rel=1e-4)  # +0.10: the honest-only progress
    move, merges, _ = run(start_syncer, tmp_path, 2, Attack(-3.99, tokens=2**40, tokens_per_step=0), inner_steps=2)
    assert_fair_weights(merges, attacker=2)
    assert all(max(m["weights"]) == pytest.approx(1 / 3) for m in merges)
    assert abs(alone - move) <= bound(2) * (1 + 1e-4)
    print(f"weight claim: honest alone {alone:+.4f}, with the attacker {move:+.4f} (bound {bound(2):.4f})")


def test_a_two_island_fleet_clips_the_outlier(start_syncer, tmp_path):
    """The red team's pair: one island pushing 1000x the honest norm (it ended at |global| 17). The clip's low
    median is the honest norm: the outlier merges at k x it."""
    alone, _, _ = run(start_syncer, tmp_path, 1, None, inner_steps=2)
    move, merges, _ = run(start_syncer, tmp_path, 1, Attack(-1000.0), inner_steps=2)
    assert all(m["clip"].get("1", 1.0) == pytest.approx(DEFAULT_CLIP_K / 1000, rel=1e-4) for m in merges)
    assert all(max(m["merged_norms"]) <= DEFAULT_CLIP_K * m["clip_ref"] * (1 + 1e-6) for m in merges)
    assert abs(alone - move) <= bound(1) * (1 + 1e-4)
    assert abs(move) < 0.2  # (unclipped: -5.0 after 10 rounds)
    print(f"pair outlier: honest alone {alone:+.4f}, with the attacker {move:+.4f} (bound {bound(1):.4f})")


def test_a_zero_delta_never_freezes_a_pair_and_a_tiny_one_cannot_deflate_trusted_islands(start_syncer, tmp_path):
    """A delta of norm 0 (a join-key holder's, or an honest island's whose delta happens to be exactly zero) set the
    clip reference to 0: every other delta was clipped to nothing, and the zeros kept in the history kept it there
    (+0.000 in 10 rounds, against +0.10 honest alone). A zero norm is no step's norm: the pair now moves as half its
    deltas do. A tiny delta (1e-6 of the honest norm) from the join key beside a trusted island cannot lower the
    reference either: it is the trusted norms' alone."""
    alone, _, _ = run(start_syncer, tmp_path, 1, None, inner_steps=2)
    zero, merges, _ = run(start_syncer, tmp_path, 1, Attack(0.0), inner_steps=2)
    assert all(not m["clip"] and m["clip_ref"] > 0 for m in merges)
    assert zero == pytest.approx(alone / 2, rel=1e-3)  # (rda: the honest delta's direction at half its weight)
    tiny, merges, _ = run(start_syncer, tmp_path, 1, Attack(1e-6), trusted=True, inner_steps=2)
    assert all(m["tiers"] == ["trusted", "bounded"] and not m["clip"] for m in merges)
    assert tiny >= 0.4 * alone
    print(f"zero delta: honest alone {alone:+.4f}, with a zero delta {zero:+.4f}, with a tiny bounded one beside a "
          f"trusted island {tiny:+.4f}")


def test_zero_and_tiny_deltas_in_a_fleet_of_four_take_no_more_than_their_share(start_syncer, tmp_path):
    """In a fleet of 4 on the join key, a zero delta or a tiny one (1e-6 of the honest norm) is one vote among four:
    the clip reference is the honest norm (the low median of the nonzero norms), nothing is clipped, and the global
    moves 3/4 of the honest progress, not 0."""
    alone, honest, _ = run(start_syncer, tmp_path, 3, None, inner_steps=2)
    for attack in (Attack(0.0), Attack(1e-6)):
        move, merges, _ = run(start_syncer, tmp_path, 3, attack, inner_steps=2)
        assert all(not m["clip"] and m["clip_ref"] == pytest.approx(honest[0]["clip_ref"]) for m in merges)
        assert move == pytest.approx(0.75 * alone, rel=1e-3)
        print(f"fleet of 4, a delta of {attack.against:g}x the honest one: {move:+.4f} (honest alone {alone:+.4f})")


def test_one_holders_extra_ids_weigh_one_median_claim_together(start_syncer, tmp_path):
    """The red team's 'the bound is per id': 3 ids of one join-key holder beside 2 honest islands owned every low
    median (-5.66 under rda, -5.96 under the mean in 10 rounds, nothing clipped). Ids beyond --islands are extra:
    left out of the medians, together one median claim's weight, so the holder moves the global as one island of
    three would: within (1 + k) h / 3 a round of the honest progress under the mean, h + (2 h + k h) / 3 under RDA."""
    honest_norm = honest_delta_norm()
    attack = Attack(-1000.0, tokens=2**40, tokens_per_step=0, ids=3, extra=True)
    mean_move, merges, mean_shift = run(start_syncer, tmp_path / "mean", 2, attack, inner_steps=2, merge="mean")
    for m in merges:
        assert m["tiers"] == ["bounded", "bounded", "extra", "extra", "extra"] and len(m["clip"]) == 3
        assert sum(m["counted"][2:]) == pytest.approx(HONEST_TOKENS)  # the three together: one median claim
    rda_move, _, rda_shift = run(start_syncer, tmp_path / "rda", 2, attack, inner_steps=2, merge="rda")
    assert mean_shift <= ROUNDS * (1 + DEFAULT_CLIP_K) * honest_norm / 3 * (1 + 1e-4)
    assert rda_shift <= ROUNDS * (honest_norm + (2 + DEFAULT_CLIP_K) * honest_norm / 3) * (1 + 1e-4)
    print(f"3 extra ids of one holder, 1000x against: the mean {mean_move:+.4f} (shift {mean_shift / honest_norm:.1f} "
          f"honest norms), rda {rda_move:+.4f} (shift {rda_shift / honest_norm:.1f}); honest alone +0.1000")


def test_trusted_islands_weigh_by_their_tokens_and_the_join_key_stays_bounded(start_syncer, tmp_path):
    """The operator's own islands (island keys) are trusted, their claims counted as claimed (tests/test_fleet.py:
    a 10x slower island weighs about a tenth); a join-key holder beside them claiming 2^40 tokens still counts as
    the round's low median claim, and moves the global no further than the bound."""
    move, merges, _ = run(start_syncer, tmp_path, 2, Attack(-3.99, tokens=2**40, tokens_per_step=0), trusted=True,
                       inner_steps=2)
    for m in merges:
        counted = dict(zip(m["responders"], m["counted"]))
        assert m["tiers"] == ["trusted", "trusted", "bounded"] and counted[2] <= HONEST_TOKENS
    assert abs(ROUNDS * HONEST_STEP - move) <= bound(2) * (1 + 1e-4)
    print(f"weight claim beside trusted islands: {move:+.4f} (honest alone {ROUNDS * HONEST_STEP:+.4f})")


def test_a_step_claim_scales_honest_deltas_by_a_bounded_factor(start_syncer, tmp_path):
    """The red team's 'step normalization by claim': in time-window rounds (step normalization on) one island
    claiming 10^7 inner steps set the round's length and every honest delta was scaled by 10^6 (|global| 1e5 after
    10 rounds); capped at 16x the median claim, it still drove honest progress 10.7x. Now a claim on the join key makes
    the round at most MAX_UNTRUSTED_STEP_GAIN x the others' longest claim: the honest deltas go at most 2x as far."""
    window = {"round_seconds": 0.2, "straggler_timeout": 5.0}
    alone, _, _ = run(start_syncer, tmp_path, 2, Attack(1.0), **window)  # (the third island honest: +0.10)
    move, merges, _ = run(start_syncer, tmp_path, 2, Attack(1.0, steps=10**7), **window)
    assert all(m["step_normalize"] for m in merges)
    assert alone == pytest.approx(ROUNDS * HONEST_STEP, rel=1e-4)
    assert alone < move <= MAX_UNTRUSTED_STEP_GAIN * alone * (1 + 1e-4)  # at most 2x the honest progress
    print(f"step claim: with the attacker {move:+.4f} (honest alone {alone:+.4f}, bound "
          f"{MAX_UNTRUSTED_STEP_GAIN * alone:+.4f})")


def test_rda_with_a_clipped_outlier_steers_the_direction_within_its_own_bound(start_syncer, tmp_path):
    """The red team's 'RDA exceeds the stated bound': the rule averages lengths and directions apart, so a clipped
    outlier keeps its whole vote on direction. In a pair, a delta 1000x the honest norm pointing almost against
    the honest one (a 5% share across it) cancels the honest direction and leaves the sideways remainder, carried
    at the clipped lengths' mean. Per merge one island among n moves the global at most h + ((n - 1) h + k ref) / n
    from the honest update h under RDA (any direction, at the radial mean), against (h + k ref) / n under the mean."""
    honest_norm = honest_delta_norm()
    attack = Attack(-1000.0, steer=0.05)
    mean_move, _, mean_shift = run(start_syncer, tmp_path / "mean", 1, attack, inner_steps=2, merge="mean")
    rda_move, merges, rda_shift = run(start_syncer, tmp_path / "rda", 1, attack, inner_steps=2, merge="rda")
    assert all(m["merge"] == "rda" and m["clip"] for m in merges)  # the outlier was clipped, every round
    mean_bound = ROUNDS * (1 + DEFAULT_CLIP_K) * honest_norm / 2
    rda_bound = ROUNDS * (honest_norm + (1 + DEFAULT_CLIP_K) * honest_norm / 2)
    assert mean_shift <= mean_bound * (1 + 1e-4)
    assert mean_bound < rda_shift <= rda_bound * (1 + 1e-4)  # (the steering is real: the mean's bound is not RDA's)
    print(f"rda, clipped outlier steering: shift {rda_shift / honest_norm:.1f} honest norms (bound "
          f"{rda_bound / honest_norm:.1f}), along the honest direction {rda_move:+.4f}; the mean: shift "
          f"{mean_shift / honest_norm:.1f} (bound {mean_bound / honest_norm:.1f}), {mean_move:+.4f}")


def test_a_fresh_id_flood_leaves_room_for_a_real_island_and_nothing_behind(start_syncer, tmp_path):
    """The red team's fresh-id flood: a join-key holder filled --max-islands with fresh ids in seconds, a real new
    island got `busy`, and every fake id stayed in the checkpoint. Now ids beyond --islands come at most
    FRESH_IDS_PER_WINDOW per key holder and never take the share kept for the run's expected ids; one connection
    speaks for one id; and ids that delivered nothing expire once gone."""
    from yeto.sync.core.state import FRESH_IDS_PER_WINDOW
    from yeto.sync.wire.protocol import encode

    syncer, port = start_syncer(insecure=False, islands=2, quorum=2, outer_steps=2, inner_steps=2, sync_bits=32,
                                max_islands=8, island_timeout=1.5, out=tmp_path / "syncer")
    key, state = syncer.keys.join, QuadraticIsland(0.0, 1).state
    founder = RawIsland(port, 0, key=key)
    layout = founder.found(state)
    flood = [RawIsland(port, 100 + i, key=key) for i in range(FRESH_IDS_PER_WINDOW + 8)]
    answers = []
    for f in flood:
        f.ctl.send_multipart(f.hello_parts(state, tokens_per_step=64)[0])
        answers.append(f.recv(timeout=MERGE_TIMEOUT_S))
    welcomed = [a for a in answers if a.type == "welcome"]
    busy = [a for a in answers if a.type == "error" and a.header["code"] == "busy"]
    assert len(welcomed) == 8 - 2 and len(welcomed) + len(busy) == len(flood)  # the expected ids' share is kept
    assert any("new island ids" in a.header["reason"] for a in busy)  # (the key's rate, after the share)
    honest = RawIsland(port, 1, key=key)
    honest.ctl.send_multipart(honest.hello_parts(state, tokens_per_step=64)[0])
    assert honest.recv(want="welcome")  # a real island gets in during the flood
    liar = flood[0]
    liar.ctl.send_multipart(encode("hello", {**json_header(liar.hello_parts(state)[0]), "island": 999}))
    err = liar.recv(want="error")
    assert err.header["code"] == "identity" and "one connection per island" in err.header["reason"]
    for p in (founder, honest):
        assert p.ask(p.delta_parts(layout, 1, 0, np.full(layout.numel, HONEST_STEP, np.float32), steps=2),
                     bulk=True, want="ack")
    assert wait_until(lambda: syncer.version == 1, MERGE_TIMEOUT_S)
    for f in flood:
        f.close()
    assert wait_until(lambda: not [i for i in syncer.core.state.seen if i >= 100], 10.0), sorted(syncer.core.state.seen)
    assert not [i for i in syncer.core.state.owners if i >= 100]
    ck = syncer.core.state.checkpoint()
    assert set(ck.members) <= {0, 1} and set(ck.owners) <= {0, 1}  # the checkpoint keeps nothing of the flood
    founder.close()
    honest.close()


def test_extra_ids_never_close_a_round_by_themselves(start_syncer, tmp_path):
    """The red team's 'extra ids close rounds': two ids beyond --islands on the join key pushed at each round's
    open and merged alone in 58 of 59 rounds (--quorum 1 needs only one). Now only the expected ids' deltas make a
    quorum: however fast the extras answer, each round waits for the honest island and merges it (no grace helps:
    --grace 0 closes a round the moment its quorum is in)."""
    syncer, port = start_syncer(insecure=False, islands=1, quorum=1, outer_steps=3, inner_steps=2, sync_bits=32,
                                grace_s=0.0, out=tmp_path / "syncer")
    key, state = syncer.keys.join, QuadraticIsland(0.0, 1).state
    honest = RawIsland(port, 0, key=key)
    layout = honest.found(state)
    extras = [RawIsland(port, lid, key=key) for lid in (1, 2)]
    for p in extras:
        p.ctl.send_multipart(p.hello_parts(state, tokens_per_step=64)[0])
        assert p.recv(want="welcome")
    try:
        for r in (1, 2, 3):
            for p in extras:  # against the honest direction, the moment the round opens
                assert p.ask(p.delta_parts(layout, r, r - 1, np.full(layout.numel, -HONEST_STEP, np.float32),
                                           steps=2), bulk=True, want="ack", timeout=MERGE_TIMEOUT_S)
            assert not wait_until(lambda: syncer.version == r, 1.0)  # the extras' deltas alone close nothing
            assert honest.ask(honest.delta_parts(layout, r, r - 1, np.full(layout.numel, HONEST_STEP, np.float32),
                                                 steps=2), bulk=True, want="ack", timeout=MERGE_TIMEOUT_S)
            assert wait_until(lambda: syncer.version == r, MERGE_TIMEOUT_S)
        assert wait_until(lambda: sum(e["event"] == "merge" for e in read_tape(syncer.cfg.out)) == 3)  # (the shell
        # writes a merge's record after the core's version moved)
        merges = [e for e in read_tape(syncer.cfg.out) if e["event"] == "merge"]
        assert [sorted(m["responders"]) for m in merges] == [[0, 1, 2]] * 3
        assert all(m["tiers"] == ["bounded", "extra", "extra"] for m in merges)
    finally:
        for p in [honest, *extras]:
            p.close()


def json_header(parts: list[bytes]) -> dict:
    """A message's header fields (its frame 0, less the protocol's own)."""
    import json

    h = json.loads(parts[0])
    return {k: v for k, v in h.items() if k not in ("v", "type")}
