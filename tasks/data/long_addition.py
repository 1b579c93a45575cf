"""Built-in example task with long answers: multi-digit addition worked column by column, least significant first.

`4821+3567=` → `1+7+0=08;2+6+0=08;8+5+0=13;4+3+1=08;#### 8388` (46 tokens with EOS, for 4 digits). Every column
is written the same width (`a+b+carry=sum`, two-digit sum), so each digit sits at a fixed offset; the final answer
after `####` is what the reward judges (math-verify, the GSM8K convention). A flawed teacher drops the carry-in of a
column (`4+3+0=07`), which makes its final answer wrong: a mistake a verifier-driven RL step can unlearn.
"""

from __future__ import annotations

import random

import polars as pl

FLAWS = ("none", "forget_carry")


def worked_sum(a: int, b: int, digits: int, forget_carry_at: frozenset[int] = frozenset()) -> str:
    """The worked response; columns listed in `forget_carry_at` drop their carry-in (a flawed teacher)."""
    steps, carry, out = [], 0, []
    for i in range(digits):
        x, y = a // 10**i % 10, b // 10**i % 10
        c = 0 if i in forget_carry_at else carry
        s = x + y + c
        steps.append(f"{x}+{y}+{c}={s:02d}")
        out.append(s % 10)
        carry = s // 10
    total = int("".join(map(str, reversed(out)))) + carry * 10**digits
    return ";".join(steps) + f";#### {total}"


def carry_columns(a: int, b: int, digits: int) -> list[int]:
    """Columns that receive a carry from the column before."""
    cols, carry = [], 0
    for i in range(digits):
        if carry:
            cols.append(i)
        carry = (a // 10**i % 10 + b // 10**i % 10 + carry) // 10
    return cols


def teacher(a: int, b: int, digits: int, flaw: str, rate: float, rnd: random.Random) -> str:
    """A demonstration: correct, or (forget_carry) with each carried column's carry dropped with probability `rate`.
    Draws happen only where a carry exists, so `rate` is the error rate where the flaw applies."""
    dropped = frozenset(c for c in carry_columns(a, b, digits) if flaw == "forget_carry" and rnd.random() < rate)
    return worked_sum(a, b, digits, dropped)


def make_files(
    digits: int, n_train: int, n_eval: int, seed: int, sft_demos: int, flaw: str, rate: float
) -> dict[str, pl.DataFrame]:
    """train and eval prompt files (prompt_id, prompt, answer: the final sum) and sft demonstrations."""
    rnd = random.Random(seed)
    low, high = 10 ** (digits - 1), 10**digits - 1
    seen: set[tuple[int, int]] = set()
    while len(seen) < n_train + n_eval:
        seen.add((rnd.randint(low, high), rnd.randint(low, high)))
    problems = sorted(seen)
    rnd.shuffle(problems)

    def prompts(pairs, prefix):
        return pl.DataFrame(
            {
                "prompt_id": [f"{prefix}-{i:06d}" for i in range(len(pairs))],
                "prompt": [f"{a}+{b}=" for a, b in pairs],
                "answer": [str(a + b) for a, b in pairs],
            }
        )

    train, held_out = problems[n_eval:], problems[:n_eval]
    demo_rnd = random.Random(seed + 1)
    picked = demo_rnd.choices(train, k=sft_demos)
    sft = pl.DataFrame(
        {
            "prompt_id": [f"demo-{i:06d}" for i in range(sft_demos)],
            "prompt": [f"{a}+{b}=" for a, b in picked],
            "response": [teacher(a, b, digits, flaw, rate, demo_rnd) for a, b in picked],
        }
    )
    return {"train": prompts(train, "train"), "eval": prompts(held_out, "eval"), "sft": sft}
