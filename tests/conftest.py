import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def tiny_config(tmp: Path, **sections) -> Path:
    """A config whose every path lives under `tmp`, sized for a test on two cores."""
    cfg = {
        "storage_root": str(tmp / "runs"),
        "model": {"recipe": str(ROOT / "infra/model/demo_llama.yaml"), "base_path": str(tmp / "models/base"),
                  "path": str(tmp / "models/sft")},
        "task": {"name": "arithmetic", "out_dir": str(tmp / "data"), "max_operand": 20, "operations": "+", "n_eval": 32,
                 "sft_demos": 2000},
        "data": {"train_files": str(tmp / "data/train.parquet"), "eval_files": str(tmp / "data/eval.parquet"), "id_key": "prompt_id"},
        "rollout": {"group_size": 4, "prompts_per_round": 16, "max_tokens": 4},
        "batch": {"target_groups": 4, "max_rounds": 3},
        "optim": {"micro_batch_size": 32, "minibatches": 2},
        "rl": {"iterations": 2, "eval_every": 2},
        "eval": {"samples": 4, "pass_k": 2},
        "sft": {"files": str(tmp / "data/sft.parquet"), "steps": 20, "batch_size": 32, "warmup_steps": 5},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def rlpipe(*args, cwd: Path, check=True, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PREFECT_HOME": str(cwd / ".prefect"), "PREFECT_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, env={**env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"rlpipe {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture
def workspace(tmp_path):
    return tmp_path
