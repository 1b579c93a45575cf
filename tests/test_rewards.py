"""Reward functions: the built-ins on single samples, users' functions by file or module (per sample and batched),
what a function receives, the pool's timeouts and errors, and every way a reference can be wrong (one line each)."""

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import polars as pl
import pytest

from schemas.config import ConfigError, RewardConfig, build_config
from schemas.errors import RewardLoadError
from tasks.rewards.builtin import BUILTIN_REWARDS, final_answer
from tasks.rewards.loader import FunctionSpec, load_function, preflight, source_hash, specs_from_config
from tasks.rewards.pool import score_samples
from tasks.rewards.scoring import RewardError, score_frame
from tests import reward_fixtures

FIXTURES = "tests.reward_fixtures"


def rollouts(texts, reasons=None, prompt="p0", lengths=None):
    n = len(texts)
    return pl.DataFrame(
        {
            "iteration": [1] * n,
            "round": [0] * n,
            "prompt_id": [prompt] * n,
            "sample_idx": list(range(n)),
            "text": texts,
            "finish_reason": reasons or ["stop"] * n,
            "length": lengths or [3] * n,
        },
        schema_overrides={"iteration": pl.Int32, "round": pl.Int32, "sample_idx": pl.Int32, "length": pl.Int32},
    )


def prompts(answer="12", extra: dict | None = None):
    """One prompt row; `extra` holds the dataset's own columns (as the dataset stage stores them)."""
    frame = pl.DataFrame({"prompt_id": ["p0"], "text": ["6+6="], "answer": [answer]})
    return frame.with_columns(pl.DataFrame([extra]).select(pl.struct(list(extra)).alias("extra"))) if extra else frame


def reward(functions, workers=0, **kw) -> RewardConfig:
    return RewardConfig(functions=functions, workers=workers, **kw)


def test_accuracy_extracts_answers_and_compares_text_and_math():
    acc = BUILTIN_REWARDS.get("accuracy")
    assert acc(response="95", ground_truth="95") == 1.0 and acc(response="96", ground_truth="95") == 0.0
    assert acc(response="95.0", ground_truth="95") == 1.0  # math-verify equivalence
    assert (
        acc(response="so the total is 2+3=5\n#### 5", ground_truth="Tom has 2, buys 3.\n#### 5") == 1.0
    )  # GSM8K on both sides
    assert acc(response="We get \\boxed{\\frac{1}{2}}.", ground_truth="0.5") == 1.0  # MATH's \boxed{}
    assert (
        acc(response="Paris.", ground_truth="paris") == 1.0 and acc(response="Lyon", ground_truth="Paris") == 0.0
    )  # text answers
    assert acc(response="7", ground_truth=None) == 0.0
    assert (
        final_answer("a \\boxed{x^{2}} b") == "x^{2}"
        and final_answer("#### 12 ") == "12"
        and final_answer(" 7 ") == "7"
    )


def test_format_takes_its_pattern_and_needs_a_stop():
    fmt = BUILTIN_REWARDS.get("format")
    assert fmt(response="95", finish_reason="stop") == 1.0 and fmt(response="95", finish_reason="length") == 0.0
    assert fmt(response="9+5", finish_reason="stop") == 0.0
    assert fmt(response="x \\boxed{3}", finish_reason="stop", pattern=r"(?s).*\\boxed\{.+\}") == 1.0


def test_soft_overlong_punishment_hand_values():
    # L_max = 20, L_cache = 4: free up to 16 tokens, then (16 − |y|)/4 down to −1 at 20, −1 beyond.
    fn = BUILTIN_REWARDS.get("overlong")
    got = [fn(length=n, max_tokens=99, max_len=20, cache=4) for n in (10, 16, 17, 18, 20, 25)]
    assert got == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    # Without max_len, L_max is the generation limit; without cache, L_cache is ⌈20% of L_max⌉ (2 of 8).
    assert fn(length=7, max_tokens=8) == pytest.approx(-0.5)


def test_score_frame_weights_and_columns():
    df = score_frame(
        rollouts(["12", "13", "x"]), prompts("12"), reward({"accuracy": {"weight": 1.0}, "format": {"weight": 0.1}}), 8
    )
    assert df["score_accuracy"].to_list() == [1.0, 0.0, 0.0]
    assert df["score_format"].to_list() == [1.0, 1.0, 0.0]
    assert df["reward"].to_list() == pytest.approx([1.1, 0.1, 0.0])
    assert df["error"].null_count() == 3  # no function raised


