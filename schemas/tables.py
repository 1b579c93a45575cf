"""Every Parquet table rlpipe writes, declared once.

A table is a name, a version and ordered columns (Polars dtypes). The pyarrow schema is derived from it.
Token-level data is `list<float32>` / `list<int32>`. Tables marked `open` (metrics) must hold their declared
columns but may carry extra float columns, so a new metric does not need a schema version bump.

Over 400 lines as a declaration file: every table's columns are stated here once, one declaration per table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import polars as pl

from schemas.errors import UserError

I32, I64, F32, F64, STR, BOOL = pl.Int32, pl.Int64, pl.Float32, pl.Float64, pl.Utf8, pl.Boolean
LIST_I32, LIST_F32 = pl.List(pl.Int32), pl.List(pl.Float32)
MESSAGES = pl.List(pl.Struct({"role": STR, "content": STR}))  # chat messages


class TableError(UserError, ValueError):
    """A frame that does not fit its table's schema; the message is one line and names the problem."""


@dataclass(frozen=True)
class TableSchema:
    name: str
    version: int
    columns: dict[str, pl.DataType]
    open: bool = False
    unique: tuple[str, ...] = field(default=())  # columns that together must be unique
    optional: dict[str, pl.DataType] = field(default_factory=dict)  # columns a frame may have, with these dtypes

    @property
    def polars(self) -> pl.Schema:
        return pl.Schema(self.columns)

    @property
    def arrow(self):
        return pl.DataFrame(schema=self.columns).to_arrow().schema

    def validate(self, df: pl.DataFrame, what: str | None = None) -> pl.DataFrame:
        """Check columns and dtypes; return the frame with declared columns first, in order."""
        what = what or f"table {self.name!r}"
        missing = [c for c in self.columns if c not in df.columns]
        if missing:
            raise TableError(f"{what}: missing column(s) {', '.join(missing)}")
        for col, dtype in self.columns.items():
            if df.schema[col] != dtype:
                raise TableError(f"{what}: column {col!r} has dtype {df.schema[col]}, expected {dtype}")
        for col in (c for c in self.optional if c in df.columns):
            if df.schema[col] != self.optional[col]:
                raise TableError(f"{what}: column {col!r} has dtype {df.schema[col]}, expected {self.optional[col]}")
        extra = [c for c in df.columns if c not in self.columns and c not in self.optional]
        if extra and not self.open:
            raise TableError(f"{what}: unexpected column(s) {', '.join(extra)}")
        if self.unique and df.height and df.select(self.unique).is_duplicated().any():
            raise TableError(f"{what}: duplicate rows for key ({', '.join(self.unique)})")
        present = [c for c in self.optional if c in df.columns]
        return df.select([*self.columns, *present, *extra])


def _table(name: str, version: int, columns: dict, **kw) -> TableSchema:
    return TableSchema(name, version, columns, **kw)


# The run's prompts, read once from the user's files (data section): formatted (`text` is what the model sees, chat
# template applied) and tokenized, overlong prompts dropped. `answer` is the ground truth as text (null without one);
# `extra`, a struct of every other column of the file, untouched, is what the reward functions receive.
DATASET = _table(
    "dataset",
    1,
    {"split": STR, "prompt_id": STR, "text": STR, "prompt_token_ids": LIST_I32, "messages": MESSAGES, "answer": STR},
    open=True,
    unique=("split", "prompt_id"),
)

# SFT demonstrations from the user's files: the formatted prompt and the response, and the tokens trained on.
SFT_DATA = _table(
    "sft_data",
    2,
    {"prompt_id": STR, "text": STR, "response": STR, "prompt_token_ids": LIST_I32, "response_token_ids": LIST_I32},
    unique=("prompt_id",),
)

SFT_METRICS = _table("sft_metrics", 1, {"step": I32, "loss": F64, "lr": F64}, open=True)

PROMPTS = _table(
    "prompts",
    2,
    {
        "iteration": I32,
        "round": I32,
        "prompt_id": STR,
        "text": STR,
        "prompt_token_ids": LIST_I32,
        "messages": MESSAGES,
        "answer": STR,
    },
    open=True,  # the dataset's `extra` columns ride along for the reward functions
    unique=("iteration", "prompt_id"),
)

