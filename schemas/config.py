"""The one validated run configuration.

Loaded once from YAML (plus `--set a.b=value` overrides), frozen, and saved resolved as
`runs/{run_id}/config.yaml`. Every option with a fixed set of values is a `Literal`, so a typo fails at load
time with a message naming the key, never deep inside a stage; a choice that a registry holds (estimators,
objectives, aggregations, KL estimators, tool-call formats) is checked against that registry, its one list.
Imports: the registries (the algorithms' and tool-call formats' names, estimators' needs) inside the validators: the
schemas layer imports nothing of tasks at import time, and nothing of tasks/rewards at all (its modules import this
one: the built-in reward names are in schemas/builtin_rewards.py, the reward's score columns in
`RewardConfig.source_columns`) (docs/architecture.md, Layout).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import re
import string
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import pydantic_core
import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from schemas.builtin_rewards import BUILTIN_REWARD_NEEDS
from schemas.errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration that cannot be used; the message is one line and names the key."""


class Section(BaseModel):
    # allow_inf_nan: `optim.lr=.inf` or a NaN weight is a typo, never a setting.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    # Keys that change no stage's data (where and how engines run; whether a stage stops on what it cannot use): no
    # stage fingerprint includes them.
    PLACEMENT_KEYS: ClassVar[frozenset[str]] = frozenset()
    # Keys added after runs existed: a fingerprint includes them only when they differ from their default, so a run
    # that never set one keeps the fingerprints it was written with.
    HASHED_WHEN_SET: ClassVar[frozenset[str]] = frozenset()
    # A whole section added after runs existed: a fingerprint includes it only when it differs from its default.
    OMITTED_AT_DEFAULT: ClassVar[bool] = False


def _as_list(value: Any) -> Any:
    """A single path where a list is expected (`--set data.train_files=x.parquet`) is a list of one."""
    return [value] if isinstance(value, str) else value


FileList = Annotated[list[str], BeforeValidator(_as_list)]


@dataclass(frozen=True)
class Registered:
    """A choice whose values are a registry's names (tasks/registry.py): written once, at the registry's `register`
    calls. The registry is imported when a config is validated, not with this module (the schemas layer imports
    nothing of tasks at import time); the config reference lists its names (schemas/reference.py)."""

    where: str  # "module:ATTRIBUTE"

    def registry(self):
        module, attr = self.where.split(":")
        return getattr(importlib.import_module(module), attr)

    def __call__(self, value: str) -> str:
        registry = self.registry()
        if value not in registry:
            raise ValueError(f"unknown {registry.family} {value!r}: choose one of {', '.join(registry.names())}")
        return value


def registered(where: str):
    """The type of a config field whose choices are the names of the registry at `where`."""
    check = Registered(where)
    return Annotated[str, AfterValidator(check), check]


class ModelConfig(Section):
    path: str = Field(
        "models/demo-sft",
        description="The RL policy's starting point and its frozen reference: any local "
        "Hugging Face causal LM folder (config.json, weights, tokenizer) that transformers and vLLM load.",
    )
    base_path: str = Field(
        "models/demo-base", description="The SFT starting point (`rlpipe sft` trains it and exports to `path`)."
    )
    recipe: str | None = Field(
        "infra/model/demo_llama.yaml",
        description="`rlpipe init-model` builds `base_path` from this "
        "recipe (architecture, sizes, tokenizer); None when you bring your own model.",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Weights and compute dtype of both engines (vLLM "
        "and the DeepSpeed trainer). bfloat16 halves memory on GPUs; the sampler's "
        "logprobs then differ from the trainer's (see loss.rollout_is).",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass: less memory, ~30% more time."
    )


class LoraConfig(Section):
    """Low-rank adapters (peft's LoRA) on the policy: RL, SFT and DPO train only the adapter, the frozen reference is
    the same model with the adapter switched off, and the sampler loads each iteration's adapter (vLLM's LoRA) instead
    of the whole model. Off while `rank` is None. PPO's critic and the reward model train all their weights."""

    # A section added after runs existed: hashed only when set, so runs without it keep their fingerprints.
    OMITTED_AT_DEFAULT: ClassVar[bool] = True

    rank: int | None = Field(
        None,
        ge=1,
        le=512,
        description="The adapter's rank r (at most 512, vLLM's largest); None trains all weights (no LoRA).",
    )
    alpha: float = Field(32.0, gt=0, description="The adapter's scale is alpha / rank.")
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Dropout on the adapter's input while training (0 keeps an update "
        "reproducible from the seed alone).",
    )
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description="The linear layers that get an adapter, by module name (`q_proj`, or a full dotted name), "
        "or `all-linear`: every linear layer but the output layer.",
    )
    modules_to_save: list[str] = Field(
        [],
        description="Modules trained in full next to the adapter and saved with it "
        "(e.g. `lm_head`); vLLM must support them for the model (it loads them with the adapter).",
    )

    @field_validator("target_modules")
    @classmethod
    def _named(cls, value):
        if isinstance(value, list) and (not value or not all(isinstance(v, str) and v.strip() for v in value)):
            raise ValueError("target_modules must be `all-linear` or a non-empty list of module names")
        return value

    @property
    def enabled(self) -> bool:
        return self.rank is not None


class PromptConfig(Section):
    """How a prompt becomes the tokens the model sees; one function (tasks/data/formatting.py) serves rollouts, eval,
    SFT, DPO and reward-model training, so the trainer scores exactly what the sampler saw."""

    chat_template: Literal["auto", "always", "never"] = Field(
        "auto",
        description="auto: the tokenizer's chat template (with the generation prompt) when it has one, else "
        "`template`; always: the chat template (an error if the tokenizer has none); never: `template` "
        "(base models). A prompt given as chat messages always needs the chat template.",
    )
    system_prompt: str | None = Field(
        None,
        description="Prepended as a system message (chat), or filled into {system} (template), "
        "unless the prompt's messages already start with one.",
    )
    template: str = Field(
        "{prompt}",
        description="The plain prompt of a base model: a format string with {prompt} "
        "(and optionally {system}), e.g. 'Question: {prompt}\nAnswer:'.",
    )

    @field_validator("template")
    @classmethod
    def _known_placeholders(cls, value: str) -> str:
        fields = {name for _, name, _, _ in string.Formatter().parse(value) if name is not None}
        unknown = fields - {"prompt", "system"}
        if unknown or "prompt" not in fields:
            raise ValueError(
                f"template {value!r} must contain {{prompt}} and no placeholder but {{system}}"
                + (f" (found {{{sorted(unknown)[0]}}})" if unknown else "")
            )
        return value


def check_seed_ranges(what: str, seed: int, train_draws: int, eval_seed: int, eval_draws: int) -> None:
    """reasoning-gym seeds entry i with seed + i: overlapping ranges would draw the same entries on both sides."""
    train, held_out = (seed, seed + train_draws), (eval_seed, eval_seed + eval_draws)
    if train[0] < held_out[1] and held_out[0] < train[1]:
        raise ValueError(
            f"{what}.eval_seed {eval_seed}: reasoning-gym draws entry i from seed + i, and the held-out draws "
            f"[{held_out[0]}, {held_out[1]}) meet the train draws [{train[0]}, {train[1]})"
        )


# balance_eval_labels: how far past eval_seed a balanced held-out set may draw, in multiples of n_eval (a label with
# a share of 1/16 among the task's answers can still fill half of a two-label set).
BALANCED_DRAWS = 16


class ReasoningGymDraws(Section):
    """The seeds and the system prompt of prompts drawn from reasoning-gym (a generated source, the built-in task)."""

    seed: int = Field(1234, ge=0, description="The train entries' seed (reasoning-gym draws entry i from seed + i).")
    eval_seed: int = Field(
        1_000_000_000,
        ge=0,
        description="The held-out entries' seed; its range of 2 × n_eval draws (a generator's with "
        f"balance_eval_labels: {BALANCED_DRAWS} × n_eval) must not meet the train range.",
    )
    system_prompt: str | None = Field(
        None,
        description="The system message before each question; None: reasoning-gym's default, which asks for the "
        "final answer in <answer> tags.",
    )


class ReasoningGymGenerator(ReasoningGymDraws):
    """A source's prompts generated here, offline, from one of reasoning-gym's tasks (docs/reasoning-tasks.md)."""

    task: str = Field(..., description="reasoning-gym's task name (leg_counting, chain_sum, gsm_symbolic, ...).")
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="The task's settings: the fields of its config dataclass (leg_counting: min_animals, ...); its "
        "size and seed are this section's. With a curriculum, the settings it steps through replace these.",
    )
    n_train: int = Field(1000, ge=1, description="Train prompts (with a curriculum: at each level).")
    n_eval: int = Field(100, ge=1, description="Held-out prompts, none asked in training.")
    balance_eval_labels: bool = Field(
        False,
        description="Draw the held-out prompts so that each distinct answer of a categorical task (syllogism's Yes and "
        f"No) gets an equal share, drawing on past 2 × n_eval entries as needed (up to {BALANCED_DRAWS} × n_eval); "
        "then a model that always gives one answer scores 1 / (the number of answers). false: the task's own mix.",
    )

    HASHED_WHEN_SET: ClassVar[frozenset[str]] = frozenset({"balance_eval_labels"})  # added after runs existed

    @property
    def eval_draws(self) -> int:
        """How many entries from eval_seed the held-out prompts may come from (their seed range): twice n_eval, so
        that dropping the questions training asks still leaves n_eval; balanced, BALANCED_DRAWS × n_eval."""
        return (BALANCED_DRAWS if self.balance_eval_labels else 2) * self.n_eval


class CurriculumConfig(Section):
    """A source that steps through difficulty levels by a rule on its own measured train accuracy: a generator's
    (reasoning-gym's own curriculum for the task, every attribute at the level), or its files' `level` column."""

    levels: int = Field(
        ...,
        ge=2,
        description="Levels 0 .. levels-1: of the task's curriculum, each with n_train prompts, or of the files' "
        "`level` column.",
    )
    start_level: int = Field(0, ge=0, description="The level of the first iteration.")
    window: int = Field(
        2, ge=1, description="Move up after this many iterations at a level, each at or over the threshold."
    )
    threshold: float = Field(
        0.7,
        description="The source's mean reward over its samples of an iteration (for reasoning-gym's rewards in "
        "[0, 1], its accuracy) that counts towards moving up.",
    )
    eval_level: int | None = Field(
        None,
        ge=0,
        description="A generator's held-out prompts' level; None: the last (the difficulty the curriculum aims "
        "at). A file source's held-out files are evaluated whole.",
    )

    @model_validator(mode="after")
    def _levels(self) -> "CurriculumConfig":
        for key in ("start_level", "eval_level"):
            value = getattr(self, key)
            if value is not None and value >= self.levels:
                raise ValueError(f"curriculum.{key}={value} is not one of the levels 0..{self.levels - 1}")
        return self


class DataSource(Section):
    """One source of prompts in a mix: files, or a generator; its rows carry its name as the `source` column."""

    name: str = Field(
        ...,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="Its name: the `source` column of its rows, and the key of its eval figures.",
    )
    weight: float = Field(1.0, ge=0, description="Its share of each round's prompts (weights are normalised).")
    train_files: FileList = Field(default_factory=list, description="Its prompt files (read as data.train_files).")
    eval_files: FileList = Field(
        default_factory=list, description="Its held-out files; empty: data.eval_fraction of its train rows."
    )
    reasoning_gym: ReasoningGymGenerator | None = Field(
        None, description="Instead of files: prompts generated from a reasoning-gym task."
    )
    curriculum: CurriculumConfig | None = Field(
        None,
        description="Step through difficulty levels (docs/reasoning-tasks.md): a reasoning_gym generator's, or the "
        "integer `level` column (0 .. levels-1) of the source's files.",
    )

    @model_validator(mode="after")
    def _kind(self) -> "DataSource":
        what = f"data.sources[{self.name}]"
        if bool(self.train_files) == (self.reasoning_gym is not None):
            raise ValueError(f"{what}: name either train_files or a reasoning_gym generator (one of the two)")
        if self.eval_files and self.reasoning_gym is not None:
            raise ValueError(f"{what}: a reasoning_gym generator writes its own held-out prompts (no eval_files)")
        g = self.reasoning_gym
        if g is not None:
            levels = self.curriculum.levels if self.curriculum else 1
            check_seed_ranges(f"{what}.reasoning_gym", g.seed, levels * g.n_train, g.eval_seed, g.eval_draws)
        return self


