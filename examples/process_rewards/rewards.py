"""A process reward for the built-in long_addition task, written as a user writes one for rlpipe: every step of a worked
sum is checked exactly.

The task asks `4821+3567=` and its answers work the sum column by column, least significant first, one step per
column and a last step with the result: `1+7+0=08;2+6+0=08;8+5+0=13;4+3+1=08;#### 8388`. With `reward.steps:
{delimiter: ";"}` rlpipe passes those steps as `steps`, and `column_steps` returns one score per step (docs/
train-your-own-model.md, "Process rewards").
"""

import re

PROBLEM = re.compile(r"(\d+)\+(\d+)=\s*$")


def worked_columns(a: int, b: int, digits: int) -> list[str]:
    """The right step for each column: its digits, the carry it receives, and their two-digit sum."""
    out, carry = [], 0
    for i in range(digits):
        x, y = a // 10**i % 10, b // 10**i % 10
        out.append(f"{x}+{y}+{carry}={x + y + carry:02d}")
        carry = (x + y + carry) // 10
    return out


def column_steps(prompt: str, steps: list[str], ground_truth: str) -> list[float]:
    """1 for each step that is exactly the right column (digits, carry-in and sum) or, after the columns, the right
    result (`#### <sum>`); 0 for a wrong step and for every step past where the answer should end. A dropped carry
    costs the column that dropped it, and the result, but not the columns before it."""
    m = PROBLEM.search(prompt)
    if m is None:
        raise ValueError(f"not a long_addition prompt: {prompt[-40:]!r}")
    a, b = int(m[1]), int(m[2])
    digits = max(len(m[1]), len(m[2]))
    want = [*worked_columns(a, b, digits), f"#### {ground_truth}"]
    return [float(k < len(want) and step.strip().rstrip(";") == want[k]) for k, step in enumerate(steps)]
