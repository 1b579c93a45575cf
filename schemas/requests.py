"""Requests across the process boundary: what a stage asks of an engine process (vLLM, the DeepSpeed trainer, torch
workers), as frozen dataclasses imported by both sides. The client sets every field, from the config sections of
the stage that asks (the `from_config` constructors), so one setting has one path from the config to the engine; the
few defaults below are for callers outside a run (tests, benchmarks), and a worker never fills in a missing field.

They travel as JSON (`to_wire` / `from_wire`): the kind's name plus its fields, nested dataclasses as objects.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Literal

from schemas.config import (
    DPOConfig,
    LoraConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    RewardModelConfig,
    RolloutConfig,
    SFTConfig,
)


@dataclass(frozen=True)
class VLLMSettings:
    """How the resident vLLM engine starts."""

    model_path: str
    dtype: str
    seed: int
    kv_cache_gib: float  # vLLM-CPU's KV cache
    gpu_memory_utilization: float  # on a GPU, vLLM's share (a colocated trainer has the rest)
    tensor_parallel_size: int = 1
    max_lora_rank: int | None = None  # LoRA enabled (the policy's adapters are loaded per request), or None
    prefix_caching: bool = True  # vLLM's automatic prefix caching: a multi-turn turn re-reads its whole trajectory

    @classmethod
    def from_config(
        cls, model_path: str, model: ModelConfig, rollout: RolloutConfig, seed: int, lora: LoraConfig
    ) -> "VLLMSettings":
        return cls(
            model_path,
            model.dtype,
            seed,
            rollout.kv_cache_gib,
            rollout.gpu_memory_utilization,
            rollout.tensor_parallel_size,
            lora.rank,
        )


@dataclass(frozen=True)
class GenerationJob:
    """One sampling pass over a prompts file (prompt_id, prompt_token_ids) into an output file (one row per sample)."""

    prompts_path: str
    out_path: str
    n: int
    temperature: float
    top_p: float
    max_tokens: int
    seed: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    min_tokens: int = 0


@dataclass(frozen=True)
class GenerateRequest:
    model_path: str  # the weights to sample with: the engine syncs to them in place first
    jobs: tuple[GenerationJob, ...]


@dataclass(frozen=True)
class LoraSettings:
    """The policy's adapter (peft LoRA), created from the seed when training starts from a plain model folder."""

    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...] | str  # or "all-linear"
    modules_to_save: tuple[str, ...]
    seed: int  # the adapter's initial A matrices are drawn from it (B starts at zero)

    @classmethod
    def from_config(cls, lora: LoraConfig, seed: int) -> "LoraSettings | None":
        if not lora.enabled:
            return None
        targets = lora.target_modules if isinstance(lora.target_modules, str) else tuple(lora.target_modules)
        return cls(lora.rank, lora.alpha, lora.dropout, targets, tuple(lora.modules_to_save), seed)


@dataclass(frozen=True)
class EngineSettings:
    """A DeepSpeed engine's settings (a resident trainer reuses an engine only when these are equal)."""

    zero_stage: int
    lr: float
    weight_decay: float
    grad_clip: float
    micro_batch_size: int
    dtype: str
    gradient_checkpointing: bool
    lora: LoraSettings | None  # train only this adapter (the policy trainers), or every weight

    @classmethod
    def for_policy(cls, optim: OptimConfig, model: ModelConfig, lora: LoraSettings | None) -> "EngineSettings":
        return cls(
            optim.zero_stage,
            optim.lr,
            optim.weight_decay,
            optim.grad_clip,
            optim.micro_batch_size,
            model.dtype,
            model.gradient_checkpointing,
            lora,
        )

    @classmethod
    def for_sft(
        cls, sft: SFTConfig, optim: OptimConfig, model: ModelConfig, lora: LoraSettings | None
    ) -> "EngineSettings":
        return cls(
            sft.zero_stage, sft.lr, 0.0, 1.0, optim.micro_batch_size, model.dtype, model.gradient_checkpointing, lora
        )

    @classmethod
    def for_preferences(
        cls, trainer: RewardModelConfig | DPOConfig, model: ModelConfig, lora: LoraSettings | None
    ) -> "EngineSettings":
        return cls(
            trainer.zero_stage,
            trainer.lr,
            trainer.weight_decay,
            1.0,
            trainer.micro_batch_size,
            model.dtype,
            model.gradient_checkpointing,
            lora,
        )


@dataclass(frozen=True)
class Schedule:
    """Supervised training's steps: batch_size elements a step, linear warmup then cosine to 10% of lr."""

    steps: int
    batch_size: int
    warmup_steps: int


@dataclass(frozen=True)
class SFTRequest:
    model_path: str
    tmp_dir: str  # the checkpoint is written here; the caller renames it into place
    data_path: str  # prompt_token_ids, response_token_ids
    metrics_path: str
    seed: int
    engine: EngineSettings
    schedule: Schedule