class DataConfig(Section):
    """Your prompts: Parquet or JSONL files (paths or globs), read once into the run's `dataset` table."""

    train_files: FileList = Field(
        default_factory=list, description="Prompt files for RL (Parquet or JSONL; globs allowed)."
    )
    eval_files: FileList = Field(
        default_factory=list, description="Held-out prompt files for eval; empty: see eval_fraction."
    )
    eval_fraction: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="With no eval_files: a seeded random fraction of the train rows held out for eval (0: no eval).",
    )
    prompt_key: str = Field(
        "prompt", description="The column holding the prompt: a string, or a list of chat messages {role, content}."
    )
    answer_key: str | None = Field(
        "answer",
        description="The ground-truth column; a dotted path reaches a nested field "
        "(verl's layout: reward_model.ground_truth). None: the data has no ground truth.",
    )
    id_key: str | None = Field(None, description="A column of unique prompt ids; None numbers the rows.")
    max_prompt_tokens: int = Field(
        1024, ge=1, description="Prompts longer than this (after formatting) are dropped or refused."
    )
    overlong_prompts: Literal["drop", "error"] = Field(
        "drop",
        description="drop: overlong prompts are left out and counted in "
        "the dataset manifest; error: the first one stops the run with its id.",
    )
    sources: list[DataSource] = Field(
        default_factory=list,
        description="Several prompt sources mixed by weight in every round (instead of train_files/eval_files), "
        "each evaluated apart (docs/reasoning-tasks.md).",
    )

    HASHED_WHEN_SET: ClassVar[frozenset[str]] = frozenset({"sources"})

    @model_validator(mode="after")
    def _sources(self) -> "DataConfig":
        if not self.sources:
            return self
        if self.train_files or self.eval_files:
            raise ValueError("data.sources replaces data.train_files/eval_files: name the files in their source")
        names = [s.name for s in self.sources]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"data.sources: the name {twice[0]!r} is used twice")
        if not any(s.weight > 0 for s in self.sources):
            raise ValueError("data.sources: every weight is 0; at least one source must be drawn from")
        return self


class ArithmeticTask(Section):
    """Built-in example task: integer arithmetic (`37+58=` → `95`), answers of 1-3 tokens."""

    name: Literal["arithmetic"] = Field("arithmetic", description="The built-in task: arithmetic.")
    out_dir: str = Field(
        "data/arithmetic", description="Where its files are written (train.parquet, eval.parquet, sft.parquet)."
    )
    max_operand: int = Field(99, ge=1, le=99_999, description="The largest operand.")
    operations: str = Field(
        "+-", pattern=r"^[+\-*]+$", description="The operations drawn from, as characters (+, -, *)."
    )
    pad_operands: bool = Field(
        False,
        description="Write operands with a fixed number of digits (`07+58=`): fixed digit positions make the task "
        "much easier to learn.",
    )
    n_eval: int = Field(256, ge=1, description="Held-out prompts, never in the train file.")
    seed: int = Field(1234, description="The draw of the prompts and of the held-out split.")
    sft_demos: int = Field(20_000, ge=1, description="Demonstrations written to sft.parquet.")
    demo_seed: int = Field(
        0, description="The demonstrations' draw (prompts with replacement, and the teacher's errors)."
    )
    teacher_flaw: Literal["none", "forget_carry"] = Field(
        "none",
        description="A systematic error in the demonstrations (forget_carry: the carry is dropped), for tasks where "
        "RL must fix what SFT taught.",
    )
    teacher_flaw_rate: float = Field(
        0.0, ge=0, le=1, description="The fraction of demonstrations with the flaw, among those where it applies."
    )


class LongAdditionTask(Section):
    """Built-in example task with long answers: multi-digit addition written out column by column
    (`4821+3567=` → `1+7=8;2+6=8;8+5=13;4+3+1=8;#### 8388`), judged on the final `####` answer."""

    name: Literal["long_addition"] = Field("long_addition", description="The built-in task: long_addition.")
    out_dir: str = Field(
        "data/long_addition", description="Where its files are written (train.parquet, eval.parquet, sft.parquet)."
    )
    digits: int = Field(4, ge=1, le=32, description="Digits per operand.")
    n_train: int = Field(20_000, ge=1, description="Train prompts.")
    n_eval: int = Field(256, ge=1, description="Held-out prompts.")
    seed: int = Field(1234, description="The draw of the prompts and of the held-out split.")
    sft_demos: int = Field(20_000, ge=1, description="Demonstrations written to sft.parquet.")
    teacher_flaw: Literal["none", "forget_carry"] = Field(
        "none",
        description="A systematic error in the demonstrations (forget_carry: a column's sum drops its carry-in).",
    )
    teacher_flaw_rate: float = Field(
        0.0, ge=0, le=1, description="The fraction of demonstrations with the flaw, among those where it applies."
    )


class ChatArithmeticTask(Section):
    """Built-in example task for chat models: arithmetic questions in plain English as chat messages (`What is 7 × 5?`,
    `Subtract 3 from 9.`), several phrasings each; the answer is the integer (judged by a reward file of yours)."""

    name: Literal["chat_arithmetic"] = Field("chat_arithmetic", description="The built-in task: chat_arithmetic.")
    out_dir: str = Field(
        "data/chat_arithmetic", description="Where its files are written (train.parquet, eval.parquet, sft.parquet)."
    )
    min_operand: int = Field(0, ge=0, le=99_999, description="The smallest operand.")
    max_operand: int = Field(12, ge=0, le=99_999, description="The largest operand.")
    operations: str = Field(
        "+-*", pattern=r"^[+\-*]+$", description="The operations drawn from, as characters (+, -, *)."
    )
    n_train: int | None = Field(
        None, ge=1, description="Train prompts (the first ones after the held-out draw); None: all the rest."
    )
    n_eval: int = Field(
        256, ge=1, description="Held-out prompts; no held-out question is asked in training in the same words."
    )
    seed: int = Field(1234, description="The draw of the questions, their phrasings and the held-out split.")
    sft_demos: int = Field(
        2000, ge=1, description="Demonstrations written to sft.parquet: the equation alone (`7 × 5 = 35`)."
    )

    @model_validator(mode="after")
    def _range(self) -> "ChatArithmeticTask":
        if self.min_operand > self.max_operand:
            raise ValueError(f"task.min_operand={self.min_operand} exceeds task.max_operand={self.max_operand}")
        return self


TaskConfig = Annotated[ArithmeticTask | LongAdditionTask | ChatArithmeticTask, Field(discriminator="name")]

# What a reward function may take as keyword arguments besides the dataset's own columns (tasks/rewards/loader.py).
REWARD_ARGUMENTS = (
    "prompt",
    "messages",
    "response",
    "ground_truth",
    "finish_reason",
    "length",
    "max_tokens",
    "prompt_id",
    # multi-turn rollouts (the agent section); None, or 0, for a single turn
    "turns",
    "env_reward",
    "tool_calls",
    "tool_errors",
    # the response split into steps (reward.steps), for process rewards
    "steps",
    # reward.sandbox (schemas.config.SandboxConfig), for functions that run model-written code
    "sandbox",
)
# verl's and TRL's names for the same values (per sample), and TRL's batched names (tasks/rewards/loader.py).
ALIAS_ARGUMENTS = ("solution_str", "completion", "completion_ids")
TRL_BATCHED_ARGUMENTS = ("completions", "prompts")
# Names a dataset column or a function's kwargs may not take: rlpipe passes them.
RESERVED_ARGUMENTS = REWARD_ARGUMENTS + ALIAS_ARGUMENTS + TRL_BATCHED_ARGUMENTS
REWARD_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


class RewardFunctionConfig(Section):
    """One reward function: a built-in (no path or module), or yours by reference."""

    weight: float = Field(1.0, description="Its weight in the total reward; 0 still scores it, in its own column.")
    path: str | None = Field(
        None, description="A Python file defining the function (relative to the working directory)."
    )
    module: str | None = Field(None, description="An importable module defining the function, e.g. mypkg.rewards.")
    function: str | None = Field(
        None, description="The function's name in the file or module (default: this entry's name)."
    )
    batched: bool = Field(
        False, description="Called once per chunk with a list per argument, returning a list of scores."
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments for every call (e.g. a format pattern)."
    )
    per_step: bool = Field(
        False,
        description="A process reward: it returns one score per step of `steps` (reward.steps splits the response), "
        "kept in scores as steps_<name>; score_<name> is their step_aggregate, and advantage.estimator grpo_process "
        "turns them into token advantages.",
    )
    step_aggregate: Literal["mean", "min", "product"] = Field(
        "mean", description="per_step: how the step scores become the sample's score_<name>."
    )

    @model_validator(mode="after")
    def _one_source(self) -> "RewardFunctionConfig":
        if self.path and self.module:
            raise ValueError("give path or module, not both")
        if self.function and not (self.path or self.module):
            raise ValueError("function needs a path or a module")
        taken = sorted(set(self.kwargs) & set(RESERVED_ARGUMENTS))
        if taken:
            raise ValueError(f"kwargs may not set {taken[0]!r}: rlpipe passes it")
        return self


class StepSplitConfig(Section):
    """How a response is split into steps for process rewards (docs/algorithms.md, "Process rewards")."""

    delimiter: str = Field(
        "\n", min_length=1, description="A step ends after each occurrence of this text (part of the step it ends)."
    )
    regex: str | None = Field(
        None, description="In place of delimiter: a step ends after each match of this regular expression."
    )

    @field_validator("regex")
    @classmethod
    def _compiles(cls, regex: str | None) -> str | None:
        if regex is not None:
            try:
                if re.compile(regex).search(""):
                    raise ValueError(f"reward.steps.regex {regex!r} matches the empty string")
            except re.error as exc:
                raise ValueError(f"reward.steps.regex {regex!r} is not a regular expression: {exc}") from None
        return regex


class SandboxConfig(Section):
    """Where model-written code runs: the built-in code_tests reward, and any reward function that calls
    tasks.rewards.sandbox.run_python (docs/operations.md, "Security", says what each mode guarantees)."""

    HASHED_WHEN_SET: ClassVar[frozenset[str]] = frozenset({"allow_unisolated"})  # added after runs existed

    mode: Literal["bwrap", "rlimits"] = Field(
        "bwrap",
        description="bwrap: bubblewrap namespaces (no host files, no network, no process outlives the run) plus the "
        "limits; rlimits: the resource limits alone, no isolation (only where you trust the code).",
    )
    timeout_s: float = Field(2.0, gt=0, le=600, description="Wall-clock seconds per program run (one test).")
    memory_mb: int = Field(512, ge=64, description="Address space per process, MiB.")
    max_processes: int = Field(16, ge=1, description="Processes and threads the program may have at once.")
    max_output_kb: int = Field(1024, ge=1, description="The largest file it may write, stdout and stderr included.")
    scratch_mb: int = Field(64, ge=1, description="bwrap: the size of its writable working folder and of its /tmp.")
    python: str | None = Field(
        None,
        description="The Python programs run on, with its standard library only (default: rlpipe's, outside its "
        "virtual environment; as root, one the user nobody can read: /usr/bin/python3 for a Python under /root).",
    )
    allow_unisolated: bool = Field(
        False,
        description="rlimits mode when rlpipe does not run as root: the program then runs as rlpipe's own user and "
        "can reach rlpipe's processes and files, the tests and the verdict included. Refused unless this is true.",
    )