ROLLOUTS = _table(
    "rollouts",
    1,
    {
        "iteration": I32,
        "round": I32,
        "prompt_id": STR,
        "sample_idx": I32,
        "prompt_token_ids": LIST_I32,
        "token_ids": LIST_I32,
        "text": STR,
        "sampler_logprobs": LIST_F32,
        "finish_reason": STR,
        "truncated": BOOL,
        "length": I32,
        "policy_version": I32,
    },
    unique=("iteration", "prompt_id", "sample_idx"),
    # Multi-turn rollouts (the agent section) add these: `text` is then the model's last turn, `token_ids` the whole
    # trajectory after the prompt (the model's turns and the observations), `action_mask` 1 on the model's own tokens,
    # `conversation` every message, the prompt's included; `env_reward` sums the environment's rewards (null: none).
    optional={
        "action_mask": pl.List(pl.Int8),
        "conversation": pl.List(pl.Struct({"role": STR, "content": STR})),
        "turns": I32,
        "tool_calls": I32,
        "tool_errors": I32,
        "env_reward": F64,
        "agent_error": STR,
        # ARPO's branching (agent.branching): the parent trajectory's sample_idx (null: started from the prompt), and
        # how many of `token_ids` it shares with the parent (the branch point)
        "parent_sample_idx": I32,
        "branch_point": I32,
        # Partial rollouts (rollout.partial_tokens): the update whose weights sampled each token (`policy_version` is
        # then the oldest), and the iteration whose prompts table holds the group's prompt
        "token_versions": LIST_I32,
        "prompt_iteration": I32,
    },
)

# Partial rollouts' sequences in flight after a sampling round (the rollouts stage's second table, one part per
# round; tasks/stages/partial_rollouts.py): a group stays, its ended samples included, until its last sample ends.
CARRY = _table(
    "carry",
    1,
    {
        "iteration": I32,
        "round": I32,
        "prompt_id": STR,
        "sample_idx": I32,
        "prompt_iteration": I32,
        "prompt_token_ids": LIST_I32,
        "token_ids": LIST_I32,
        "text": STR,
        "sampler_logprobs": LIST_F32,
        "token_versions": LIST_I32,
        "finish_reason": STR,
        "ended": BOOL,
    },
    unique=("prompt_id", "sample_idx"),
)

# Multi-turn rollouts, one row per message of each trajectory (the rollouts stage's second table). `turn` counts the
# model's turns before the row; `token_ids` are the ids the row added to the trajectory: a model turn's as sampled
# (with its `sampler_logprobs`), an observation's on the last message of it (tool results or the environment's
# messages, the chat template's glue and the next turn's opening included), none for the prompt's messages.
TURNS = _table(
    "turns",
    2,
    {
        "iteration": I32,
        "round": I32,
        "prompt_id": STR,
        "sample_idx": I32,
        "turn": I32,
        "role": STR,
        "text": STR,
        "token_ids": LIST_I32,
        "sampler_logprobs": LIST_F32,
        "tool_name": STR,
        "tool_arguments": STR,
        "error": STR,
        "seconds": F64,
        "cut_tokens": I32,  # a tool result cut to agent.max_tool_output_tokens: how many tokens were cut
    },
    # ARPO's branching (agent.branching): a branch's rows up to its branch point are copies of its parent's
    optional={"inherited": BOOL},
)

SCORES = _table(
    "scores",
    1,
    {
        "iteration": I32,
        "round": I32,
        "prompt_id": STR,
        "sample_idx": I32,
        "reward": F64,
        "error": STR,
    },
    open=True,  # per reward function its `score_<fn>` and `error_<fn>` (and a process reward's `steps_<fn>`)
    unique=("iteration", "prompt_id", "sample_idx"),
    # Process rewards (reward functions with per_step): the response token on which each step ends (reward.steps)
    optional={"step_ends": LIST_I32},
)

BATCH = _table(
    "batch",
    1,
    {
        "iteration": I32,
        "round": I32,
        "prompt_id": STR,
        "group_size": I32,
        "reward_mean": F64,
        "reward_std": F64,
        "kept": BOOL,
        "filter_reason": STR,
        "rounds_used": I32,
    },
    unique=("iteration", "prompt_id"),
)

LOGPROBS = _table(
    "logprobs",
    2,
    {
        "iteration": I32,
        "prompt_id": STR,
        "sample_idx": I32,
        "old_logprobs": LIST_F32,
        "ref_logprobs": LIST_F32,
        "entropy": LIST_F32,
        "values": LIST_F32,  # the critic's V per response token (PPO); null without a critic
    },
    unique=("iteration", "prompt_id", "sample_idx"),
    optional={"teacher_logprobs": LIST_F32},  # on-policy distillation (advantage.teacher_path)
)

ADVANTAGES = _table(
    "advantages",
    1,
    {
        "iteration": I32,
        "prompt_id": STR,
        "sample_idx": I32,
        "reward": F64,
        "advantage": F64,
        "token_advantages": LIST_F32,
        "returns": LIST_F32,
    },
    unique=("iteration", "prompt_id", "sample_idx"),
)

# DCPO's per-prompt history after an iteration: an immutable snapshot per iteration (n steps seen, the
# cumulative mean and std of the prompt's rewards, each step counted once, and the lowest and highest reward ever
# seen, which say exactly whether the rewards ever differed).
PROMPT_STATS = _table(
    "prompt_stats",
    2,
    {"prompt_id": STR, "n": I32, "mean": F64, "std": F64, "reward_min": F64, "reward_max": F64, "last_iteration": I32},
    unique=("prompt_id",),
)

TRAIN_METRICS = _table(
    "train_metrics",
    1,
    {"iteration": I32, "policy_version": I32, "optimizer_steps": I32, "loss": F64},
    open=True,
)