@dataclass(frozen=True)
class LossSettings:
    objective: str
    aggregation: str
    clip_eps_low: float
    clip_eps_high: float
    dual_clip: float | None
    kl_estimator: str
    kl_in_loss: bool
    kl_beta: float  # the iteration's β (adaptive or fixed)
    entropy_coef: float
    tis_cap: float | None
    max_tokens: int  # L_max of seq-mean-token-sum-norm

    @classmethod
    def from_config(
        cls, loss: LossConfig, kl_estimator: str, kl_in_loss: bool, beta: float, max_tokens: int
    ) -> "LossSettings":
        return cls(
            loss.objective,
            loss.aggregation,
            loss.clip_eps_low,
            loss.clip_eps_high,
            loss.dual_clip,
            kl_estimator,
            kl_in_loss,
            beta,
            loss.entropy_coef,
            loss.tis_cap,
            max_tokens,
        )


@dataclass(frozen=True)
class CriticRequest:
    path: str
    fresh: bool  # build from the policy checkpoint at `path` with a zeroed head
    resume_state: str | None
    out_dir: str
    lr: float
    value_clip: float
    coef: float


@dataclass(frozen=True)
class PtxRequest:
    coef: float
    batch: int
    data_path: str  # prompt_token_ids, response_token_ids


@dataclass(frozen=True)
class UpdateRequest:
    """One RL policy update: ppo_epochs × minibatches optimizer steps on the training frame."""

    model_path: str
    tmp_dir: str
    data_path: str
    resume_state: str | None  # the previous checkpoint's DeepSpeed state (None: fresh optimizer)
    seed: int
    engine: EngineSettings
    ppo_epochs: int
    minibatches: int
    warmup_steps: int
    first_step: int  # optimizer steps before this update (for the warmup)
    loss: LossSettings
    critic: CriticRequest | None
    ptx: PtxRequest | None
    crash_point: str
    # Where the caller commits tmp_dir. Given, a resident trainer with one rank answers once the weights are written and
    # writes the optimizer state into that folder while the next stages run (tasks/engines/workers/deferred_state.py).
    final_dir: str = ""


@dataclass(frozen=True)
class LogprobsRequest:
    policy_path: str
    ref_path: str
    samples_path: str
    out_path: str
    micro_batch_size: int
    dtype: str
    critic_path: str | None
    critic_fresh: bool


@dataclass(frozen=True)
class PreferenceTrainRequest:
    """A Bradley–Terry reward model (rm) or DPO (dpo), trained by DeepSpeed."""

    kind: Literal["rm", "dpo"]
    model_path: str
    tmp_dir: str
    data_path: str
    metrics_path: str
    seed: int
    engine: EngineSettings
    schedule: Schedule
    beta: float  # DPO only
    nll_coef: float  # DPO only


@dataclass(frozen=True)
class TrainerWarmStart:
    """What a resident trainer loads as it starts, while the rest of the run starts too: the model the first update
    starts from (the run's starting weights), as the frozen reference the logprobs stage reads, and its DeepSpeed
    engine with a fresh optimizer, which the first update takes only if it asks for exactly that
    (tasks/engines/workers/engine_cache.py)."""

    model_path: str
    dtype: str
    engine: EngineSettings


@dataclass(frozen=True)
class ScoreRequest:
    """Forward passes without training: a reward model's score of each sequence (rm_score), or a causal LM's
    sequence logprobs of each pair's two responses (seq_logprobs)."""

    kind: Literal["rm_score", "seq_logprobs"]
    model_path: str
    data_path: str
    out_path: str
    micro_batch_size: int


KINDS = {
    cls.__name__: cls
    for cls in (
        VLLMSettings,
        GenerationJob,
        GenerateRequest,
        EngineSettings,
        Schedule,
        SFTRequest,
        LossSettings,
        CriticRequest,
        PtxRequest,
        UpdateRequest,
        LogprobsRequest,
        PreferenceTrainRequest,
        TrainerWarmStart,
        ScoreRequest,
    )
}


def to_wire(request) -> dict:
    return {"kind": type(request).__name__, "fields": dataclasses.asdict(request)}


def from_wire(message: dict):
    return _build(KINDS[message["kind"]], message["fields"])


def _build(cls, fields: dict):
    """A dataclass from its asdict() form, nested dataclasses (and tuples of them) rebuilt; a missing or extra field
    is an error (the worker has no defaults to fall back on)."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        value, hint = fields[f.name], hints[f.name]
        kwargs[f.name] = _value(hint, value)
    extra = set(fields) - {f.name for f in dataclasses.fields(cls)}
    if extra:
        raise TypeError(f"{cls.__name__}: unexpected fields {sorted(extra)}")
    return cls(**kwargs)


def _value(hint, value):
    if value is None:
        return None
    for arg in typing.get_args(hint) or (hint,):
        if dataclasses.is_dataclass(arg) and isinstance(value, dict):
            return _build(arg, value)
    origin = typing.get_origin(hint)
    if origin is tuple:
        inner = typing.get_args(hint)[0]
        return tuple(_build(inner, v) if dataclasses.is_dataclass(inner) else v for v in value)
    return value
