"""Scoring a task's answers: extraction, normalized exact match, user scorers, and the intervals reported with them.

Accuracy is the mean score over the examples (a scorer may give partial credit in [0, 1]); its interval is Wilson's
score interval, which stays inside [0, 1] and is honest at 0% and 100% where the normal approximation collapses. Two
models scored on the same examples are compared pairwise: the interval of the mean per-example difference, which is
much narrower than the difference of two independent intervals when the models agree on most examples.
"""

from __future__ import annotations

import math
import re
import unicodedata
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from yeto import YetoError

Scorer = Callable[[str, str, dict], float]  # (extracted answer, reference, the task record) -> score in [0, 1]
Z95 = 1.959963984540054  # the standard normal's 97.5th percentile: two-sided 95% intervals

ANSWER_TAG = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.IGNORECASE | re.DOTALL)
ANSWER_IS = re.compile(r"\banswer\b[^\n:]{0,40}?(?:\bis\b:?|:)\s*(.+)", re.IGNORECASE)  # "the answer (to X) is"
GSM_MARK = "####"  # GSM8K's marker before a final answer
NUMBER = re.compile(r"^[-+]?\$?\d[\d,]*(\.\d+)?%?$")
EDGE_PUNCTUATION = " \t\n.,;:!?\"'`*"


def extract_answer(output: str) -> str:
    """The answer in a model's output: inside `<answer>` tags, after `####` or "the answer is", else its first
    non-empty line (a short-answer task's answer is the first thing the model says)."""
    tag = ANSWER_TAG.search(output)
    if tag:
        return tag.group(1).strip()
    if GSM_MARK in output:
        return output.rsplit(GSM_MARK, 1)[1].strip()
    said = ANSWER_IS.findall(output)
    if said:
        return _sentence_end(said[-1])
    for line in output.splitlines():
        if line.strip():
            return _sentence_end(line)
    return ""


def _sentence_end(text: str) -> str:
    """A sentence's answer without the full stop that ends it ("is 5." says 5; "3.5" stays)."""
    text = text.strip()
    return text[:-1].rstrip() if text.endswith(".") and not text.endswith("..") else text


def normalize(text: str) -> str:
    """Case, surrounding quotes and punctuation, repeated spaces, and a number's `$`, `%` and thousands separators
    do not count; anything else does."""
    t = unicodedata.normalize("NFKC", text).strip().strip(EDGE_PUNCTUATION).lower()
    t = re.sub(r"\s+", " ", t)
    if NUMBER.match(t):
        t = t.replace(",", "").replace("$", "").rstrip("%")
        try:
            value = float(t)
            t = str(int(value)) if value.is_integer() else repr(value)
        except ValueError:
            pass
    return t


def exact_match(answer: str, reference: str, record: dict) -> float:
    """1.0 when the answer equals the reference once both are normalized (`normalize`), else 0.0."""
    return float(normalize(answer) == normalize(reference))


def load_scorer(spec: str) -> Scorer:
    """`exact_match`, or a user's `module:function` / `path/to/file.py:function` taking (answer, reference, record)
    and returning a score in [0, 1] (loaded as a custom loss is)."""
    if spec == "exact_match":
        return exact_match
    from yeto.models.user_code import load_user_function

    return load_user_function(spec, "--scorer")


def checked_score(scorer: Scorer, answer: str, reference: str, record: dict, where: str) -> float:
    """The scorer's score, or a one-line error naming the example when it raises or gives no number in [0, 1]."""
    try:
        value = scorer(answer, reference, record)
    except Exception as e:
        raise YetoError(f"the scorer failed on {where} ({type(e).__name__}: {e})") from e
    if isinstance(value, bool):
        value = float(value)
    if not isinstance(value, (int, float)) or not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise YetoError(f"the scorer gave {value!r} for {where}: a score must be a number in [0, 1]")
    return float(value)


@dataclass(frozen=True)
class Interval:
    """A point estimate with its 95% interval."""

    value: float
    low: float
    high: float

    def text(self, percent: bool = True, signed: bool = False) -> str:
        f = (lambda x: f"{100 * x:{'+' if signed else ''}.1f}") if percent else (lambda x: f"{x:.3f}")
        return f"{f(self.value)} [{f(self.low)}, {f(self.high)}]" + ("%" if percent else "")

    def as_dict(self) -> dict[str, float]:
        return {"value": self.value, "low": self.low, "high": self.high}


def wilson_interval(successes: float, n: int, z: float = Z95) -> Interval:
    """Wilson's score interval for a proportion (partial credit counts as a fractional success)."""
    if n <= 0:
        return Interval(float("nan"), float("nan"), float("nan"))
    p = successes / n
    denominator = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return Interval(p, max(0.0, min(p, center - half)), min(1.0, max(p, center + half)))  # (rounding at 0, 1)


def paired_difference(a: Sequence[float], b: Sequence[float], z: float = Z95) -> Interval:
    """Mean of b - a over the same examples, with the normal interval of a paired difference."""
    if len(a) != len(b):
        raise ValueError(f"paired scores of different lengths ({len(a)} and {len(b)})")
    n = len(a)
    if n == 0:
        return Interval(float("nan"), float("nan"), float("nan"))
    d = [y - x for x, y in zip(a, b)]
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / (n - 1) if n > 1 else 0.0
    half = z * math.sqrt(var / n)
    return Interval(mean, mean - half, mean + half)


def summary(scores: Sequence[float]) -> dict[str, Any]:
    """{n, accuracy, low, high} of a list of scores."""
    ci = wilson_interval(sum(scores), len(scores))
    return {"n": len(scores), "accuracy": ci.value, "low": ci.low, "high": ci.high}