JUDGE_POINTWISE_TEMPLATE = (
    "You are grading a response to a task.\n\nTask:\n{prompt}\n\nResponse:\n{response}\n\n"
    "Rate the response from 0 (wrong or useless) to 10 (fully correct and clear). "
    "Reply with the integer alone."
)
JUDGE_GROUP_TEMPLATE = (
    "You are comparing {n} responses to the same task.\n\nTask:\n{prompt}\n\n{responses}\n\n"
    "Score every response from 0 (wrong or useless) to 10 (fully correct and clear), relative to the others. "
    'Reply with one line per response, "Response i: score", and nothing else.'
)
MAX_JUDGE_LOGPROBS = 100  # a local judge's engine starts allowing this many candidates, whatever its judges ask
# The fields a judge's template may name besides the dataset's own columns (tasks/rewards/judge.py fills them).
JUDGE_FIELDS = {"pointwise": {"prompt", "response", "ground_truth"}, "group": {"prompt", "responses", "n"}}


class JudgeConfig(Section):
    """An LLM judge (RLAIF): a model folder served by rlpipe's own vLLM engine, or an OpenAI-compatible endpoint, that
    scores each response (pointwise) or a whole group in one call (group, as ART's RULER); its score, normalised by
    `scale` to [0, 1], is score_<name>, and its prompt and text are judge_prompt_<name> and judge_text_<name>."""

    HASHED_WHEN_SET: ClassVar[frozenset[str]] = frozenset({"max_reply_chars", "max_failure_rate", "on_failure"})

    weight: float = Field(1.0, description="Its weight in the total reward.")
    model_path: str | None = Field(
        None,
        description="A local model folder, served by an engine of its own (not the policy's; its weights never "
        "change). Give this or base_url.",
    )
    base_url: str | None = Field(
        None, description="An OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1 (`vllm serve`)."
    )
    model: str | None = Field(None, description="base_url: the model name the endpoint serves.")
    api_key_env: str | None = Field(
        None, description="base_url: the environment variable holding its API key (none: no key is sent)."
    )
    chat: bool = Field(
        True,
        description="Send the rendered template as a user message through the judge's chat template (the chat "
        "completions API); false: as plain text (the completions API), for a base model.",
    )
    system: str | None = Field(None, description="chat: a system message before the template's.")
    mode: Literal["pointwise", "group"] = Field(
        "pointwise",
        description="pointwise: a call per response; group: a call per prompt, ranking its group's responses "
        "together (with rollout.group_size 2, a pairwise comparison).",
    )
    template: str | None = Field(
        None,
        description="A format string (double {{ and }} for literal braces). pointwise: {prompt}, {response}, "
        "{ground_truth} and any dataset column; group: {prompt}, {responses} (numbered 'Response i:' blocks), {n} "
        "and any dataset column. Default: a 0-10 rubric (docs/train-your-own-model.md, 'LLM judges').",
    )
    score: Literal["text", "logprobs"] = Field(
        "text",
        description="text: the first match of score_pattern in the judge's reply; logprobs (pointwise, a scale of "
        "single digits): the expected value over the scale's digit tokens in the first reply token's top_logprobs.",
    )
    score_pattern: str | None = Field(
        None,
        description="A regular expression. pointwise: group 1 is the score (default: the first number); group: "
        "group 1 is the response's number and group 2 its score (default: 'Response i: score').",
    )
    scale: tuple[float, float] = Field(
        (0.0, 10.0), description="The judge's [lowest, highest] score, mapped to [0, 1]; outside it is an error."
    )
    top_logprobs: int = Field(
        20, ge=1, le=MAX_JUDGE_LOGPROBS, description="score=logprobs: how many first-token candidates."
    )
    max_tokens: int = Field(64, ge=1, description="The judge's reply limit (tokens).")
    temperature: float = Field(0.0, ge=0, description="The judge's sampling temperature (0: greedy).")
    timeout_s: float = Field(
        120.0,
        gt=0,
        description="base_url: the wall-clock deadline of one call, seconds (connecting, waiting and reading "
        "together: a server that drips its reply is cut off too); past it that call's samples get an error.",
    )
    concurrency: int = Field(8, ge=1, description="base_url: calls in flight at once (the server batches them).")
    max_reply_chars: int = Field(
        32768,
        ge=1,
        description="A reply longer than this is cut to it before it is parsed and stored; judge_truncated_<name> "
        "records the cut.",
    )
    max_failure_rate: float = Field(
        0.5,
        gt=0,
        le=1,
        description="base_url: once 8 calls of a stage have ended and more than this fraction of them failed, the "
        "judge stops calling for the rest of the stage (the rest of its samples get that line as their error) and "
        "says so in one line; a stage whose samples' judge errors exceed it says so too.",
    )
    on_failure: Literal["skip", "stop"] = Field(
        "skip",
        description="What a judge past max_failure_rate does: skip (its samples score 0 with the error, the run "
        "goes on) or stop (the run stops with that line).",
    )
    kv_cache_gib: float = Field(1.0, gt=0, description="model_path: the engine's KV cache on CPU, GiB.")
    gpu_memory_utilization: float = Field(
        0.2, gt=0, lt=1, description="model_path, on a GPU: the engine's share of the GPU's memory."
    )
    dtype: Literal["float32", "bfloat16"] = Field("bfloat16", description="model_path: the engine's dtype.")

    @model_validator(mode="after")
    def _consistent(self) -> "JudgeConfig":
        if bool(self.model_path) == bool(self.base_url):
            raise ValueError("give model_path (a local judge) or base_url (an endpoint), one of them")
        if self.base_url:
            try:
                url = urllib.parse.urlsplit(self.base_url)
                ok = url.scheme in ("http", "https") and bool(url.hostname)
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"base_url {self.base_url!r} is not an http(s)://host[:port]/path URL")
            if not self.model:
                raise ValueError("base_url needs model (the name the endpoint serves)")
        if self.system and not self.chat:
            raise ValueError("system is a chat message: it needs chat: true")
        if self.scale[0] >= self.scale[1]:
            raise ValueError(f"scale {list(self.scale)} must be [lowest, highest]")
        if self.score == "logprobs":
            if self.mode != "pointwise":
                raise ValueError("score=logprobs reads one score per reply: mode pointwise only")
            if not all(float(v).is_integer() and 0 <= v <= 9 for v in self.scale):
                # most tokenizers write 10 as the tokens 1 and 0: only a single digit is one token
                raise ValueError("score=logprobs reads one token: a scale of single digits, e.g. [1, 5] or [0, 9]")
        if self.template is not None:
            fields = {name for _, name, _, _ in string.Formatter().parse(self.template) if name}
            needs = "response" if self.mode == "pointwise" else "responses"
            if needs not in fields:
                raise ValueError(f"a {self.mode} judge's template must contain {{{needs}}}")
            other = "responses" if self.mode == "pointwise" else "response"
            if other in fields:
                raise ValueError(f"a {self.mode} judge's template cannot contain {{{other}}}")
        if self.score_pattern is not None:
            try:
                groups = re.compile(self.score_pattern).groups
            except re.error as exc:
                raise ValueError(f"score_pattern {self.score_pattern!r} is not a regular expression: {exc}") from None
            if groups < (1 if self.mode == "pointwise" else 2):
                raise ValueError(f"score_pattern {self.score_pattern!r} needs a group for the score (group mode: two)")
        return self


class ProcessModelConfig(Section):
    """A process reward model (PRM) trained by `rlpipe rm-train` with reward_model.objective process: the response is
    split into steps (reward.steps) and the model's probability that each step is right is read at its last token."""

    path: str = Field(description="The PRM's folder (reward_model.out_path of its rm-train run).")
    weight: float = Field(1.0, description="Its weight in the reward (and, under grpo_process, on each step).")
    step_aggregate: Literal["mean", "min", "product"] = Field(
        "min", description="How its step probabilities become the sample's score_prm (min: the weakest step decides)."
    )


@dataclass(frozen=True)
class SourceColumns:
    """What one reward source writes into scores: its score columns with their weights in `reward` (0 included), and
    its per-step score lists (a process reward) with theirs."""

    parts: tuple[tuple[str, float], ...]
    step_parts: tuple[tuple[str, float], ...] = ()


class RewardConfig(Section):
    HASHED_WHEN_SET: ClassVar[frozenset[str]] = frozenset({"judges", "process_model"})  # added after runs existed

    kind: Literal["rule", "model"] = Field(
        "rule",
        description="rule: the weighted reward functions; model: plus a trained reward model at model_path, scored "
        "into its own score_model column.",
    )
    model_path: str | None = Field(None, description="A reward model trained by `rlpipe rm-train` (for kind=model).")
    model_weight: float = Field(1.0, description="The reward model's weight in the total reward.")
    # Each function writes its own score_<name> and error_<name> column in `scores`; the reward is the weighted sum.
    functions: dict[str, RewardFunctionConfig] = Field(
        default_factory=lambda: {
            "accuracy": RewardFunctionConfig(weight=1.0),
            "format": RewardFunctionConfig(weight=0.1),
        },
        description=f"name → a built-in ({', '.join(BUILTIN_REWARD_NEEDS)}) or {{path, function}} / "
        "{module, function} of yours.",
    )
    timeout_s: float = Field(
        5.0, gt=0, description="Per sample and function: past it the sample scores 0 with an error."
    )
    workers: int = Field(
        2, ge=0, description="Reward worker processes; 0: in the calling process, without the timeout."
    )
    steps: StepSplitConfig = Field(
        default_factory=StepSplitConfig, description="How responses are split into steps for process rewards."
    )
    sandbox: SandboxConfig = Field(
        default_factory=SandboxConfig, description="Where model-written code runs (the code_tests reward)."
    )
    judges: dict[str, JudgeConfig] = Field(
        default_factory=dict,
        description="name → an LLM judge (RLAIF): score_<name>, error_<name>, judge_prompt_<name> and "
        "judge_text_<name> in scores, weighted into the reward like a function.",
    )
    process_model: ProcessModelConfig | None = Field(
        None,
        description="A process reward model: its step probabilities in scores as steps_prm (with step_ends), their "
        "aggregate as score_prm, weighted into the reward; grpo_process reads the steps.",
    )
    stop_when_unscored: bool = Field(
        True,
        description="The scores stage stops the run, in one line naming the source and its first error, when a "
        "weighted reward function or judge scored none of a round's samples (each got an error: a function that "
        "always raises, a judge whose replies never match its score_pattern): the update would train on its zeros as "
        "if they were scores. false: those samples score 0 with their errors and the run goes on. Eval is not "
        "stopped. Changes no data: no stage's fingerprint includes it.",
    )
    # Whether the scores stage stops decides nothing of what it writes (it writes nothing when it stops).
    PLACEMENT_KEYS: ClassVar[frozenset[str]] = frozenset({"stop_when_unscored"})

    @field_validator("functions")
    @classmethod
    def _names_and_builtins(cls, functions: dict) -> dict:
        for name, spec in functions.items():
            if not REWARD_NAME.match(name) or name in ("model", "prm"):
                raise ValueError(f"{name!r} is not a usable reward name (letters, digits and _, not 'model' or 'prm')")
            if not (spec.path or spec.module) and name not in BUILTIN_REWARD_NEEDS:
                raise ValueError(
                    f"{name!r} is not a built-in reward function (choose one of "
                    f"{', '.join(sorted(BUILTIN_REWARD_NEEDS))}) and names no path or module"
                )
        return functions

    @field_validator("judges")
    @classmethod
    def _judge_names(cls, judges: dict) -> dict:
        for name in judges:
            if not REWARD_NAME.match(name) or name in ("model", "prm"):
                raise ValueError(f"{name!r} is not a usable judge name (letters, digits and _, not 'model' or 'prm')")
        return judges

    @model_validator(mode="after")
    def _model_needs_a_path(self) -> "RewardConfig":
        shared = sorted(set(self.judges) & set(self.functions))
        if shared:
            raise ValueError(f"{shared[0]!r} names both a reward function and a judge: their score columns would clash")
        if self.kind == "model" and not self.model_path:
            raise ValueError("reward.kind=model needs reward.model_path (a model trained by `rlpipe rm-train`)")
        code = [
            n for n, f in self.functions.items() if not (f.path or f.module) and BUILTIN_REWARD_NEEDS[n].runs_code
        ]  # (a name that is not a built-in was refused by _names_and_builtins)
        if code and self.timeout_s <= self.sandbox.timeout_s:
            raise ValueError(
                f"reward.timeout_s ({self.timeout_s:g}) must exceed reward.sandbox.timeout_s "
                f"({self.sandbox.timeout_s:g}): {code[0]} runs all of a sample's tests within it"
            )
        return self

    def source_columns(self) -> dict[str, SourceColumns]:
        """The reward sources this config uses, by their names in tasks/rewards/sources.py, in the order they score
        (a later one may read an earlier one's columns: the PRM reads the functions' step ends), with the columns each
        writes. Stated here, beside their sections, so that the config's own checks ask no module of tasks/rewards
        (those import the config); the sources say how they check and score."""
        f, pm = self.functions, self.process_model
        out = {
            "functions": SourceColumns(
                tuple((f"score_{n}", s.weight) for n, s in f.items()),
                tuple((f"steps_{n}", s.weight) for n, s in f.items() if s.per_step),
            )
        }  # always: it makes the table, whose `reward` is 0 without functions (a reward model alone)
        if self.kind == "model":
            out["model"] = SourceColumns((("score_model", self.model_weight),))
        if pm is not None:
            out["process_model"] = SourceColumns((("score_prm", pm.weight),), (("steps_prm", pm.weight),))
        if self.judges:
            out["judges"] = SourceColumns(tuple((f"score_{n}", j.weight) for n, j in self.judges.items()))
        return out

    def score_columns(self) -> list[str]:
        """Every score column the reward writes, weighted or not (what eval.judge may name, without `score_`)."""
        return [c for s in self.source_columns().values() for c, _ in s.parts]

    def weighted_parts(self) -> tuple[tuple[str, float], ...]:
        """The reward's weighted score columns (weight 0 left out): the one list the config's checks (GDPO) and the
        advantages stage ask."""
        return tuple((c, w) for s in self.source_columns().values() for c, w in s.parts if w)

    def weighted_step_parts(self) -> tuple[tuple[str, float], ...]:
        """The process rewards' step-score lists (steps_<name>, steps_prm) with their weights (0 left out)."""
        return tuple((c, w) for s in self.source_columns().values() for c, w in s.step_parts if w)