EVAL = _table(
    "eval",
    2,
    {
        "iteration": I32,
        "prompt_id": STR,
        "answer": STR,
        "greedy_text": STR,
        "greedy_correct": BOOL,
        "greedy_length": I32,
        "greedy_reward": F64,
        "n_samples": I32,
        "n_correct": I32,
        "pass_at_k": F64,
        "sampled_reward_mean": F64,
    },
    unique=("iteration", "prompt_id"),
)

# Preference data. A K-wise ranking: rank 1 is best, equal ranks are ties (no preference between them).
LIST_STR = pl.List(pl.Utf8)
# `prompt` is the formatted prompt (chat template applied) and `prompt_token_ids` its tokens.
PREFERENCE_RANKINGS = _table(
    "preference_rankings",
    2,
    {
        "prompt_id": STR,
        "prompt": STR,
        "prompt_token_ids": LIST_I32,
        "responses": LIST_STR,
        "ranks": LIST_I32,
        "split": STR,
    },
    unique=("prompt_id",),
)

# Every ordered pair of a ranking with strictly different ranks (what DPO trains on).
PREFERENCE_PAIRS = _table(
    "preference_pairs",
    2,
    {
        "prompt_id": STR,
        "pair_idx": I32,
        "prompt": STR,
        "prompt_token_ids": LIST_I32,
        "chosen": STR,
        "rejected": STR,
        "split": STR,
    },
    unique=("prompt_id", "pair_idx"),
)

RM_METRICS = _table("rm_metrics", 1, {"step": I32, "loss": F64, "lr": F64}, open=True)

# Held-out pairs scored by a trained reward model (rm_eval) or by DPO's implicit reward (dpo_eval).
PAIR_EVAL_COLUMNS = {"prompt_id": STR, "pair_idx": I32, "chosen_score": F64, "rejected_score": F64, "correct": BOOL}
RM_EVAL = _table("rm_eval", 1, PAIR_EVAL_COLUMNS, unique=("prompt_id", "pair_idx"))

# A process reward model's data (reward_model.objective process): sampled responses, each step labelled right (1) or
# wrong (0) by a per_step reward function; `step_ends` are the response tokens on which the steps end.
PRM_STEPS = _table(
    "prm_steps",
    1,
    {
        "prompt_id": STR,
        "sample_idx": I32,
        "prompt_token_ids": LIST_I32,
        "response": STR,
        "response_token_ids": LIST_I32,
        "step_ends": LIST_I32,
        "step_labels": pl.List(F64),
        "split": STR,
    },
    unique=("prompt_id", "sample_idx"),
)
PRM_METRICS = _table("prm_metrics", 1, {"step": I32, "loss": F64, "lr": F64}, open=True)
# The held-out responses scored by the trained PRM: its probability that each step is right.
PRM_EVAL = _table(
    "prm_eval",
    1,
    {"prompt_id": STR, "sample_idx": I32, "step_labels": pl.List(F64), "step_scores": pl.List(F64)},
    unique=("prompt_id", "sample_idx"),
)

# The frozen reference's sequence logprobs (sums over response tokens) of every pair, for DPO.
REF_LOGPROBS = _table(
    "ref_logprobs",
    1,
    {"prompt_id": STR, "pair_idx": I32, "chosen_logp": F64, "rejected_logp": F64},
    unique=("prompt_id", "pair_idx"),
)

DPO_METRICS = _table(
    "dpo_metrics",
    1,
    {
        "step": I32,
        "loss": F64,
        "lr": F64,
        "reward_margin": F64,
        "reward_accuracy": F64,
        "chosen_logp": F64,
        "rejected_logp": F64,
    },
    open=True,
)

DPO_EVAL = _table("dpo_eval", 1, PAIR_EVAL_COLUMNS, unique=("prompt_id", "pair_idx"))

TABLES: dict[str, TableSchema] = {
    t.name: t
    for t in (
        DATASET,
        SFT_DATA,
        SFT_METRICS,
        PROMPTS,
        ROLLOUTS,
        TURNS,
        CARRY,
        SCORES,
        BATCH,
        LOGPROBS,
        ADVANTAGES,
        PROMPT_STATS,
        TRAIN_METRICS,
        EVAL,
        PREFERENCE_RANKINGS,
        PREFERENCE_PAIRS,
        RM_METRICS,
        RM_EVAL,
        PRM_STEPS,
        PRM_METRICS,
        PRM_EVAL,
        REF_LOGPROBS,
        DPO_METRICS,
        DPO_EVAL,
    )
}

# `make bench`: one row per benchmark, the baseline and rlpipe measured side by side in the same run. `ratio` is
# rlpipe's advantage (greater is better), except for iteration_overhead, where it is the overhead fraction.
BENCH_RESULTS = _table(
    "bench_results",
    1,
    {"benchmark": STR, "baseline": STR, "baseline_value": F64, "rlpipe_value": F64, "unit": STR, "ratio": F64},
    unique=("benchmark",),
)