def test_each_distinct_sample_is_scored_once_and_every_row_gets_its_score():
    reward_fixtures.CALLS.clear()
    texts = ["12", "13", "12", "12", "x", "13"]
    df = score_frame(rollouts(texts), prompts("12"), reward({"c": {"module": FIXTURES, "function": "counting"}}), 8)
    assert sorted(reward_fixtures.CALLS) == ["12", "13", "x"]
    assert df["score_c"].to_list() == [float(t == "12") for t in texts]  # a reference loop over the rows


def test_a_function_gets_the_prompt_the_ground_truth_with_its_type_and_every_dataset_column():
    extra = {"answer": 7, "difficulty": "easy", "meta": {"source": "unit", "tags": ["a"]}}
    spec = {"all": {"module": FIXTURES, "function": "sees_everything", "kwargs": {"bonus": 0.5}}}
    df = score_frame(rollouts(["7"]), prompts("7", extra), reward(spec), 8, answer_key="answer")
    assert df["score_all"].to_list() == [1.5] and df["error"][0] is None


def test_a_raising_or_non_numeric_function_scores_zero_with_an_error():
    spec = {
        "accuracy": {"weight": 1.0},
        "boom": {"module": FIXTURES, "function": "raises"},
        "text": {"module": FIXTURES, "function": "returns_text", "weight": 0.0},
    }
    df = score_frame(rollouts(["12"]), prompts("12"), reward(spec), 8)
    assert df["reward"].to_list() == [1.0] and "KeyError" in df["error_boom"][0]
    assert df["error_text"][0].startswith("TypeError: returned str 'high', not a number")


def test_a_nan_reward_is_refused():
    with pytest.raises(RewardError, match="reward function 'n' returned nan"):
        score_frame(rollouts(["12"]), prompts(), reward({"n": {"module": FIXTURES, "function": "nan"}}), 8)


def test_batched_functions_take_lists_and_must_return_one_score_per_sample():
    spec = {
        "n": {"module": FIXTURES, "function": "lengths_batched", "batched": True},
        "short": {"module": FIXTURES, "function": "wrong_count", "batched": True, "weight": 0.0},
    }
    df = score_frame(
        rollouts(["a", "bb", "ccc"], lengths=[1, 2, 3]), prompts(), reward(spec, workers=2, timeout_s=5), 8
    )
    assert df["score_n"].to_list() == [1.0, 2.0, 3.0]
    assert all(e.startswith("ValueError: returned") and e.endswith("samples") for e in df["error_short"])


def test_reward_pool_times_out_a_hanging_function_and_records_a_raising_one():
    samples = [{"response": r, "ground_truth": r} for r in ("12", "7", "abc")]
    specs = [FunctionSpec(name, module=FIXTURES, function=name) for name in ("hangs", "raises", "echo_length")]
    got = score_samples(specs, samples, 0.5, 2)
    assert got["echo_length"] == [(2.0, None, None), (1.0, None, None), (3.0, None, None)]
    assert all(v == 0.0 and e.startswith("timeout") for v, e, _ in got["hangs"])
    assert all(v == 0.0 and e == "KeyError: 'no such field'" for v, e, _ in got["raises"])
    again = score_samples(specs[2:], samples[:1], 0.5, 2)  # the pool is still usable afterwards
    assert again["echo_length"] == [(2.0, None, None)]


