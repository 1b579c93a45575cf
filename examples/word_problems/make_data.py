"""Build the example's data offline: arithmetic word problems as chat prompts, in verl's layout.

    python examples/word_problems/make_data.py [--out examples/word_problems/data] [--train 4000] [--eval 200]

Writes three Parquet files:
- train.parquet, eval.parquet: `prompt` (chat messages), `reward_model` (a struct whose `ground_truth` is the
  answer), `data_source` and `extra_info` (difficulty and the operation), the columns verl's GSM8K preparation writes;
- sft.parquet: `messages`, whole conversations whose last (assistant) message is a worked answer ending in `#### N`.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import polars as pl

NAMES = ["Tom", "Ana", "Lee", "Mia", "Sam", "Ivy", "Max", "Zoe"]
ITEMS = ["apples", "books", "coins", "pens", "cards", "shells"]


def problem(rnd: random.Random) -> dict:
    name, item = rnd.choice(NAMES), rnd.choice(ITEMS)
    a, b = rnd.randint(2, 30), rnd.randint(2, 30)
    if rnd.random() < 0.5:
        question = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
        work, answer, op = f"{a} + {b} = {a + b}", a + b, "add"
    else:
        a, b = max(a, b), min(a, b)
        question = f"{name} has {a} {item} and gives away {b}. How many {item} are left?"
        work, answer, op = f"{a} - {b} = {a - b}", a - b, "subtract"
    return {
        "question": question,
        "work": work,
        "answer": answer,
        "op": op,
        "difficulty": "easy" if answer < 20 else "hard",
    }


def rows(problems: list[dict], split: str) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "data_source": ["word_problems"] * len(problems),
            "prompt": [[{"role": "user", "content": p["question"]}] for p in problems],
            "reward_model": [{"style": "rule", "ground_truth": str(p["answer"])} for p in problems],
            "extra_info": [
                {"split": split, "index": i, "operation": p["op"], "difficulty": p["difficulty"]}
                for i, p in enumerate(problems)
            ],
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="examples/word_problems/data")
    parser.add_argument("--train", type=int, default=4000)
    parser.add_argument("--eval", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rnd = random.Random(args.seed)
    seen, problems = set(), []
    while len(problems) < args.train + args.eval:  # distinct questions, so no eval question is trained on
        p = problem(rnd)
        if p["question"] not in seen:
            seen.add(p["question"])
            problems.append(p)
    train, held_out = problems[args.eval :], problems[: args.eval]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows(train, "train").write_parquet(out / "train.parquet")
    rows(held_out, "eval").write_parquet(out / "eval.parquet")
    sft = pl.DataFrame(
        {
            "messages": [
                [
                    {"role": "user", "content": p["question"]},
                    {"role": "assistant", "content": f"{p['work']}\n#### {p['answer']}"},
                ]
                for p in train
            ]
        }
    )
    sft.write_parquet(out / "sft.parquet")
    print(f"wrote {len(train)} train, {len(held_out)} eval prompts and {sft.height} demonstrations to {out}")


if __name__ == "__main__":
    main()
