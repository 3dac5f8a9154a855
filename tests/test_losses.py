import math
import sys
import textwrap

import pytest
import torch

from yeto import YetoError
from yeto.backends.torch.losses import load_loss_function, sft_loss


def test_sft_loss_matches_a_hand_computed_value():
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 1.0, 3.0]])
    targets = torch.tensor([0, 2, 2])
    weights = torch.tensor([1.0, 0.0, 2.0])

    def ce(row, t):
        return -row[t] + math.log(sum(math.exp(v) for v in row))

    rows = logits.tolist()
    want = (1.0 * ce(rows[0], 0) + 2.0 * ce(rows[2], 2)) / 3.0
    assert sft_loss(logits, targets, weights).item() == pytest.approx(want, rel=1e-6)
    # token-weighted, not row-averaged: the zero-weight row changes nothing
    assert sft_loss(logits[[0, 2]], targets[[0, 2]], weights[[0, 2]]).item() == pytest.approx(want, rel=1e-6)


def test_sft_loss_gradient_flows_only_through_weighted_rows():
    logits = torch.randn(4, 7, requires_grad=True)
    sft_loss(logits, torch.tensor([1, 2, 3, 4]), torch.tensor([1.0, 0.0, 1.0, 0.0])).backward()
    assert logits.grad[1].abs().sum() == 0 and logits.grad[3].abs().sum() == 0
    assert logits.grad[0].abs().sum() > 0


def test_user_loss_function_loads(tmp_path, monkeypatch):
    (tmp_path / "myloss.py").write_text(textwrap.dedent("""
        def half(logits, targets, weights):
            from yeto.backends.torch.losses import sft_loss
            return 0.5 * sft_loss(logits, targets, weights)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_loss_function("myloss:half")
    logits, t, w = torch.randn(3, 5), torch.tensor([0, 1, 2]), torch.ones(3)
    assert fn(logits, t, w).item() == pytest.approx(0.5 * sft_loss(logits, t, w).item())
    assert load_loss_function("cross_entropy") is sft_loss
    with pytest.raises(YetoError, match="unknown --loss-function"):
        load_loss_function("focal")
    with pytest.raises(YetoError, match="cannot import module"):
        load_loss_function("no_such_module_xyz:f")
    with pytest.raises(YetoError, match="no callable 'nope'"):
        load_loss_function("myloss:nope")
    sys.modules.pop("myloss", None)


def test_a_loss_from_a_file_loads_and_its_contents_pin_it(tmp_path):
    from yeto.models.provenance import loss_identity

    path = tmp_path / "my_loss.py"
    path.write_text("from yeto.backends.torch.losses import sft_loss\n\ndef fn(logits, targets, weights):\n"
                    "    return 2 * sft_loss(logits, targets, weights)\n")
    fn = load_loss_function(f"{path}:fn")
    logits, targets, weights = torch.randn(3, 5), torch.tensor([0, 1, 2]), torch.ones(3)
    torch.testing.assert_close(fn(logits, targets, weights), 2 * sft_loss(logits, targets, weights))
    first = loss_identity(f"{path}:fn")
    assert first.startswith("fn@sha256:")
    path.write_text(path.read_text().replace("2 *", "3 *"))  # same name, other code: another loss
    assert loss_identity(f"{path}:fn") != first
    assert loss_identity("cross_entropy") == "cross_entropy"
    with pytest.raises(YetoError, match="cannot import"):
        load_loss_function(f"{tmp_path / 'missing.py'}:fn")