class UserCodeRef(Section):
    """A function or class of yours: a file (`path`) or an importable `module`, and its name there."""

    path: str | None = Field(None, description="A Python file defining it (relative to the working directory).")
    module: str | None = Field(None, description="An importable module defining it, e.g. mypkg.tools.")
    function: str | None = Field(
        None, description="Its name in the file or module (for a tool, default: the tool's name)."
    )

    @model_validator(mode="after")
    def _one_source(self) -> "UserCodeRef":
        if bool(self.path) == bool(self.module):
            raise ValueError("give path or module (one of them)")
        return self


class EnvironmentRef(UserCodeRef):
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for each instance.")


class BranchingConfig(Section):
    """ARPO's entropy-based adaptive rollout (Dong et al. 2025, arXiv 2507.19849): each prompt starts `initial`
    trajectories; after a tool result, the model's next turn is sampled and the entropy of its first `entropy_tokens`
    tokens compared with the trajectory's first turn's; the trajectory then branches at that point (before the turn)
    with probability clip(alpha + beta·ΔH, 0, 1), `copies` times, until the prompt holds rollout.group_size
    trajectories. A prompt whose trajectories have all ended before that is refilled with one fresh trajectory a
    turn. Every group ends with exactly rollout.group_size trajectories, as GRPO's."""

    initial: int = Field(
        4, ge=1, description="Trajectories each prompt starts with (the paper's N); the rest of the group branches."
    )
    alpha: float = Field(0.5, ge=0, le=1, description="The branch probability at no entropy change (the paper's α).")
    beta: float = Field(0.2, ge=0, description="The weight of the entropy change ΔH (the paper's β).")
    copies: int = Field(
        1, ge=1, le=64, description="Branching attempts per trajectory and tool result (the paper's Z)."
    )
    entropy_tokens: int = Field(
        20, ge=1, le=4096, description="The tokens at the start of a turn whose entropy is measured (the paper's k)."
    )
    top_logprobs: int = Field(
        10, ge=1, le=20, description="Candidates per token that the entropy is summed over (vLLM's logprobs)."
    )


class AgentConfig(Section):
    """Multi-turn rollouts: the model's turns alternate with your tools' results or your environment's messages, up to
    a limit; every turn is a row of the `turns` table, and only the model's own tokens get loss. Off while it names
    no tool and no environment."""

    OMITTED_AT_DEFAULT: ClassVar[bool] = True
    # added after agent runs existed
    HASHED_WHEN_SET: ClassVar[frozenset[str]] = frozenset({"max_tool_output_tokens", "branching"})

    tools: dict[str, UserCodeRef] = Field(
        default_factory=dict,
        description="name → {path or module, function}: plain functions with type hints and a docstring (their JSON "
        "schemas go to the chat template's tools=); the model calls them by name.",
    )
    environment: EnvironmentRef | None = Field(
        None,
        description="{path or module, function: the class, kwargs}: reset(row) → messages; step(messages) → "
        "(messages, reward or None, done). One instance per sample.",
    )
    tool_call_format: registered("tasks.agents.tool_calls:TOOL_CALL_PARSERS") = Field(
        "hermes",
        description="How the model writes tool calls: hermes (<tool_call>{json}</tool_call>, Qwen and most ChatML "
        "templates) or json (the whole turn one JSON call, Llama 3).",
    )
    max_turns: int = Field(4, ge=1, le=64, description="The model's turns per trajectory at most.")
    max_total_tokens: int = Field(
        512, ge=1, description="Tokens after the prompt per trajectory at most: the model's and the observations'."
    )
    max_tool_output_tokens: int | None = Field(
        256,
        ge=1,
        description="A tool result longer than this is cut to its first N tokens plus '...(truncated)' (the cut is "
        "the turns table's cut_tokens), so one long result cannot eat max_total_tokens; null: never cut.",
    )
    tool_timeout_s: float = Field(5.0, gt=0, description="Per tool call: past it the call's result is an error.")
    step_timeout_s: float = Field(
        5.0, gt=0, description="Per environment reset or step: past it the sample's episode ends with an error."
    )
    branching: BranchingConfig | None = Field(
        None,
        description="ARPO's adaptive branching after tool results (docs/algorithms.md, ARPO); null: every "
        "trajectory starts from the prompt. Needs tools and no environment.",
    )

    @property
    def enabled(self) -> bool:
        return bool(self.tools) or self.environment is not None


class RolloutConfig(Section):
    # Upper bounds are sanity, not tuning: far past what one machine samples or trains (preflight also checks
    # max_tokens against the model's context and prompts_per_round against the train prompts).
    group_size: int = Field(8, ge=1, le=4096, description="Samples per prompt (G).")
    prompts_per_round: int = Field(64, ge=1, le=1_000_000, description="Prompts sampled per round.")
    max_tokens: int = Field(8, ge=1, le=1_048_576, description="The longest response, in tokens.")
    min_tokens: int = Field(
        0,
        ge=0,
        le=1_048_576,
        description="Tokens every response has before EOS or a stop token may end it (vLLM's min_tokens); 0: none.",
    )
    temperature: float = Field(
        1.0,
        ge=0.01,  # vLLM raises a lower one to 0.01, and the trainer would score the samples at another T
        description="The sampling temperature T (≥ 0.01). The trainer scores the samples under the same "
        "softmax(logits / T) (π_old, the reference and the update, as verl, OpenRLHF and TRL do), and so does "
        "vLLM's sampler_logprobs column (its processed logprobs), so that loss.old_logprobs sampler works at any T; "
        "with LoRA, top_p < 1 or min_tokens > 0 that column stays at T = 1, and the settings that read it need T = 1.",
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling's p (1: off).")
    kv_cache_gib: float = Field(
        1.0,
        gt=0,
        le=4096,
        description="vLLM-CPU's KV cache, in GiB (set always: a default engine sizes it from the machine's memory); "
        "on a GPU, gpu_memory_utilization sizes it.",
    )
    gpu_memory_utilization: float = Field(
        0.5,
        gt=0,
        le=0.95,
        description="vLLM's share of GPU memory (weights, "
        "activations, KV cache); the rest is the colocated DeepSpeed trainer's.",
    )
    max_sync_logprob_gap: float = Field(
        1e-2,
        gt=0,
        description="After every weight sync the sampler's logprobs on the checkpoint's probe sequences are compared "
        "with the trainer's; a larger mean gap stops the run (fp32 on CPU measures ~1e-7; bf16 samplers need more "
        "room).",
    )
    stop: list[str] = Field(
        default_factory=list, description="Stop strings: generation ends at the first (left out of the text)."
    )
    stop_token_ids: list[int] = Field(
        default_factory=list, description="Token ids that end generation, besides the tokenizer's EOS."
    )
    # Scale-out: data-parallel vLLM replicas (prompts shared out, per-request seeds, so the table does not depend on
    # how many) and vLLM's tensor parallelism within each. Devices: engines.rollout_devices.
    engines: int = Field(
        1, ge=1, le=1024, description="vLLM replicas, each its own resident Ray actor; prompts are shared among them."
    )
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="GPUs per vLLM replica (vLLM's tensor parallelism).")
    partial_tokens: int | None = Field(
        None,
        ge=1,
        le=1_048_576,
        description="Partial rollouts (docs/long_responses.md): each sampling round, every sequence in flight "
        "generates at most this many tokens, then stops; one that has not ended (EOS, a stop, max_tokens) is carried "
        "(the `carry` table) and continued from its prefix in the next round, with the next iteration's weights once "
        "an update ran. A round admits new prompts while fewer than prompts_per_round groups are in flight; an "
        "iteration trains on the groups whose every sample has ended. Each token's policy version is a column "
        "(`token_versions`); rl.max_staleness bounds a sample's age. None: every response is generated whole.",
    )
    carry_surplus: bool = Field(
        False,
        description="Partial rollouts: a group that ended with every sample but was over batch.target_groups (the "
        "round ended more than the batch needed) is carried into the next iteration's first round as an ended group, "
        "scored again there and put first in that batch (rl.max_staleness bounds its age as for any carried group), "
        "instead of being dropped. Needs rollout.partial_tokens and rl.max_staleness ≥ 1.",
    )
    PLACEMENT_KEYS: ClassVar[frozenset[str]] = frozenset({"engines", "tensor_parallel_size"})
    HASHED_WHEN_SET: ClassVar[frozenset[str]] = frozenset({"min_tokens", "partial_tokens", "carry_surplus"})

    @model_validator(mode="after")
    def _min_within_max(self) -> "RolloutConfig":
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"rollout.min_tokens={self.min_tokens} exceeds rollout.max_tokens={self.max_tokens}")
        return self


class BatchConfig(Section):
    target_groups: int = Field(
        32,
        ge=1,
        le=1_000_000,
        description="Groups (prompts with all their samples) an update trains on; sampling rounds continue until this "
        "many are kept.",
    )
    max_rounds: int = Field(
        3, ge=1, le=1000, description="The most sampling rounds an iteration runs before it trains on what it has."
    )
    drop_zero_variance: bool = Field(
        True,
        description="Dynamic filtering (DAPO): leave out groups whose samples all got the same reward (zero "
        "advantage).",
    )


Estimator = registered("tasks.algos.advantages:ADVANTAGE_ESTIMATORS")
Objective = registered("tasks.algos.losses:OBJECTIVES")
Aggregation = registered("tasks.algos.losses:AGGREGATIONS")
KLEstimator = registered("tasks.algos.kl:KL_ESTIMATORS")


class AdvantageConfig(Section):
    HASHED_WHEN_SET: ClassVar[frozenset[str]] = frozenset({"branch_attribution"})  # added after runs existed

    estimator: Estimator = Field(
        "grpo",
        description="The advantage estimator (docs/algorithms.md); gae trains PPO's critic.",
    )
    eps: float = Field(1e-6, gt=0, description="Added to a group's reward standard deviation before dividing by it.")
    gamma: float = Field(1.0, ge=0, le=1, description="GAE's discount γ.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE's λ: 1 is Monte Carlo returns, 0 is TD(0).")
    pass_k: int = Field(
        4, ge=1, description="passk: the k whose pass@k the advantage optimises (at most rollout.group_size)."
    )
    correct_at: float = Field(
        1.0, description="passk: a response counts as correct when its reward is at least this (rewards are 0/1 there)."
    )
    teacher_path: str | None = Field(
        None,
        description="distill: the teacher, a local model folder with the policy's tokenizer; the logprobs stage scores "
        "every sampled token with it too.",
    )
    branch_attribution: Literal["soft", "hard"] = Field(
        "soft",
        description="Branched trajectories (agent.branching): soft, each trajectory's tokens get its own advantage "
        "(ARPO's default); hard, a token shared by several trajectories of the tree gets their mean advantage.",
    )


