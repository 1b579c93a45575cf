"""Build the code example's data offline: small Python programming tasks as chat prompts, each with its tests.

    python examples/code_tests/make_data.py [--out examples/code_tests/data] [--train 384] [--eval 64]

Three candidate tasks, each in its own folder (train.parquet, eval.parquet), so that a model's baseline can be
measured on all three before one is chosen for RL (docs/reward-sources.md, "Code rewards"):

- functions: "Write a Python function `calc(x)` that returns x times 7." Tests are assert statements.
- programs:  "Write a Python program that reads an integer from standard input and prints it times 7." Tests are
  stdin/stdout pairs (the APPS layout: {"inputs": [...], "outputs": [...]}).
- strings:   string and list functions ("returns how many times 'a' appears in s"), tested by asserts.

Every row has `prompt` (chat messages), `tests` (a JSON string, as APPS and CodeContests store them) and `task`.
The constants in each statement vary, so the held-out prompts are new problems, not repeats.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import polars as pl

SYSTEM = "You write Python. Reply with one ```python code block and nothing else."
NAMES = ["calc", "solve", "compute", "answer", "result", "func", "apply", "make", "get", "work", "run", "f"]
VARIABLES = ["x", "n", "a", "b", "m", "t"]

# (statement with {k}, reference on x and k): one-argument integer functions and programs
INT_OPS = [
    ("{x} plus {k}", lambda x, k: x + k),
    ("{x} minus {k}", lambda x, k: x - k),
    ("{x} times {k}", lambda x, k: x * k),
    ("the remainder of {x} divided by {k}", lambda x, k: x % k),
    ("{x} integer-divided by {k}", lambda x, k: x // k),
    ("the larger of {x} and {k}", lambda x, k: max(x, k)),
    ("the smaller of {x} and {k}", lambda x, k: min(x, k)),
    ("{x} squared plus {k}", lambda x, k: x * x + k),
]

# string and list functions: (statement, argument name, reference, argument generator)
LETTERS = "abcde"


def _word(rnd: random.Random) -> str:
    return "".join(rnd.choice(LETTERS) for _ in range(rnd.randint(3, 9)))


def _numbers(rnd: random.Random) -> list[int]:
    return [rnd.randint(-9, 20) for _ in range(rnd.randint(2, 7))]


STRING_OPS = [
    ("returns how many times '{c}' appears in s", "s", lambda s, k, c: s.count(c), _word),
    ("returns the first {k} characters of s", "s", lambda s, k, c: s[:k], _word),
    ("returns s repeated {k} times", "s", lambda s, k, c: s * k, _word),
    ("returns s with every '{c}' removed", "s", lambda s, k, c: s.replace(c, ""), _word),
    ("returns s reversed", "s", lambda s, k, c: s[::-1], _word),
    ("returns the list xs with every element multiplied by {k}", "xs", lambda xs, k, c: [v * k for v in xs], _numbers),
    (
        "returns the sum of the elements of xs that are greater than {k}",
        "xs",
        lambda xs, k, c: sum(v for v in xs if v > k),
        _numbers,
    ),
    ("returns the number of elements of xs that are equal to {k}", "xs", lambda xs, k, c: xs.count(k), _numbers),
]


def _chat(text: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]


def functions(rnd: random.Random) -> dict:
    statement, ref = rnd.choice(INT_OPS)
    name, k = rnd.choice(NAMES), rnd.randint(2, 30)
    xs = rnd.sample(range(-20, 40), 3)
    text = f"Write a Python function `{name}(x)` that returns {statement.format(x='x', k=k)}."
    return {"prompt": _chat(text), "tests": json.dumps([f"assert {name}({x}) == {ref(x, k)!r}" for x in xs])}


def programs(rnd: random.Random) -> dict:
    statement, ref = rnd.choice(INT_OPS)
    k, xs, v = rnd.randint(2, 30), rnd.sample(range(-20, 40), 3), rnd.choice(VARIABLES)
    text = (
        f"Write a Python program that reads an integer {v} from standard input and prints {statement.format(x=v, k=k)}."
    )
    return {
        "prompt": _chat(text),
        "tests": json.dumps({"inputs": [f"{x}\n" for x in xs], "outputs": [f"{ref(x, k)}\n" for x in xs]}),
    }


def strings(rnd: random.Random) -> dict:
    statement, arg, ref, make = rnd.choice(STRING_OPS)
    name, k, c = rnd.choice(NAMES), rnd.randint(1, 4 if arg == "s" else 9), rnd.choice(LETTERS)
    text = f"Write a Python function `{name}({arg})` that {statement.format(k=k, c=c)}."
    cases = [make(rnd) for _ in range(3)]
    if arg == "xs":  # k among the elements of two of the lists: counting and filtering on it are tested for real
        for xs in cases[:2]:
            xs.insert(rnd.randrange(len(xs) + 1), k)
    return {"prompt": _chat(text), "tests": json.dumps([f"assert {name}({v!r}) == {ref(v, k, c)!r}" for v in cases])}


TASKS = {"functions": functions, "programs": programs, "strings": strings}


def build(out: Path, n_train: int, n_eval: int, seed: int = 0) -> None:
    for task, make in TASKS.items():
        rnd, seen, rows = random.Random(f"{seed}-{task}"), set(), []
        for _ in range(100 * (n_train + n_eval)):  # distinct statements: the held-out prompts are new problems
            if len(rows) == n_train + n_eval:
                break
            row = make(rnd)
            key = row["prompt"][-1]["content"]
            if key not in seen:
                seen.add(key)
                rows.append({**row, "task": task})
        if len(rows) < n_train + n_eval:
            raise SystemExit(f"{task}: only {len(rows)} distinct prompts; ask for fewer")
        folder = out / task
        folder.mkdir(parents=True, exist_ok=True)
        pl.DataFrame(rows[:n_train]).write_parquet(folder / "train.parquet")
        pl.DataFrame(rows[n_train:]).write_parquet(folder / "eval.parquet")
        print(f"{task}: {n_train} train, {n_eval} eval prompts -> {folder}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("examples/code_tests/data"))
    parser.add_argument("--train", type=int, default=384)
    parser.add_argument("--eval", type=int, default=64)
    args = parser.parse_args()
    build(args.out, args.train, args.eval)
