"""Everything that can be checked before an engine starts, so that bad input fails in seconds with one line: the
model folder and its tokenizer, the data files (read, mapped, formatted and tokenized: the `dataset` and `sft_data`
stages run here, and a restart skips them), the reward functions against the dataset's columns, the LLM judges
(their templates, models and endpoints), and the context window. A built-in example task first writes its files.
`run` and `resume` ask all of it (`preflight`); `rlpipe rerun` asks the same checks of the run's config with its
overrides (`check_saved_rl_run`), so a setting that `run` refuses is refused by a rerun with the same line.
Imports: the LoRA check (peft, 4.5 s) and the agent section's loaders (transformers, 0.9 s) are imported only for runs
that use them."""

from __future__ import annotations

from typing import Literal

from schemas.errors import NotFound, TeacherError, UserError
from storage import read_manifest, read_stage
from storage.model_ids import model_fingerprint
from tasks.algos.advantages import ADVANTAGE_ESTIMATORS
from tasks.data.example_tasks import ensure_task_files
from tasks.data.formatting import model_context
from tasks.rewards.sources import check_all
from tasks.stages.common import load_run
from tasks.stages.dataset import dataset_task
from tasks.stages.sft import sft_data_task


class ContextLengthError(UserError, ValueError):
    """A setting the data or the model cannot meet (the context window, the number of prompts)."""


class PlatformError(UserError, RuntimeError):
    """A setting this machine's libraries cannot honour."""


def check_context(model_path: str, longest_prompt: int, max_tokens: int, what: str = "rollout.max_tokens") -> None:
    """Refuse a generation limit that cannot fit the model's context after the longest prompt."""
    context = model_context(model_path)
    if context and longest_prompt + max_tokens > context:
        raise ContextLengthError(
            f"{what}={max_tokens} plus the longest prompt ({longest_prompt} tokens) exceeds "
            f"the model's context of {context}"
        )


def check_teacher(teacher_path: str | None, model_path: str) -> None:
    """A distillation teacher scores the policy's token ids: it must be a model folder with the policy's vocabulary."""
    from transformers import AutoTokenizer

    if not teacher_path:
        raise TeacherError("advantage.estimator distill needs advantage.teacher_path (the teacher's model folder)")
    model_fingerprint(teacher_path)
    theirs, ours = (AutoTokenizer.from_pretrained(p).get_vocab() for p in (teacher_path, model_path))
    if theirs != ours:
        raise TeacherError(
            f"advantage.teacher_path {teacher_path}: its tokenizer's vocabulary differs from the policy's "
            f"({len(theirs)} vs {len(ours)} tokens): the teacher must score the policy's own token ids"
        )


def check_trainable_layers(model_path: str, n: int | None) -> None:
    """reward_model.trainable_layers counts the backbone's top transformer blocks: no more than it has."""
    if n is None:
        return
    from transformers import AutoConfig

    blocks = AutoConfig.from_pretrained(model_path).num_hidden_layers
    if n > blocks:
        raise ContextLengthError(
            f"reward_model.trainable_layers={n} exceeds the {blocks} transformer blocks of {model_path}"
        )


def check_lora(cfg, model_path: str) -> None:
    """lora.target_modules and modules_to_save against the model's own module names."""
    if cfg.lora.enabled:
        from tasks.engines.workers.lora import check_targets

        check_targets(model_path, cfg.lora)


def check_agent(cfg, model_path: str, max_prompt: int) -> None:
    """The agent section's tools (each described by its signature and docstring) and environment class load, and the
    trajectory fits the model's context."""
    if not cfg.agent.enabled:
        return
    from tasks.agents.environments import environment_spec, load_environment
    from tasks.agents.tools import load_tools, tool_specs
    from tasks.data.formatting import load_tokenizer

    load_tools(tool_specs(cfg.agent))
    if cfg.agent.environment is not None:
        load_environment(environment_spec(cfg.agent))
    if cfg.prompt.chat_template == "never" and getattr(load_tokenizer(model_path), "chat_template", None):
        raise ContextLengthError(
            "agent: multi-turn rollouts follow the model's own chat template when it has one; "
            "prompt.chat_template=never is not supported with the agent section"
        )
    check_context(model_path, max_prompt, cfg.agent.max_total_tokens, "agent.max_total_tokens")