class LossConfig(Section):
    HASHED_WHEN_SET: ClassVar[frozenset[str]] = frozenset(
        {"old_logprobs", "off_policy_mask_threshold"}
    )  # added after runs existed

    objective: Objective = Field("clip", description="The policy objective (docs/algorithms.md); clip is PPO's.")
    aggregation: Aggregation = Field(
        "token-mean",
        description="How token losses become the minibatch's loss (docs/algorithms.md).",
    )
    clip_eps_low: float = Field(0.2, ge=0, description="The ratio's lower clip, 1 − ε_low.")
    clip_eps_high: float = Field(
        0.2, ge=0, description="The ratio's upper clip, 1 + ε_high (DAPO's clip-higher sets it above ε_low)."
    )
    dual_clip: float | None = Field(
        None,
        gt=1,
        description="Dual-clip PPO's c (> 1): caps the loss of negative-advantage tokens at c·|A|; None: off.",
    )
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus −c·H, aggregated like the loss.")
    overlong_filter: bool = Field(
        False, description="DAPO: responses cut off by rollout.max_tokens get no gradient (they stay in their groups)."
    )
    ptx_coef: float = Field(
        0.0,
        ge=0,
        description="PPO-ptx: γ_ptx × the NLL of SFT demonstrations (the sft section's files) added to each optimizer "
        "step.",
    )
    ptx_batch: int = Field(16, ge=1, description="Demonstrations per optimizer step for PPO-ptx.")
    old_logprobs: Literal["trainer", "sampler"] = Field(
        "trainer",
        description="Where π_old comes from. trainer: the logprobs stage recomputes it with the trainer's forward pass "
        "(verl's default). sampler: the per-token logprobs vLLM returned with each response (rollouts."
        "sampler_logprobs), and the trainer's old-logprob pass is skipped (verl's rollout-correction bypass mode); the "
        "reference pass still runs where a KL needs it. Safe where sampler and trainer agree (fp32 here: about 1e-5 "
        "apart); with bf16 engines keep trainer (sampler is refused there unless off_policy_mask_threshold bounds "
        "the gap; docs/long-responses.md).",
    )
    # Rollout correction: the sampler's logprobs (rollouts.sampler_logprobs) against the trainer's π_old.
    rollout_is: Literal["token", "sequence"] | None = Field(
        None,
        description="Truncated importance sampling of the sampler's samples: each token's policy loss weighted by "
        "min(π_old/π_sampler, rollout_is_threshold), the ratio per token or, sequence, the product over the response "
        "(Yao et al. 2025); None: off.",
    )
    rollout_is_threshold: float = Field(2.0, gt=0, description="The importance weight's cap.")
    rollout_rs: Literal["token", "sequence", "geometric"] | None = Field(
        None,
        description="Rejection by the sampler/trainer ratio (masked IS): tokens (token), or whole responses by the "
        "product (sequence) or geometric mean (geometric) of their ratios, outside [rollout_rs_threshold_lower, "
        "rollout_rs_threshold] get no policy loss; None: off.",
    )
    rollout_rs_threshold: float = Field(2.0, gt=1, description="Rejection's upper bound on the ratio.")
    rollout_rs_threshold_lower: float | None = Field(
        None, gt=0, lt=1, description="Rejection's lower bound; None: 1/rollout_rs_threshold."
    )
    rollout_veto_threshold: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="A response with any token whose ratio π_old/π_sampler is below this (e.g. 1e-4: a token the "
        "trainer finds near impossible) gets no policy loss at all; None: off.",
    )
    off_policy_mask_threshold: float | None = Field(
        None,
        gt=0,
        description="Off-policy sequence masking (DeepSeek-V3.2; TRL's off_policy_mask_threshold), δ: a response with "
        "negative advantage whose mean per-token log(π_sampler/π_θ) over its tokens exceeds δ gets no policy loss "
        "(π_θ the policy being trained, detached; TRL suggests δ = 0.5). None: off.",
    )
    sapo_tau_pos: float = Field(1.0, gt=0, description="SAPO's gate temperature τ for tokens with A > 0.")
    sapo_tau_neg: float = Field(
        1.05, gt=0, description="SAPO's gate temperature τ for tokens with A ≤ 0 (higher: their gradient fades sooner)."
    )
    cov_ratio: float = Field(
        2e-4,
        gt=0,
        le=1,
        description="Clip-Cov and KL-Cov: the share of a micro-batch's response tokens selected by their covariance of "
        "advantage and log-probability (at least one).",
    )
    clip_cov_lb: float = Field(1.0, description="Clip-Cov: tokens are picked among those with covariance above this.")
    clip_cov_ub: float = Field(5.0, description="Clip-Cov: ... and below this.")
    kl_cov_coef: float = Field(
        0.1, ge=0, description="KL-Cov: the coefficient k of |log π_θ − log π_old| on the selected tokens."
    )
    top_entropy_quantile: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Only the top share of a micro-batch's response tokens by entropy get the policy loss (0.2: the "
        "80/20 paper's); the others still count in the normalizers and the KL. 1: every token.",
    )
    entropy_target: float | None = Field(
        None,
        gt=0,
        description="Adaptive entropy bonus: each iteration the coefficient moves by entropy_coef_delta, up when the "
        "previous iteration's mean token entropy was at or below this (nats), down when above, within "
        "[entropy_coef_min, entropy_coef_max], starting from entropy_coef. None: a fixed entropy_coef.",
    )
    entropy_coef_delta: float = Field(0.005, gt=0, description="The adaptive entropy coefficient's step.")
    entropy_coef_min: float = Field(0.0, ge=0, description="The adaptive entropy coefficient's lower bound.")
    entropy_coef_max: float = Field(1.0, ge=0, description="The adaptive entropy coefficient's upper bound.")

    @property
    def corrects_rollout(self) -> bool:
        """Whether the update weighs tokens by π_old against the sampler (rollout correction)."""
        return bool(self.rollout_is or self.rollout_rs or self.rollout_veto_threshold)

    @property
    def reads_sampler(self) -> bool:
        """Whether the update reads the sampler's logprobs: a rollout correction, or the off-policy sequence mask."""
        return self.corrects_rollout or self.off_policy_mask_threshold is not None

    @property
    def uses_sampler_logprobs(self) -> bool:
        """Whether anything reads the sampler's logprobs: π_old from the sampler, or the update (reads_sampler)."""
        return self.old_logprobs == "sampler" or self.reads_sampler

    @model_validator(mode="after")
    def _ordered_bounds(self) -> "LossConfig":
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(f"loss.clip_cov_lb ({self.clip_cov_lb}) must be below clip_cov_ub ({self.clip_cov_ub})")
        if not self.entropy_coef_min <= self.entropy_coef <= self.entropy_coef_max and self.entropy_target is not None:
            raise ValueError(
                f"loss.entropy_coef ({self.entropy_coef}) must lie within [entropy_coef_min, entropy_coef_max] "
                f"([{self.entropy_coef_min}, {self.entropy_coef_max}]) with an entropy_target"
            )
        if self.old_logprobs == "sampler" and self.corrects_rollout:
            raise ValueError(
                "loss.old_logprobs sampler makes π_old the sampler's own logprobs, so a rollout correction "
                "(loss.rollout_is, rollout_rs, rollout_veto_threshold) would compare them with themselves: set "
                "loss.old_logprobs: trainer to correct the sampler/trainer gap"
            )
        return self


class KLConfig(Section):
    estimator: KLEstimator = Field("k3", description="The per-token KL estimator (docs/algorithms.md).")
    placement: Literal["reward", "loss", "none"] = Field(
        "loss",
        description="Where the KL goes: loss (β·KL added to the policy loss), reward (subtracted from the token "
        "rewards), or none.",
    )
    beta: float = Field(0.04, ge=0, description="The KL coefficient β (the starting one with an adaptive target).")
    target: float | None = Field(
        None,
        gt=0,
        description="Adaptive β (Ziegler et al.): β ← β·(1 + clip(KL/target − 1, ±0.2)·n/horizon), with KL the "
        "previous iteration's per-token KL and n its samples. None: fixed β.",
    )
    horizon: int = Field(10_000, ge=1, description="The adaptive controller's horizon, in samples.")


class CriticConfig(Section):
    """PPO's value model: the policy's backbone (any causal LM's `AutoModel`) plus a linear value head (one scalar per
    token), initialised from the policy checkpoint with a zeroed head and trained, every weight, by its own DeepSpeed
    engine. Used iff estimator=gae."""

    lr: float = Field(5e-4, gt=0, description="The critic's learning rate.")
    value_clip: float = Field(0.2, gt=0, description="ε_v of the clipped value loss.")
    coef: float = Field(0.5, gt=0, description="c_v: the value loss's weight in the critic's objective.")


