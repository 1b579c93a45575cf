"""Built-in example tasks: generators that write a task's data files (train.parquet, eval.parquet: prompt_id,
prompt, answer; sft.parquet: prompt_id, prompt, response) into `task.out_dir`. A run then reads them through the
`data` and `sft` sections exactly as it reads a user's files; nothing downstream knows a task is built in.

A generator writes only into a folder that is empty or that it wrote itself (marked by `_rlpipe_task.json`), so
pointing `task.out_dir` at a folder of your own data can never overwrite it.
Imports: each task's generator is imported when that task writes its files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import polars as pl

from schemas.errors import UserError
from tasks.registry import Registry

EXAMPLE_TASKS: Registry[Callable[..., dict[str, pl.DataFrame]]] = Registry("example task")
STAMP = "_rlpipe_task.json"
FILES = ("train", "eval", "sft")


class TaskFilesError(UserError):
    pass


@EXAMPLE_TASKS.register("arithmetic")
def arithmetic_files(task) -> dict[str, pl.DataFrame]:
    from tasks.data.arithmetic import demonstrations, make_splits

    train, held_out = make_splits(task.max_operand, task.operations, task.n_eval, task.seed, task.pad_operands)
    sft = demonstrations(train, task.sft_demos, task.demo_seed, task.teacher_flaw, task.teacher_flaw_rate)
    return {"train": train, "eval": held_out, "sft": sft}


@EXAMPLE_TASKS.register("long_addition")
def long_addition_files(task) -> dict[str, pl.DataFrame]:
    from tasks.data.long_addition import make_files

    return make_files(
        task.digits, task.n_train, task.n_eval, task.seed, task.sft_demos, task.teacher_flaw, task.teacher_flaw_rate
    )


@EXAMPLE_TASKS.register("chat_arithmetic")
def chat_arithmetic_files(task) -> dict[str, pl.DataFrame]:
    from tasks.data.chat_arithmetic import make_files

    return make_files(
        task.min_operand, task.max_operand, task.operations, task.n_train, task.n_eval, task.seed, task.sft_demos
    )


def task_paths(task) -> dict[str, Path]:
    return {name: Path(task.out_dir) / f"{name}.parquet" for name in FILES}


def ensure_task_files(task) -> dict[str, Path]:
    """Write the task's files once (they are a pure function of its settings); refuse a folder rlpipe did not write."""
    out, paths = Path(task.out_dir), task_paths(task)
    params = task.model_dump(mode="json")
    stamp = out / STAMP
    if stamp.exists():
        try:
            if json.loads(stamp.read_text()) == params and all(p.exists() for p in paths.values()):
                return paths
        except ValueError:
            pass
    elif out.exists() and any(out.iterdir()):
        raise TaskFilesError(
            f"task.out_dir {out} holds files rlpipe did not write; choose an empty or new folder "
            "(rlpipe never writes into a folder of your data)"
        )
    out.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)  # a half-written set is never taken for a complete one
    for name, frame in EXAMPLE_TASKS.get(task.name)(task).items():
        tmp = paths[name].with_suffix(".tmp")
        frame.write_parquet(tmp)
        tmp.replace(paths[name])
    stamp.write_text(json.dumps(params, indent=2, sort_keys=True))
    return paths
