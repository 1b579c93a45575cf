"""How a batch is shared among trainer ranks and prompts among vLLM replicas: pure functions, checked against the
one-process behaviour they must reproduce."""

import pytest

from tasks.engines.workers.data_parallel import accumulation_steps, rank_micro_batches
from tasks.stages.rollouts import deal_by_tokens


@pytest.mark.parametrize("rows,world,micro", [(16, 2, 32), (17, 2, 4), (5, 4, 1), (3, 4, 2), (128, 1, 64), (64, 3, 8)])
def test_every_row_once_and_every_rank_the_same_number_of_micro_steps(rows, world, micro):
    batch = list(range(100, 100 + rows))
    gas = accumulation_steps(rows, world, micro)
    for chunk in (None, min(micro, rows)):
        parts = [rank_micro_batches(batch, gas, world, r, chunk) for r in range(world)]
        seen = sorted(i for rank_parts in parts for part in rank_parts for i in part)
        assert seen == batch
        assert all(len(part) <= micro for rank_parts in parts for part in rank_parts)
        if world > 1:
            assert {len(rank_parts) for rank_parts in parts} == {gas}  # lockstep: dummies fill the short ranks


def test_one_rank_keeps_the_single_process_micro_batches():
    mb = list(range(10))
    gas = accumulation_steps(len(mb), 1, 3)
    assert gas == 4
    assert rank_micro_batches(mb, gas, 1, 0) == [mb[i::gas] for i in range(gas)]  # the RL update's round-robin split
    assert rank_micro_batches(mb, gas, 1, 0, 3) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]  # SFT's consecutive chunks
    assert rank_micro_batches([1, 2], 4, 1, 0) == [[1], [2]]  # no dummy steps alone


def test_prompts_are_dealt_to_replicas_by_pending_tokens_with_each_group_on_one():
    import random

    def reference(groups, pending, replicas):  # the rule written out: biggest group first, to the least loaded
        totals = {}
        for key, tokens in zip(groups, pending):
            totals[key] = totals.get(key, 0) + tokens
        first = {key: groups.index(key) for key in totals}
        loads, shares = [0] * replicas, [[] for _ in range(replicas)]
        for key in sorted(totals, key=lambda g: (-totals[g], first[g])):
            k = min(range(replicas), key=lambda r: (loads[r], r))
            loads[k] += totals[key]
            shares[k] += [i for i, g in enumerate(groups) if g == key]
        return [sorted(s) for s in shares]

    rnd = random.Random(0)
    for trial in range(200):
        n, replicas = rnd.randint(0, 30), rnd.randint(1, 5)
        groups = [f"g{rnd.randint(0, 8)}" for _ in range(n)]
        pending = [rnd.choice([16, 128, 512]) for _ in range(n)]
        shares = deal_by_tokens(groups, pending, replicas)
        assert shares == reference(groups, pending, replicas) == deal_by_tokens(groups, pending, replicas)
        assert sorted(i for s in shares for i in s) == list(range(n))
        assert all(
            len({groups[i] for i in s} & {groups[i] for i in t}) == 0 for s in shares for t in shares if s is not t
        )
    # by hand: groups of 300, 200, 150 and 100 pending tokens on 2 replicas: 300 | 200, then 150 → the 200 side, 100 →
    # the 300 side (300 + 100 against 200 + 150)
    assert deal_by_tokens(["a", "b", "c", "d"], [300, 200, 150, 100], 2) == [[0, 3], [1, 2]]


def test_a_stale_build_lock_left_by_a_killed_process_does_not_hang_the_trainer(tmp_path):
    """torch's JIT build lock for DeepSpeed's CPU collectives op, left behind by a process killed while loading it,
    made every later trainer wait forever. A copy of the built op in its own extensions folder, an old lock in it:
    the load removes it and succeeds; a fresh lock (another process building) is waited for, not removed."""
    import os
    import shutil
    import subprocess
    import sys
    import time
    from pathlib import Path

    from tasks.engines.launch import worker_env

    probe = (
        "from torch.utils.cpp_extension import _get_build_directory as d; print(d('deepspeed_shm_comm', verbose=False))"
    )
    load = [
        sys.executable,
        "-c",
        "from tasks.engines.workers.data_parallel import load_comm_op; load_comm_op(); print('loaded')",
    ]
    built = Path(
        subprocess.run(
            [sys.executable, "-c", probe], env=worker_env(), capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    if not (built / "deepspeed_shm_comm.so").exists():  # a fresh environment: build it where the trainers will reuse it
        subprocess.run(load, env=worker_env(), capture_output=True, text=True, check=True, timeout=600)
    env = worker_env({"TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")})
    build_dir = Path(
        subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    shutil.rmtree(build_dir)
    shutil.copytree(built, build_dir)  # modification times kept: ninja finds it up to date
    lock = build_dir / "lock"
    lock.touch()
    os.utime(lock, (time.time() - 3600, time.time() - 3600))
    out = subprocess.run(load, env=env, capture_output=True, text=True, timeout=120)
    assert "loaded" in out.stdout and "stale build lock" in out.stdout, out.stderr[-2000:]
    assert not lock.exists()
    lock.touch()  # held by a live build
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run(load, env=env, capture_output=True, text=True, timeout=8)
    assert lock.exists()
