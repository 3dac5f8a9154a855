"""Check that the torch (peft) and MLX backends build the same LoRA adapter for a model.

    python scripts/check_name_parity.py --model smollm2-135m [--lora-targets auto] [--lora-r 16]

Prints the count of trainable tensors on each side and every name or shape
mismatch; exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="model alias or local HF directory")
    p.add_argument("--lora-targets", default="auto")
    p.add_argument("--lora-r", type=int, default=16)
    a = p.parse_args()
    from yeto import YetoError
    from yeto.backends.parity import name_parity

    try:
        n_torch, n_mlx, problems = name_parity(a.model, a.lora_targets, a.lora_r)
    except YetoError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{a.model}: torch {n_torch} trainable tensors, MLX {n_mlx} trainable tensors")
    for line in problems:
        print("  " + line)
    print("name parity: OK" if not problems else f"name parity: {len(problems)} mismatch(es)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