class OptimConfig(Section):
    HASHED_WHEN_SET: ClassVar[frozenset[str]] = frozenset(
        {"micro_batch_tokens", "logprob_micro_batch_tokens"}
    )  # added after runs existed

    lr: float = Field(1e-4, gt=0, description="The policy's learning rate (AdamW).")
    warmup_steps: int = Field(
        0,
        ge=0,
        description="Linear warmup over the run's first optimizer steps: fresh Adam moments make the first steps move "
        "every weight by about lr.",
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW's weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="The gradient norm clip.")
    ppo_epochs: int = Field(1, ge=1, le=1000, description="Passes over an iteration's batch.")
    minibatches: int = Field(
        4,
        ge=1,
        le=1_000_000,
        description="Optimizer steps per pass: the batch is split into this many minibatches of whole groups.",
    )
    micro_batch_size: int = Field(
        64,
        ge=1,
        le=1_000_000,
        description="Samples per forward and backward pass (per rank); gradients accumulate over a minibatch. "
        "micro_batch_tokens, when set, takes its place.",
    )
    micro_batch_tokens: int | None = Field(
        None,
        ge=16,
        le=100_000_000,
        description="Tokens per forward and backward pass of the policy update (per rank), in place of a sample count "
        "(verl's use_dynamic_bsz, OpenRLHF's use_dynamic_batch): a minibatch's groups, or pieces of a group too long "
        "for it, are dealt to the trainer ranks balanced by tokens (Karmarkar-Karp) and packed into as few "
        "micro-batches of at most this many tokens as fit (a group's prompt counted once in each; a sample longer "
        "than the budget goes alone). The loss is the same: every aggregation divides by the minibatch's normalisers. "
        "The trainer's memory grows with it: SmolLM2-135M's update at 8,192 tokens without model."
        "gradient_checkpointing outgrew a 24 GiB machine beside its vLLM engine (docs/reasoning-tasks.md). "
        "None: micro_batch_size samples (docs/long-responses.md).",
    )
    logprob_micro_batch_tokens: int | None = Field(
        None,
        ge=16,
        le=100_000_000,
        description="The same budget for the passes without gradients (old, reference and teacher logprobs, a "
        "critic's values); None: micro_batch_tokens. Such a pass keeps no activations for a backward, so it affords "
        "a larger one.",
    )
    zero_stage: Literal[0, 1, 2, 3] = Field(
        1,
        description="DeepSpeed's ZeRO stage (0: none; 1, 2, 3 partition optimizer state, gradients, weights over the "
        "ranks).",
    )


class EnginesConfig(Section):
    """How engines live, not what they compute (no stage fingerprint includes it: both ways give the same data)."""

    resident_trainer: bool = Field(
        True,
        description="Keep the DeepSpeed engines and the reference in one process across iterations; false starts a "
        "worker process per logprobs and optimize stage that loads everything from disk.",
    )
    defer_optimizer_state: bool = Field(
        True,
        description="The resident trainer (one rank) answers an update once its weights are written and writes the "
        "DeepSpeed optimizer state while the next stages run; a command stopped before it is done redoes that update. "
        "false: the state is written before the optimize stage completes.",
    )
    agent_workers: int = Field(
        2, ge=1, le=64, description="Processes that run the agent section's tools and environment episodes."
    )
    train_ranks: int = Field(
        1,
        ge=1,
        le=1024,
        description="Data-parallel DeepSpeed ranks (one Ray actor each; gloo on CPU, NCCL on GPU) for every trainer. "
        "ZeRO optimizer state must be resumed by as many ranks as saved it.",
    )
    # GPU placement on one node (ignored without CUDA): the trainer ranks' devices (one per rank) and the vLLM
    # replicas' (tensor_parallel_size per replica). Overlapping lists colocate (time-share) the two, and then
    # rollout.gpu_memory_utilization must leave room for the trainer; disjoint lists split them.
    trainer_devices: list[int] | None = Field(None, description="CUDA device ids of the trainer ranks, one per rank.")
    rollout_devices: list[int] | None = Field(
        None, description="CUDA device ids of the vLLM replicas, tensor_parallel_size each."
    )
    ray_address: str | None = Field(
        None,
        description="The Ray cluster the engines run on: `auto` (the cluster `ray start` made on this node) or "
        "`HOST:PORT`. None starts a private local Ray instance for the command (loopback only, no dashboard) and stops "
        "it at the end. On a cluster the repository and storage_root must be at the same path on every node.",
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK",
        description="How each engine's actors (the trainer's ranks; the vLLM replicas) are placed over the cluster's "
        "nodes, by one Ray placement group per engine: PACK fills a node first (NCCL within a node is fastest), SPREAD "
        "prefers different nodes, STRICT_* insists. Only used with a bundle (trainer_bundle, rollout_bundle).",
    )
    trainer_bundle: dict[str, float] = Field(
        default_factory=dict,
        description="The Ray resources each trainer rank reserves, e.g. {GPU: 1, CPU: 8} on a GPU cluster, or a "
        "custom node resource. Empty: none reserved, and the ranks share the machine (the CPU path).",
    )
    rollout_bundle: dict[str, float] = Field(
        default_factory=dict,
        description="The Ray resources each vLLM replica reserves, e.g. {GPU: 2} for tensor_parallel_size 2. Empty: "
        "none reserved.",
    )
    colocate_sleep: bool = Field(
        False,
        description="A vLLM replica that shares its GPUs with the trainer sleeps between its generations (vLLM's "
        "sleep mode, level 1: its weights offloaded to host memory, its KV cache freed), so the update has the GPU's "
        "memory, and wakes before the next sync or generation; the sync probe checks the weights after each sync "
        "(a wake that restores the weights it already held is not probed again). "
        "Needs a CUDA or ROCm GPU (refused in one line elsewhere); not yet run on a GPU by rlpipe's tests.",
    )
    placement_timeout_s: float = Field(
        60.0,
        gt=0,
        description="An engine's placement group that Ray has not placed by then fails in one line naming what it "
        "needs and what the nodes have free (one the nodes could never hold fails at once). Raise it on a cluster "
        "that adds nodes on demand.",
    )
    collective_timeout_s: float = Field(
        600.0,
        gt=0,
        description="A trainer collective (gloo or NCCL) that waits longer fails, and the stage names the rank that "
        "did not answer: a hung rank or a lost node costs minutes, not the 30 minutes to days of the backends' own "
        "defaults.",
    )
    weight_sync: Literal["collective", "file"] = Field(
        "collective",
        description="How the rollout replicas get the policy after an update. collective: trainer rank 0 broadcasts "
        "its weights (with LoRA the adapter only) through vLLM's weight-transfer API, in packed chunks (vLLM's nccl "
        "engine between trainer and replicas on GPUs of their own; rlpipe's gloo engine, tensors in host memory, "
        "otherwise and for adapters), and a weights-only "
        "checkpoint (checkpoint.every) is written without weight files: a command that needs them on disk (rlpipe "
        "export, a resumed run) replays the updates since the last full checkpoint. file: every checkpoint holds its "
        "weights and each replica reloads them from disk (needed without engines.resident_trainer).",
    )
    weight_sync_bucket_mb: int = Field(
        16,
        ge=1,
        le=65536,
        description="The collective sync's chunk size: tensors are sent packed into flat chunks of at most this many "
        "MiB (vLLM's packed_buffer_size_bytes; a larger tensor is a chunk of its own). On 2 CPU cores over loopback "
        "16 MiB chunks moved 538 MB in 0.16-0.21 s, 256 MiB ones in 0.36 s.",
    )
    keep_optimizer_states: int | None = Field(
        2,
        ge=2,
        description="Keep the DeepSpeed optimizer state (`ds_state/`, 2-3× the weights) of the last N full RL "
        "checkpoints only (checkpoint.every). A resume needs the last two; an update whose predecessor's state was "
        "removed is redone by replaying the updates since an older state. None: keep all.",
    )


class CheckpointConfig(Section):
    """Which RL checkpoints keep what an exact resume needs (no fingerprint covers it: every interval gives the same
    weights)."""

    every: int = Field(
        10,
        ge=1,
        le=1_000_000,
        description="Write the weights and the optimizer state every N iterations and at the run's last; the "
        "iterations between write a weights-only checkpoint (with engines.weight_sync file its weight files, which the "
        "sampler loads; with collective none: the trainer holds them), removed once a later one is written. A resume "
        "replays the updates after the last full checkpoint from their cached batch, logprobs and advantages "
        "(byte-identical weights, no generation): N trades disk written against replay time. 1: a full checkpoint "
        "every iteration.",
    )


class TripwireConfig(Section):
    action: Literal["warn", "stop", "off"] | None = Field(
        None,
        description="What a firing does: `warn` logs one line naming the figure and the iteration; `stop` ends the "
        "run with that line and exit status 1, after the iteration's tables are written; `off` never checks. "
        "Default: the rule's own (docs/tripwires.md).",
    )
    bound: float | None = Field(
        None, description="The rule fires when its figure is at or above this; default: the rule's own."
    )


class RLConfig(Section):
    # Tripwires change no stage's data: whether the run goes on after an iteration, not what any stage writes.
    PLACEMENT_KEYS: ClassVar[frozenset[str]] = frozenset({"tripwires"})
    tripwires: dict[registered("tasks.algos.tripwires:TRIPWIRES"), TripwireConfig] = Field(
        {},
        description="Per rule (truncated_at_zero_reward, zero_variance_streak, logprob_gap, answer_collapse, "
        "repetition, reward_up_eval_down), its action (warn, stop, off) and bound, over the defaults: each figure is "
        "recorded every iteration in runs/RUN/tripwires.json and shown by `rlpipe show`, the report and the trackers "
        "(docs/tripwires.md).",
    )
    iterations: int = Field(
        10,
        ge=1,
        le=1_000_000,
        description="RL iterations (each: sample, score, filter, logprobs, advantages, one update).",
    )
    eval_every: int = Field(
        5, ge=1, le=1_000_000, description="Evaluate after every N iterations (and always after the last)."
    )
    max_staleness: int = Field(
        0,
        ge=0,
        le=1024,
        description="How many updates a sample may be behind the one that trains on it. Without partial rollouts, 0 "
        "or 1: 0 is on-policy (iteration k samples with the weights after update k−1); 1 is one-step off-policy (as "
        "verl's and prime-rl's async trainers): iteration k samples with the weights after update k−2, and its "
        "generation (rollouts, scores, batch) runs while update k−1 trains. It pays where the sampler and the trainer "
        "have devices of their own; where they share CPU cores it is slower (make bench ARGS=async: 1.51x the seconds "
        "an iteration on 2 cores). With rollout.partial_tokens, generation never runs ahead, and any N bounds the "
        "carried samples: a group whose oldest token was sampled more than N updates before the weights the update "
        "starts from is dropped before its next round (counted as `stale_groups` in train_metrics). The schedule is "
        "fixed by the config, not by timing, so a run is reproducible and resumes exactly. Pair it with a rollout "
        "correction (loss.rollout_is, e.g. --algo grpo,token_is): π_old is the weights before the update, the "
        "sampler's logprobs are the behaviour policy's.",
    )


class EvalConfig(Section):
    samples: int = Field(8, ge=1, le=4096, description="Sampled responses per held-out prompt, for pass@k.")
    pass_k: int = Field(4, ge=1, description="The k of pass@k (at most samples).")
    temperature: float = Field(1.0, gt=0, description="The sampled responses' temperature (the greedy pass is at 0).")
    max_prompts: int | None = Field(
        None, ge=1, description="Evaluate at most this many held-out prompts (the first ones)."
    )
    interim_prompts: int | None = Field(
        None,
        ge=1,
        description="Evals during training (every rl.eval_every iterations, "
        "but the last) use only the first N held-out prompts, the same ones each time: "
        "cheaper progress checks. The starting model and the final checkpoint are "
        "evaluated on every held-out prompt (up to max_prompts). None: all, every time.",
    )
    judge: str = Field(
        "accuracy",
        description="What decides a response is correct: a reward function of the run, `reward` (the weighted total) "
        "or `model` (the reward model's score).",
    )
    judge_threshold: float = Field(1.0, description="A response is correct when its judge's score is at least this.")

    @model_validator(mode="after")
    def _k_within_samples(self) -> "EvalConfig":
        if self.pass_k > self.samples:
            raise ValueError(f"pass_k ({self.pass_k}) exceeds samples ({self.samples})")
        return self


class SFTConfig(Section):
    """Supervised fine-tuning of model.base_path on demonstrations from files: a prompt column (a string or chat
    messages) and a response column, or one column of whole conversations whose last (assistant) message is the
    response. The loss covers the response tokens only (and the EOS after them)."""

    files: FileList = Field(default_factory=list, description="Demonstration files (Parquet or JSONL; globs allowed).")
    prompt_key: str = Field("prompt", description="The prompt column (a string or chat messages).")
    response_key: str = Field("response", description="The response column.")
    messages_key: str | None = Field(
        None, description="A column of conversations; when set, prompt_key and response_key are not used."
    )
    steps: int = Field(600, ge=1, le=100_000_000, description="Optimizer steps.")
    batch_size: int = Field(64, ge=1, description="Demonstrations per optimizer step.")
    lr: float = Field(1e-3, gt=0, description="Peak learning rate (linear warmup, then cosine to 10% of it).")
    warmup_steps: int = Field(30, ge=0, description="Linear warmup steps.")
    zero_stage: Literal[0, 1, 2, 3] = Field(1, description="DeepSpeed's ZeRO stage.")


class PreferenceConfig(Section):
    """Preference data: a user's file (`data`: Parquet or JSONL of pairs or K-wise rankings; prompts as strings or
    chat messages), or, when `data` is None, generated from the train prompts: `k` samples per prompt from
    model.path, ranked by the run's reward (higher is better; equal rewards tie)."""

    data: str | None = Field(
        None,
        description="Your preference file (Parquet or JSONL): pairs (prompt, chosen, rejected) or K-wise rankings "
        "(prompt, responses, ranks). None: generated from the train prompts.",
    )
    n_prompts: int = Field(4096, ge=2, description="Generated data: train prompts sampled.")
    k: int = Field(4, ge=2, description="Generated data: samples per prompt, ranked by the run's reward.")
    temperature: float = Field(1.0, gt=0, description="Generated data: the sampling temperature.")
    heldout_fraction: float = Field(
        0.1,
        gt=0,
        lt=1,
        description="The seeded fraction of prompts held out for evaluation (when the data has no split column).",
    )


class PreferenceTrainerConfig(Section):
    """What the reward-model and DPO trainers share (DeepSpeed, warmup then cosine to 10%)."""

    out_path: str = Field(None, description="Where the trained model is exported (a Hugging Face folder).")
    steps: int = Field(300, ge=1, le=100_000_000, description="Optimizer steps.")
    batch_size: int = Field(
        64, ge=1, description="Elements per optimizer step: rankings (reward model) or pairs (DPO)."
    )
    micro_batch_size: int = Field(64, ge=1, description="Elements per forward and backward pass (per rank).")
    lr: float = Field(1e-4, gt=0, description="Peak learning rate (linear warmup, then cosine to 10% of it).")
    warmup_steps: int = Field(10, ge=0, description="Linear warmup steps.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's weight decay.")
    zero_stage: Literal[0, 1, 2, 3] = Field(1, description="DeepSpeed's ZeRO stage.")


class RewardModelConfig(PreferenceTrainerConfig):
    """Bradley–Terry reward model: a sequence-classification head on the model.path backbone; or, with objective
    process, a process reward model: a token-classification head trained on step labels."""

    HASHED_WHEN_SET: ClassVar[frozenset[str]] = frozenset(
        {"objective", "step_label", "trainable_layers"}
    )  # added after runs existed

    objective: Literal["bradley_terry", "process"] = Field(
        "bradley_terry",
        description="bradley_terry: a sequence score from ranked responses; process: a PRM, the probability that each "
        "step is right, from step-labelled samples (BCE at each step's last token).",
    )
    step_label: str | None = Field(
        None,
        description="objective process: the per_step reward function (of reward.functions) whose step scores label "
        "the sampled steps, a step being right when its score is at least 0.5; default: the only per_step one.",
    )

    out_path: str = Field(
        "models/demo-rm", description="Where the trained reward model is exported (a Hugging Face folder)."
    )
    trainable_layers: int | None = Field(
        None,
        ge=1,
        description="Train only the top N transformer blocks, the final norm and the head; the embeddings and the "
        "blocks below stay frozen, so a step skips their backward pass (a cheaper step on a small machine). None: "
        "every weight.",
    )
    steps: int = Field(1500, ge=1, le=100_000_000, description="Optimizer steps.")
    batch_size: int = Field(
        64, ge=1, description="Rankings per optimizer step (a ranking is one element, whatever its K)."
    )
    micro_batch_size: int = Field(64, ge=1, description="Rankings per forward and backward pass (per rank).")
    lr: float = Field(1e-3, gt=0, description="Peak learning rate (linear warmup, then cosine to 10% of it).")
    warmup_steps: int = Field(20, ge=0, description="Linear warmup steps.")
    weight_decay: float = Field(
        0.1,
        ge=0,
        description="AdamW's weight decay; what lets the reward model generalise (without it held-out accuracy "
        "stalled near 0.69 on the tiny task).",
    )


def step_label_function(reward: "RewardConfig", reward_model: RewardModelConfig) -> str | None:
    """The per_step reward function whose step scores label a PRM's training steps (reward_model.step_label, or the
    only per_step function); None when there is none to use."""
    per_step = [name for name, f in reward.functions.items() if f.per_step]
    if reward_model.step_label:
        return reward_model.step_label if reward_model.step_label in per_step else None
    return per_step[0] if len(per_step) == 1 else None


class DPOConfig(PreferenceTrainerConfig):
    out_path: str = Field("models/demo-dpo", description="Where the trained model is exported (a Hugging Face folder).")
    beta: float = Field(0.1, gt=0, description="DPO's β: the strength of the implicit KL to the reference.")
    nll_coef: float = Field(
        0.0,
        ge=0,
        description="RPO: adds nll_coef × the chosen responses' per-token NLL; plain DPO (0) lowers the chosen "
        "likelihood too.",
    )


def sampler_logprobs_tempered(rollout: RolloutConfig, lora: LoraConfig) -> bool:
    """Whether the vLLM engine reports its logprobs after the sampling temperature (vLLM's processed_logprobs, set
    by VLLMSettings.from_config), so that they are the trainer's softmax(logits / T): at T ≠ 1, unless vLLM would
    fold in more than the temperature (top_p < 1, min_tokens > 0: the trainer applies neither) or LoRA trains (its
    weight-sync probe forces each token, a mask the processed logprobs would carry). Otherwise they stay the raw
    model's, at T = 1."""
    return rollout.temperature != 1.0 and lora.rank is None and rollout.top_p == 1.0 and rollout.min_tokens == 0


class RunConfig(Section):
    seed: int = Field(0, description="The run's seed: sampling, shuffling, initialisation; part of every fingerprint.")
    storage_root: str = Field("runs", description="Where runs are written (runs/RUN_ID/...).")
    model: ModelConfig = Field(ModelConfig(), description="The policy model and its dtype.")
    lora: LoraConfig = Field(LoraConfig(), description="LoRA adapters on the policy (off while lora.rank is None).")
    task: TaskConfig | None = Field(
        None, description="A built-in example task that writes its data files (then name them in data)."
    )
    data: DataConfig = Field(DataConfig(), description="Your prompt files and their columns.")
    prompt: PromptConfig = Field(
        PromptConfig(), description="How a prompt becomes tokens (chat template or a plain template)."
    )
    reward: RewardConfig = Field(RewardConfig(), description="The reward functions (and an optional reward model).")
    rollout: RolloutConfig = Field(RolloutConfig(), description="Sampling with vLLM.")
    agent: AgentConfig = Field(
        AgentConfig(), description="Multi-turn rollouts with your tools or environment (off unless one is named)."
    )
    batch: BatchConfig = Field(BatchConfig(), description="Dynamic sampling and filtering of groups.")
    advantage: AdvantageConfig = Field(AdvantageConfig(), description="The advantage estimator.")
    loss: LossConfig = Field(LossConfig(), description="The policy objective and its aggregation.")
    kl: KLConfig = Field(KLConfig(), description="The KL to the reference.")
    critic: CriticConfig = Field(CriticConfig(), description="PPO's value model (estimator gae).")
    optim: OptimConfig = Field(OptimConfig(), description="The policy's optimizer and update schedule.")
    engines: EnginesConfig = Field(
        EnginesConfig(), description="How engines live and where they run (no fingerprint covers it)."
    )
    rl: RLConfig = Field(RLConfig(), description="The RL loop.")
    checkpoint: CheckpointConfig = Field(
        CheckpointConfig(), description="How often RL checkpoints keep the optimizer state (no fingerprint covers it)."
    )
    eval: EvalConfig = Field(EvalConfig(), description="Held-out evaluation.")
    sft: SFTConfig = Field(
        SFTConfig(), description="Supervised fine-tuning (`rlpipe sft`, and PPO-ptx's demonstrations)."
    )
    preference: PreferenceConfig = Field(
        PreferenceConfig(), description="Preference data for the reward model and DPO."
    )
    reward_model: RewardModelConfig = Field(
        RewardModelConfig(), description="Reward-model training (`rlpipe rm-train`)."
    )
    dpo: DPOConfig = Field(DPOConfig(), description="DPO (`rlpipe dpo`).")
    tracking: list[Literal["tensorboard", "mlflow"]] = Field(
        [],
        description="Copy each RL iteration's train_metrics and eval figures to TensorBoard (event files under "
        "runs/RUN/tensorboard) and/or an MLflow run (the config as params, the summary at the end); the tables stay "
        "the record.",
    )
    tracking_uri: str | None = Field(
        None,
        description="MLflow's tracking URI (a server, or sqlite:///path.db); default: "
        "$MLFLOW_TRACKING_URI, else SQLite in the run folder, runs/RUN/mlflow.db.",
    )

    @field_validator("task", mode="before")
    @classmethod
    def _task_gone(cls, task):
        # reasoning-gym's tasks had two ways in (a task writing mixed files, and data.sources); one stays.
        if isinstance(task, Mapping) and task.get("name") == "reasoning_gym":
            raise ValueError(
                "the task reasoning_gym is gone: mix reasoning-gym's tasks with data.sources, one source per task "
                "(data: {sources: [{name: legs, weight: 1, reasoning_gym: {task: leg_counting, config: {...}}}]}; "
                "docs/reasoning-tasks.md)"
            )
        return task

    @property
    def carried_reach(self) -> int:
        """How many iterations before its own a sample's tokens may have been generated in: rl.max_staleness with
        partial rollouts (a carried prefix), else 0."""
        return self.rl.max_staleness if self.rollout.partial_tokens else 0

    @property
    def generation_ahead(self) -> int:
        """How many updates ahead of the trainer generation runs: rl.max_staleness without partial rollouts, else 0
        (rl.max_staleness then bounds the carried samples' age: carried_reach)."""
        return self.rl.max_staleness - self.carried_reach

    @model_validator(mode="after")
    def _staleness_fits(self) -> "RunConfig":
        if self.rl.max_staleness > 1 and not self.rollout.partial_tokens:
            raise ValueError(
                f"rl.max_staleness {self.rl.max_staleness}: generation runs at most one update ahead of the trainer; "
                "deeper staleness bounds partial rollouts (set rollout.partial_tokens)"
            )
        if self.rollout.carry_surplus and not self.rollout.partial_tokens:
            raise ValueError(
                "rollout.carry_surplus carries ended groups of partial rollouts: set rollout.partial_tokens"
            )
        if self.rollout.carry_surplus and self.rl.max_staleness == 0:
            raise ValueError(
                "rollout.carry_surplus with rl.max_staleness 0: a group carried to the next update is one update old "
                "and would always be dropped (set rl.max_staleness ≥ 1)"
            )
        if self.rollout.partial_tokens and self.agent.enabled:
            raise ValueError("rollout.partial_tokens: multi-turn rollouts (the agent section) are not carried yet")
        return self

    @property
    def sampler_logprobs_comparable(self) -> bool:
        """Whether the sampler's logprobs score the trainer's distribution, softmax(logits / T): at T = 1 vLLM's raw
        logprobs do, at another T its tempered ones (sampler_logprobs_tempered)."""
        return self.sampler_logprobs_temperature == self.rollout.temperature

    @property
    def sampler_logprobs_temperature(self) -> float:
        """The temperature the sampler's logprobs are taken at: T where vLLM tempers them, else 1 (raw)."""
        return self.rollout.temperature if sampler_logprobs_tempered(self.rollout, self.lora) else 1.0

    @model_validator(mode="after")
    def _sampler_logprobs_fit(self) -> "RunConfig":
        lo, r = self.loss, self.rollout
        if lo.uses_sampler_logprobs and not self.sampler_logprobs_comparable:
            raise ValueError(
                f"rollout.temperature {r.temperature} with loss.old_logprobs sampler, a rollout correction or "
                "loss.off_policy_mask_threshold needs the sampler's logprobs at that temperature, which vLLM gives "
                f"only without LoRA, top_p and min_tokens (here lora.rank {self.lora.rank}, rollout.top_p {r.top_p}, "
                f"rollout.min_tokens {r.min_tokens}): sample at temperature 1, drop those, or keep "
                "loss.old_logprobs: trainer without the sampler-read settings"
            )
        if lo.old_logprobs == "sampler" and self.model.dtype == "bfloat16" and lo.off_policy_mask_threshold is None:
            raise ValueError(
                "loss.old_logprobs sampler with model.dtype bfloat16 makes π_old a bf16 sampler's logprobs, which "
                "differ from the trainer's by far more than fp32's 1e-5, and nothing would bound the gap: set "
                "loss.off_policy_mask_threshold (the rollout correction that works with a sampler's π_old), or keep "
                "loss.old_logprobs: trainer"
            )
        return self

    @model_validator(mode="after")
    def _batch_fits(self) -> "RunConfig":
        if self.batch.target_groups > self.rollout.prompts_per_round * self.batch.max_rounds:
            raise ValueError(
                f"batch.target_groups ({self.batch.target_groups}) can never be reached with "
                f"{self.batch.max_rounds} rounds of {self.rollout.prompts_per_round} prompts"
            )
        return self

    @model_validator(mode="after")
    def _estimator_fits(self) -> "RunConfig":
        # What the estimator reads, asked of its registry entry (its capabilities), never of its name.
        from tasks.algos.advantages import ADVANTAGE_ESTIMATORS

        a = self.advantage
        needs = ADVANTAGE_ESTIMATORS.entry(a.estimator)
        if needs.needs_k and a.pass_k > self.rollout.group_size:
            raise ValueError(
                f"advantage.pass_k ({a.pass_k}) exceeds rollout.group_size ({self.rollout.group_size}): pass@k needs "
                f"groups of at least k responses"
            )
        # (distill without a teacher is refused when a run starts: the distill preset leaves the teacher to --set)
        if a.teacher_path and not needs.needs_teacher:
            readers = [n for n in ADVANTAGE_ESTIMATORS.names() if ADVANTAGE_ESTIMATORS.entry(n).needs_teacher]
            raise ValueError(f"advantage.teacher_path is only read by advantage.estimator {' or '.join(readers)}")
        if needs.needs_components and not self.reward.weighted_parts():
            raise ValueError(
                f"advantage.estimator {a.estimator} normalises the reward's weighted parts, and every weight is 0"
            )
        per_step = [name for name, f in self.reward.functions.items() if f.per_step]
        prm = self.reward.process_model
        if needs.needs_steps and not self.reward.weighted_step_parts():
            raise ValueError(
                f"advantage.estimator {a.estimator} needs a process reward: a reward function with per_step: true "
                "and a non-zero weight, or reward.process_model"
            )
        if prm and self.agent.enabled:
            raise ValueError("reward.process_model scores single-turn responses (this run has an agent section)")
        if self.reward_model.objective == "process" and step_label_function(self.reward, self.reward_model) is None:
            label = self.reward_model.step_label
            raise ValueError(
                f"reward_model.step_label {label!r} is not a per_step function of reward.functions"
                if label
                else "reward_model.objective process labels steps with a per_step reward function: reward.functions "
                f"has {len(per_step)} ({', '.join(per_step) or 'none'}); name one in reward_model.step_label"
            )
        if a.branch_attribution == "hard" and not self.agent.branching:
            raise ValueError("advantage.branch_attribution hard averages over a branching tree: set agent.branching")
        b = self.agent.branching
        if b and (not self.agent.tools or self.agent.environment is not None):
            raise ValueError(
                "agent.branching branches after tool results: it needs agent.tools, and no agent.environment (an "
                "environment's state cannot be copied into a branch)"
            )
        if b and b.initial > self.rollout.group_size:
            raise ValueError(
                f"agent.branching.initial ({b.initial}) exceeds rollout.group_size ({self.rollout.group_size}), "
                "the trajectories each prompt ends with"
            )
        if per_step and self.agent.enabled:
            raise ValueError(
                f"reward function {per_step[0]!r} is per_step, and process rewards score single-turn responses "
                "(this run has an agent section)"
            )
        return self

    @model_validator(mode="after")
    def _judge_is_scored(self) -> "RunConfig":
        judges = {column.removeprefix("score_") for column in self.reward.score_columns()} | {"reward"}
        if self.eval.judge not in judges:
            raise ValueError(
                f"eval.judge {self.eval.judge!r} is not scored by this run: choose one of {', '.join(sorted(judges))}"
            )
        return self

    @model_validator(mode="after")
    def _devices_match_ranks_and_engines(self) -> "RunConfig":
        e, r = self.engines, self.rollout
        if e.trainer_devices is not None and len(e.trainer_devices) != e.train_ranks:
            raise ValueError(
                f"engines.trainer_devices names {len(e.trainer_devices)} device(s) for {e.train_ranks} train_ranks: "
                f"give one per rank"
            )
        if e.rollout_devices is not None and len(e.rollout_devices) != r.engines * r.tensor_parallel_size:
            raise ValueError(
                f"engines.rollout_devices names {len(e.rollout_devices)} device(s); rollout.engines × "
                f"tensor_parallel_size "
                f"needs {r.engines * r.tensor_parallel_size}"
            )
        return self

    @model_validator(mode="after")
    def _collective_sync_needs_a_resident_trainer(self) -> "RunConfig":
        if self.engines.weight_sync == "collective" and not self.engines.resident_trainer:
            raise ValueError(
                "engines.weight_sync collective needs engines.resident_trainer: the weights are sent from the trainer "
                "that holds them (set engines.weight_sync: file)"
            )
        return self

    @model_validator(mode="after")
    def _replay_needs_a_resident_trainer(self) -> "RunConfig":
        if self.checkpoint.every > 1 and not self.engines.resident_trainer:
            raise ValueError(
                f"checkpoint.every {self.checkpoint.every} needs engines.resident_trainer: the updates between full "
                f"checkpoints are replayed on one trainer that keeps its optimizer state (set checkpoint.every: 1)"
            )
        return self

    def keeps_optimizer_state(self, iteration: int) -> bool:
        """Whether RL checkpoint `iteration` is full (weights and optimizer state): every checkpoint.every-th and the
        run's last. A method, not a section, for the optimize stage: which checkpoints are full changes no weights."""
        return iteration % self.checkpoint.every == 0 or iteration >= self.rl.iterations

    @property
    def uses_critic(self) -> bool:
        from tasks.algos.advantages import ADVANTAGE_ESTIMATORS

        return ADVANTAGE_ESTIMATORS.entry(self.advantage.estimator).needs_critic

    def section_hash(self, *sections: str, keys: tuple[str, ...] = ()) -> str:
        """A stable hash of some sections, and of single keys ("section.key") of others where they differ from their
        default (as HASHED_WHEN_SET: a stage that reads a key it did not read before keeps its runs' fingerprints):
        part of a stage's fingerprint."""
        payload = {name: _dump(getattr(self, name)) for name in sections if _hashed(getattr(self, name))}
        set_keys = {}
        for key in keys:
            section, _, name = key.partition(".")
            value = getattr(getattr(self, section), name)
            if not _at_default(getattr(self, section), name):
                # a key may hold sections (data.sources: a list of them), pruned as a section's own are
                set_keys[key] = _jsonable(value)
        if set_keys:
            payload["keys"] = set_keys
        payload["seed"] = self.seed
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def _jsonable(value):
    """A value as JSON for a fingerprint: a section in it (or a list of them) as _dump writes one."""
    if isinstance(value, Section):
        return _dump(value)
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return pydantic_core.to_jsonable_python(value)


def _hashed(section) -> bool:
    """Whether a section enters a fingerprint: always, but a section added after runs existed (OMITTED_AT_DEFAULT) only
    when it differs from its default."""
    return not (getattr(section, "OMITTED_AT_DEFAULT", False) and section == type(section)())


def _dump(section):
    if section is None:
        return None
    at_default = {k for k in section.HASHED_WHEN_SET if _at_default(section, k)}
    return _pruned(section, section.model_dump(mode="json", exclude=set(section.PLACEMENT_KEYS) | at_default))


def _at_default(section, key: str) -> bool:
    """Whether `section.key` holds its field's default (a default_factory's default is made, not stored: get_default
    calls it)."""
    return getattr(section, key) == type(section).model_fields[key].get_default(call_default_factory=True)


def _pruned(section, dumped: dict) -> dict:
    """`dumped` without the HASHED_WHEN_SET keys at their defaults of the sections nested in `section` (a judge in
    reward.judges, say), so that the rule holds at every depth."""
    for name in type(section).model_fields:
        value, out = getattr(section, name), dumped.get(name)
        if isinstance(value, dict):
            nested = [(item, (out or {}).get(key)) for key, item in value.items()]
        elif isinstance(value, list):  # data.sources
            nested = list(zip(value, out if isinstance(out, list) else []))
        else:
            nested = [(value, out)]
        for item, target in nested:
            if isinstance(item, Section) and isinstance(target, dict):
                for k in item.HASHED_WHEN_SET:
                    if _at_default(item, k):
                        target.pop(k, None)
                _pruned(item, target)
    return dumped


def _one_line(err: ValidationError) -> str:
    first = err.errors()[0]
    key = ".".join(str(p) for p in first["loc"]) or "<root>"
    msg = "unknown key" if first["type"] == "extra_forbidden" else first["msg"]
    more = f" (+{err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"invalid config: {key}: {msg}{more}"


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (["a", "b"], value), with the value read as YAML (so 3 is an int, true a bool)."""
    if "=" not in item:
        raise ConfigError(f"invalid --set {item!r}: expected key=value")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"invalid --set {item!r}: empty key segment")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
        json.dumps(value)
    except (yaml.YAMLError, ValueError, RecursionError) as err:
        raise ConfigError(f"invalid --set {item!r}: {str(err).splitlines()[0]}") from None
    return parts, value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Each `a.b=value` set in a deep copy of `data`; a number segment indexes a list (`data.sources.1.weight=2`:
    the second source's weight), so one entry of a list can change without restating the list."""
    data = json.loads(json.dumps(data))  # deep copy of plain data
    for item in overrides:
        parts, value = parse_override(item)
        node: Any = data
        for i, p in enumerate(parts):
            last = i == len(parts) - 1
            if isinstance(node, list):
                if not p.isdigit() or int(p) >= len(node):
                    raise ConfigError(
                        f"invalid --set {item!r}: {'.'.join(parts[:i])} is a list of {len(node)}, "
                        f"so {p!r} must be an index 0 .. {len(node) - 1}"
                    )
                p = int(p)
            elif not isinstance(node, dict):
                raise ConfigError(f"invalid --set {item!r}: {parts[i - 1]} is not a section")
            if last:
                node[p] = value
            elif isinstance(node, dict):
                node = node.setdefault(p, {})
            else:
                node = node[p]
    return data


def build_config(data: dict, overrides: list[str] | None = None) -> RunConfig:
    try:
        return RunConfig.model_validate(apply_overrides(data or {}, overrides or []))
    except ValidationError as err:
        raise ConfigError(_one_line(err)) from None


PRESETS_DIR = Path(__file__).resolve().parents[1] / "infra" / "algos"


def algorithm_presets() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def _read_mapping(path: Path, what: str) -> dict:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        json.dumps(data)  # plain data only: a recursive alias (`a: &a [*a]`) loads as a structure containing itself
    except FileNotFoundError:
        raise ConfigError(f"{what} not found: {path}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"cannot read {what} {path}: it is not UTF-8 text") from None
    except (ValueError, RecursionError):
        raise ConfigError(
            f"cannot read {what} {path}: a recursive YAML alias, or a value that is not plain data"
        ) from None
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"cannot read {what} {path}: {str(err).splitlines()[0]}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"invalid {what} {path}: the top level must be a mapping")
    return data or {}


def deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _leaves(data: dict, prefix: str = "") -> dict[str, object]:
    """{"a.b": value} for every non-mapping value of a nested mapping."""
    out = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        out.update(_leaves(value, f"{name}.") if isinstance(value, dict) else {name: value})
    return out


def preset_overrides(path: str | Path, algo: str | None) -> list[tuple[str, str, object, object]]:
    """(preset, key, the preset's value, the file's) for each key the config file sets that an --algo preset
    (load_config merges it over the file) sets to another value: a setting the user wrote and the run will not use."""
    if not algo:
        return []
    written = _leaves(_read_mapping(Path(path), "config file"))
    last = {}  # key → (the last preset that sets it, its value): later presets merge over earlier ones
    for name in [n.strip() for n in algo.split(",")]:
        if name in algorithm_presets():  # an unknown one: load_config names it
            last.update(
                {k: (name, v) for k, v in _leaves(_read_mapping(PRESETS_DIR / f"{name}.yaml", "preset")).items()}
            )
    return [(name, key, value, written[key]) for key, (name, value) in last.items() if written.get(key, value) != value]


def load_config(path: str | Path, overrides: list[str] | None = None, algo: str | None = None) -> RunConfig:
    """The config file, then the presets `infra/algos/{name}.yaml` that `algo` names (one, or several separated by
    commas, merged in order: `grpo,geo_rs` is GRPO with a rollout correction; a preset only chooses registry entries
    and their settings), then `--set` overrides."""
    data = _read_mapping(Path(path), "config file")
    for name in [n.strip() for n in algo.split(",")] if algo is not None else []:
        if name not in algorithm_presets():
            raise ConfigError(f"unknown --algo {name!r}: choose one of {', '.join(algorithm_presets())}")
        # Merged over the resolved config, so a preset's `reward.functions: {overlong: ...}` adds to the
        # configured functions instead of replacing them.
        resolved = build_config(data).model_dump(mode="json")
        data = deep_merge(resolved, _read_mapping(PRESETS_DIR / f"{name}.yaml", "preset"))
    return build_config(data, overrides)


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