def check_sleep(cfg) -> None:
    """engines.colocate_sleep needs vLLM's sleep mode, which vLLM offers on CUDA and ROCm GPUs only."""
    if not cfg.engines.colocate_sleep:
        return
    from vllm.platforms import current_platform

    if not current_platform.is_sleep_mode_available():
        raise PlatformError(
            f"engines.colocate_sleep: vLLM's sleep mode needs a CUDA or ROCm GPU; vLLM here runs on "
            f"{current_platform.device_name or current_platform.device_type} (set it to false)"
        )


def check_reward(cfg, columns: set[str], trains_the_prm: bool = False) -> None:
    """Everything the scores stage will call, before it runs: each reward source's own check (tasks/rewards/sources.py:
    the functions load and the built-ins check themselves, the code reward its sandbox; each judge; the reward
    model's and the process reward model's folders, not when the run trains that PRM). The run's start, `rerun` and
    `resume` ask this."""
    check_all(cfg, columns, trains_the_prm)


def dataset_columns(layout) -> set[str]:
    """The dataset's own columns the reward functions receive (the fields of its `extra` struct)."""
    table = read_stage(layout, "dataset", 0)
    return {f.name for f in table.schema["extra"].fields} if "extra" in table.columns else set()


def preflight(storage_root: str, run_id: str, flow: Literal["rl", "sft", "dpo", "rm"]) -> None:
    ctx = load_run(storage_root, run_id)
    cfg = ctx.cfg
    if cfg.task is not None:
        ensure_task_files(cfg.task)
    if flow == "sft":
        model_fingerprint(cfg.model.base_path)
        check_lora(cfg, cfg.model.base_path)
        sft_data_task.fn(storage_root, run_id)
        return
    check_model(cfg, flow=flow)
    needs_prompts = flow == "rl" or cfg.data.train_files or cfg.preference.data is None
    if needs_prompts:
        dataset = dataset_task.fn(storage_root, run_id)
        trains_the_prm = flow == "rm" and cfg.reward_model.objective == "process"
        check_prompts(cfg, layout=ctx.layout, stats=dataset.extra, flow=flow, trains_the_prm=trains_the_prm)
    if flow == "rl" and cfg.loss.ptx_coef:
        sft_data_task.fn(storage_root, run_id, cfg.model.path)


def check_model(cfg, *, flow: Literal["rl", "dpo", "rm"]) -> None:
    """The policy's folder and its LoRA targets (the reward model's trainable blocks instead: it trains all its weights,
    or its top blocks); for RL, vLLM's sleep mode and the distillation teacher."""
    model_fingerprint(cfg.model.path)
    if flow != "rm":
        check_lora(cfg, cfg.model.path)
    else:
        check_trainable_layers(cfg.model.path, cfg.reward_model.trainable_layers)
    if flow == "rl":
        check_sleep(cfg)
    if flow == "rl" and ADVANTAGE_ESTIMATORS.entry(cfg.advantage.estimator).needs_teacher:
        check_teacher(cfg.advantage.teacher_path, cfg.model.path)


def check_prompts(cfg, *, layout, stats: dict, flow: str, trains_the_prm: bool = False) -> None:
    """What is checked against the run's prompts (`stats`: the dataset stage's statistics): the reward against their
    columns, the context window after the longest prompt, and for RL the agent section and the train prompts a round
    asks for."""
    check_reward(cfg, dataset_columns(layout), trains_the_prm)
    longest = stats["longest_prompt_tokens"]
    check_context(cfg.model.path, longest, cfg.rollout.max_tokens)
    if flow != "rl":
        return
    check_agent(cfg, cfg.model.path, longest)
    train = stats["prompts"]["train"]
    if cfg.rollout.prompts_per_round > train:
        raise ContextLengthError(
            f"rollout.prompts_per_round={cfg.rollout.prompts_per_round} is more than the {train} train prompts "
            "of data.train_files"
        )


def check_saved_rl_run(cfg, layout) -> None:
    """An RL run's checks of its start (`preflight`'s, less the stages it computes) for a saved run under another
    config (a rerun's overrides), against the prompts the run holds: the same line `run` would give, and nothing
    written (its dataset was computed at the run's start; the rerun reads it as it is)."""
    check_model(cfg, flow="rl")
    manifest = read_manifest(layout, "dataset", 0, verify=False)
    if manifest is None:
        raise NotFound(f"run {layout.run_id!r} has no complete dataset stage")
    check_prompts(cfg, layout=layout, stats=manifest["extra"], flow="rl")