def test_reward_workers_start_early_and_do_not_run_the_parent_main_module(tmp_path):
    """The command's main module (the CLI and Prefect) runs once, in the command, not again in each spawned worker;
    workers started ahead by start_workers are the ones that score."""
    marker, script = tmp_path / "ran", tmp_path / "command.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, sys
        with open({str(marker)!r}, "a") as f:
            f.write(str(os.getpid()) + "\\n")
        if __name__ == "__main__":
            from tasks.rewards import pool
            from tasks.rewards.loader import FunctionSpec
            specs = [FunctionSpec("echo_length", module="tests.reward_fixtures", function="echo_length")]
            pool.start_workers(specs, 2)
            started = set(pool._POOL._processes)
            got = pool.score_samples(specs, [{{"response": "abc"}}] * 8, 5.0, 2)
            assert got["echo_length"] == [(3.0, None, None)] * 8, got
            assert len(started) == 2 and set(pool._POOL._processes) == started, (started, pool._POOL._processes)
    """)
    )
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path.cwd())},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(marker.read_text().split()) == 1, (
        f"the main module ran in {marker.read_text().split()}"
    )  # the command only


def test_score_frame_in_the_pool_matches_inline_scoring():
    texts = ["12", "13", "x", "0012", "12.0"]
    spec = {"accuracy": {"weight": 1.0}, "format": {"weight": 0.1}}
    pooled = score_frame(rollouts(texts), prompts("12"), reward(spec, workers=2), 8)
    inline = score_frame(rollouts(texts), prompts("12"), reward(spec, workers=0), 8)
    assert pooled.equals(inline)


def test_a_function_from_a_file_is_loaded_and_its_source_is_fingerprinted(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text("from helper import TARGET\n\ndef score(response, **_):\n    return float(response == TARGET)\n")
    (tmp_path / "helper.py").write_text("TARGET = 'yes'\n")  # a helper next to the file imports
    cfg = reward({"mine": {"path": str(path), "function": "score"}})
    df = score_frame(rollouts(["yes", "no"]), prompts(), cfg, 8)
    assert df["score_mine"].to_list() == [1.0, 0.0]
    before = source_hash(specs_from_config(cfg))
    path.write_text(path.read_text() + "# edited\n")
    assert source_hash(specs_from_config(cfg)) != before  # an edited reward file re-scores


@pytest.mark.parametrize(
    "source, spec, columns, needle",
    [
        (None, {"path": "{tmp}/missing.py", "function": "score"}, set(), "file not found: {tmp}/missing.py"),
        (
            "def other(**_):\n    return 1\n",
            {"path": "{tmp}/r.py", "function": "score"},
            set(),
            "has no function 'score' (it defines: other)",
        ),
        (
            "import nowhere_to_be_found\n",
            {"path": "{tmp}/r.py", "function": "score"},
            set(),
            "importing {tmp}/r.py failed: ModuleNotFoundError: No module named 'nowhere_to_be_found' (r.py, line 1)",
        ),
        (
            "def score(:\n",
            {"path": "{tmp}/r.py", "function": "score"},
            set(),
            "importing {tmp}/r.py failed: SyntaxError",
        ),
        (
            None,
            {"module": FIXTURES, "function": "needs_unknown"},
            {"difficulty"},
            "rlpipe cannot fill parameter 'confidence'; it may take prompt, messages",
        ),
        (None, {"module": FIXTURES, "function": "echo_length", "kwargs": {"nope": 1}}, set(), None),
        (None, {"module": FIXTURES, "function": "counting", "kwargs": {"nope": 1}}, set(), "takes no argument 'nope'"),
        (None, {"module": "no_such_module_xyz", "function": "f"}, set(), "importing module no_such_module_xyz failed"),
    ],
)
def test_a_broken_reference_fails_at_preflight_with_one_line(tmp_path, source, spec, columns, needle):
    if source is not None:
        (tmp_path / "r.py").write_text(source)
    spec = {k: v.replace("{tmp}", str(tmp_path)) if isinstance(v, str) else v for k, v in spec.items()}
    cfg = reward({"mine": spec})
    if needle is None:  # kwargs reach a function that takes **kwargs
        preflight(cfg, columns)
        return
    with pytest.raises(RewardLoadError) as err:
        preflight(cfg, columns)
    message = str(err.value)
    assert (
        needle.replace("{tmp}", str(tmp_path)) in message
        and "\n" not in message
        and message.startswith("reward function 'mine'")
    )


@pytest.mark.parametrize(
    "functions, needle",
    [
        (
            {"acuracy": {}},
            "'acuracy' is not a built-in reward function "
            "(choose one of accuracy, code_tests, format, overlong, reasoning_gym)",
        ),
        ({"bad name": {"path": "r.py"}}, "'bad name' is not a usable reward name"),
        ({"mine": {"path": "r.py", "module": "m"}}, "give path or module, not both"),
        ({"mine": {"path": "r.py", "kwargs": {"response": 1}}}, "kwargs may not set 'response'"),
        ({"accuracy": {"weight": float("nan")}}, "reward.functions.accuracy.weight"),
    ],
)
def test_reward_config_errors_name_the_key(functions, needle):
    with pytest.raises(ConfigError) as err:
        build_config({"reward": {"functions": functions}, "eval": {"judge": "reward"}})
    assert needle in str(err.value)


def test_the_eval_judge_must_be_scored():
    with pytest.raises(ConfigError, match="eval.judge 'accuracy' is not scored by this run"):
        build_config({"reward": {"functions": {"format": {}}}})
    assert build_config({"reward": {"functions": {"format": {}}}, "eval": {"judge": "reward"}}).eval.judge == "reward"


def test_every_builtin_is_registered_once_and_loads():
    assert BUILTIN_REWARDS.names() == ["accuracy", "code_tests", "format", "overlong", "reasoning_gym"]
    for name in BUILTIN_REWARDS:
        assert load_function(FunctionSpec(name)) is BUILTIN_REWARDS.get(name)
    with pytest.raises(ValueError, match="registered twice"):
        BUILTIN_REWARDS.register("accuracy")(lambda **_: 0.0)
    assert math.isnan(float("nan"))


VERL_AND_TRL_REWARDS = '''
import re

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature, unchanged."""
    found = re.findall(r"-?\\d+", solution_str)
    bonus = 0.5 if data_source is None and extra_info is None else 0.0
    return float(bool(found) and found[-1] == ground_truth) + bonus

def trl_accuracy(completions, ground_truth, **kwargs):
    """TRL's batched signature, unchanged: conversational completions are lists of messages."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    assert len(kwargs["prompts"]) == len(texts) and len(kwargs["completion_ids"]) == len(texts)
    return [float(t.strip() == g) for t, g in zip(texts, ground_truth)]

def trl_sees(prompts, completions, completion_ids, **kwargs):
    return [float(p[-1]["role"] == "user" and c == [{"role": "assistant", "content": c[0]["content"]}]
                  and ids == [5, 6]) for p, c, ids in zip(prompts, completions, completion_ids)]
'''


@pytest.mark.parametrize("workers", [0, 2])
def test_verl_and_trl_reward_functions_run_unchanged_from_a_file(tmp_path, workers):
    path = tmp_path / "their_rewards.py"
    path.write_text(VERL_AND_TRL_REWARDS)
    cfg = reward(
        {
            "verl": {"path": str(path), "function": "compute_score"},
            "trl": {"path": str(path), "function": "trl_accuracy"},
            "sees": {"path": str(path), "function": "trl_sees", "weight": 0.0},
        },
        workers=workers,
    )
    preflight(cfg, set())  # neither "cannot fill parameter 'solution_str'" nor "... 'completions'"
    frame = rollouts(["the sum is 12", "12", "13"]).with_columns(
        pl.Series("token_ids", [[5, 6]] * 3, dtype=pl.List(pl.Int32))
    )
    chat = prompts("12").with_columns(pl.Series("messages", [[{"role": "user", "content": "6+6?"}]]))
    df = score_frame(frame, chat, cfg, 8)
    assert df["score_verl"].to_list() == [1.5, 1.5, 0.5]  # no data_source / extra_info columns: both None
    assert df["score_trl"].to_list() == [0.0, 1.0, 0.0] and df["error"].null_count() == 3
    assert df["score_sees"].to_list() == [1.0, 1.0, 1.0]
    # With verl's own columns, the function gets them; text prompts reach TRL functions as text.
    extra = {"answer": "12", "data_source": "gsm8k", "extra_info": {"split": "test"}}
    df = score_frame(frame, prompts("12", extra), cfg, 8)
    assert df["score_verl"].to_list() == [1.0, 1.0, 0.0] and df["score_trl"].to_list() == [0.0, 1.0, 0.0]
    assert df["score_sees"].to_list() == [0.0, 0.0, 0.0] and df["error_sees"][0].startswith("TypeError")


def test_a_dataset_column_named_like_an_alias_is_refused(tmp_path):
    from schemas.config import DataConfig
    from tasks.data.datasets import DatasetError, prompt_rows

    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1+1", "answer": "2", "completions": "x"}\n')
    with pytest.raises(DatasetError, match="column 'completions' would shadow the reward functions' argument"):
        prompt_rows([str(path)], DataConfig(), "data.train_files", "train")


def test_every_reward_source_the_config_lists_is_registered_in_its_scoring_order():
    """The config says which sources a reward uses and their columns (RewardConfig.source_columns); the family
    registers how each one checks and scores, under the same names."""
    from tasks.rewards.sources import REWARD_SOURCES

    reward = RewardConfig(
        kind="model",
        model_path="rm",
        process_model={"path": "prm"},
        judges={"j": {"base_url": "http://x", "model": "m"}},
    )
    assert list(reward.source_columns()) == ["functions", "model", "process_model", "judges"]
    assert set(reward.source_columns()) == set(REWARD_SOURCES.names())
    assert reward.score_columns() == ["score_accuracy", "score_format", "score_model", "score_prm", "score_j"]
