"""Requests across the process boundary: what a stage asks of an engine process (vLLM, the DeepSpeed trainer, torch
workers), as frozen dataclasses imported by both sides. The client sets every field, from the config sections of
the stage that asks (the `from_config` constructors), so one setting has one path from the config to the engine; the
few defaults below are for callers outside a run (tests, benchmarks), and a worker never fills in a missing field.

They travel as JSON (`to_wire` / `from_wire`): the kind's name plus its fields, nested dataclasses as objects. The vLLM
engine's answer comes back the same way (`GenerationReply`): its fields are the one statement of its keys.

Over 400 lines as a declaration file: every message between a stage and an engine is stated here once, for both sides.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import ClassVar, Literal

from pydantic import BaseModel

from schemas.config import (
    DPOConfig,
    KLConfig,
    LoraConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    RewardModelConfig,
    RolloutConfig,
    SFTConfig,
    sampler_logprobs_tempered,
)


@dataclass(frozen=True, kw_only=True)
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
    max_logprobs: int = 20  # the most candidates a request may ask for (vLLM's default; an LLM judge may ask more)
    sleep: bool = False  # engines.colocate_sleep: asleep (vLLM's sleep level 1) between its generations
    # the vLLM weight-transfer engine its workers make (tasks/engines/weight_sync.py::backend)
    weight_transfer: Literal["rlpipe_gloo", "nccl"] = "rlpipe_gloo"
    # vLLM's logprobs_mode: the raw model's (T = 1), or after the sampling temperature (sampler_logprobs_tempered)
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"

    @classmethod
    def from_config(
        cls,
        model_path: str,
        model: ModelConfig,
        rollout: RolloutConfig,
        seed: int,
        lora: LoraConfig,
        sleep: bool,
        weight_transfer: str,
    ) -> "VLLMSettings":
        return cls(
            model_path=model_path,
            dtype=model.dtype,
            seed=seed,
            kv_cache_gib=rollout.kv_cache_gib,
            gpu_memory_utilization=rollout.gpu_memory_utilization,
            tensor_parallel_size=rollout.tensor_parallel_size,
            max_lora_rank=lora.rank,
            sleep=sleep,
            weight_transfer=weight_transfer,
            logprobs_mode="processed_logprobs" if sampler_logprobs_tempered(rollout, lora) else "raw_logprobs",
        )


@dataclass(frozen=True, kw_only=True)
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
    # > 0: each row also gets `first_top`, the first generated token's top candidates (token text, logprob), as an LLM
    # judge's score=logprobs reads them
    top_logprobs: int = 0
    # > 0 (with top_logprobs): each row also gets `head_entropy`, the entropy of its first entropy_tokens positions
    # over those candidates (ARPO's branching, agent.branching)
    entropy_tokens: int = 0


@dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    model_path: str  # the weights to sample with: the engine syncs to them in place first
    jobs: tuple[GenerationJob, ...]


@dataclass(frozen=True, kw_only=True)
class JobTiming:
    generate_seconds: float
    tokens: int  # generated, all samples together


@dataclass(frozen=True, kw_only=True)
class GenerationReply:
    """The vLLM engine's answer to a GenerateRequest (tasks/engines/workers/vllm_generate.py), or the rollout replicas'
    answers merged into one (tasks/stages/rollouts.py, `merge_replies`: the slowest start and sync, the worst gap)."""

    engine_start_seconds: float  # the engine's start, paid by its first answer (0 after)
    sync_seconds: float  # bringing it to the request's weights first (0: it held them)
    sync_logprob_gap: float | None  # the sampler's mean gap to the trainer's probe logprobs; None: no probe
    jobs: tuple[JobTiming, ...]  # one per job of the request
    vllm_version: str
    peak_rss_gib: float
    kv_cache_gib: float | None  # the KV cache it reserved; None where vLLM sized it from GPU memory
    sync_bytes: int = 0  # merged: what the trainer sent over its process group before (tasks/engines/weight_sync.py)
    per_engine: tuple[JobTiming, ...] = ()  # merged: each replica's jobs together


@dataclass(frozen=True, kw_only=True)
class WeightGroup:
    """The group that carries weights from trainer rank 0 (its rank 0) to the rollout replicas' vLLM workers (ranks 1
    to world_size − 1, tensor_parallel_size a replica), through vLLM's weight-transfer engine `backend`
    (tasks/engines/workers/weight_transfer.py)."""

    key: str  # a member keeps its group while requests name the same key
    backend: Literal["rlpipe_gloo", "nccl"]
    # rlpipe_gloo: file://PATH (every member on one machine) or tcp://HOST:PORT (trainer rank 0's node); nccl:
    # tcp://HOST:PORT, where vLLM's TCP store rendezvous is
    init_method: str
    world_size: int
    tensor_parallel_size: int  # each replica's workers
    timeout_s: float  # a member that waits longer in a broadcast fails
    bucket_bytes: int  # a packed chunk's bound


@dataclass(frozen=True, kw_only=True)
class SendWeightsRequest:
    """To every trainer rank: send the policy weights of `checkpoint`, which the resident trainer holds, over `group`
    to the replicas the message names (rank 0 sends and drives them; under ZeRO-3 every rank takes part in gathering
    the weights). LoRA sends the adapter only."""

    checkpoint: str
    group: WeightGroup


@dataclass(frozen=True, kw_only=True)
class WeightUpdateCall:
    """To a vLLM replica, from the trainer's weight-transfer client: one of vLLM's four weight-sync calls, with its
    init or update info as vLLM's engines take it (empty for start and finish)."""

    op: Literal["init", "start", "update", "finish"]
    info: dict
    model_path: str  # the checkpoint whose weights these are


@dataclass(frozen=True, kw_only=True)
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
        return cls(
            rank=lora.rank,
            alpha=lora.alpha,
            dropout=lora.dropout,
            target_modules=targets,
            modules_to_save=tuple(lora.modules_to_save),
            seed=seed,
        )


@dataclass(frozen=True, kw_only=True)
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
    micro_batch_tokens: int | None = None  # the policy update's token budget per micro-batch (optim.micro_batch_tokens)

    @classmethod
    def for_policy(cls, optim: OptimConfig, model: ModelConfig, lora: LoraSettings | None) -> "EngineSettings":
        return cls(
            zero_stage=optim.zero_stage,
            lr=optim.lr,
            weight_decay=optim.weight_decay,
            grad_clip=optim.grad_clip,
            micro_batch_size=optim.micro_batch_size,
            dtype=model.dtype,
            gradient_checkpointing=model.gradient_checkpointing,
            lora=lora,
            micro_batch_tokens=optim.micro_batch_tokens,
        )

    @classmethod
    def for_sft(
        cls, sft: SFTConfig, optim: OptimConfig, model: ModelConfig, lora: LoraSettings | None
    ) -> "EngineSettings":
        return cls(
            zero_stage=sft.zero_stage,
            lr=sft.lr,
            weight_decay=0.0,  # SFT: no decay and the default clip (the sft section has neither key)
            grad_clip=1.0,
            micro_batch_size=optim.micro_batch_size,
            dtype=model.dtype,
            gradient_checkpointing=model.gradient_checkpointing,
            lora=lora,
        )

    @classmethod
    def for_preferences(
        cls, trainer: RewardModelConfig | DPOConfig, model: ModelConfig, lora: LoraSettings | None
    ) -> "EngineSettings":
        return cls(
            zero_stage=trainer.zero_stage,
            lr=trainer.lr,
            weight_decay=trainer.weight_decay,
            grad_clip=1.0,  # the preference sections have no clip key
            micro_batch_size=trainer.micro_batch_size,
            dtype=model.dtype,
            gradient_checkpointing=model.gradient_checkpointing,
            lora=lora,
        )


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """Supervised training's steps: batch_size elements a step, linear warmup then cosine to 10% of lr."""

    steps: int
    batch_size: int
    warmup_steps: int


@dataclass(frozen=True, kw_only=True)
class SFTRequest:
    model_path: str
    tmp_dir: str  # the checkpoint is written here; the caller renames it into place
    data_path: str  # prompt_token_ids, response_token_ids
    metrics_path: str
    seed: int
    engine: EngineSettings
    schedule: Schedule


@dataclass(frozen=True, kw_only=True)
class LossSettings:
    """The policy loss's settings: the one type the optimize stage sends and the algorithms read
    (tasks/algos/losses.py). The `loss` and `kl` sections travel whole, so a new loss key is its config field and
    the code that reads it; the two values computed per iteration come beside them. Where each field comes from:
    CONFIG_KEYS (checked by a test)."""

    loss: LossConfig = LossConfig()
    kl: KLConfig = KLConfig()
    kl_beta: float = KLConfig.model_fields["beta"].default  # the iteration's β (tasks/stages/kl_control.py)
    entropy_coef: float = LossConfig.model_fields["entropy_coef"].default  # the iteration's (kl_control.py too)
    max_tokens: int = RolloutConfig.model_fields["max_tokens"].default  # L_max of seq-mean-token-sum-norm
    # The distribution the samples were drawn from is softmax(logits / T): the update's logprobs divide by it too.
    temperature: float = RolloutConfig.model_fields["temperature"].default

    CONFIG_KEYS: ClassVar[dict[str, str]] = {
        "loss": "loss",
        "kl": "kl",
        "kl_beta": "kl.beta, or the adaptive controller's β when kl.target is set",
        "entropy_coef": "loss.entropy_coef, or the adaptive controller's when loss.entropy_target is set",
        "max_tokens": "rollout.max_tokens",
        "temperature": "rollout.temperature",
    }

    @classmethod
    def for_iteration(cls, cfg, *, kl_beta: float, entropy_coef: float) -> "LossSettings":
        """From a run's config (a stage's view of it, with the loss, kl and rollout sections) and the iteration's β
        and entropy coefficient."""
        return cls(
            loss=cfg.loss,
            kl=cfg.kl,
            kl_beta=kl_beta,
            entropy_coef=entropy_coef,
            max_tokens=cfg.rollout.max_tokens,
            temperature=cfg.rollout.temperature,
        )

    @property
    def kl_in_loss(self) -> bool:
        return self.kl.placement == "loss"


@dataclass(frozen=True, kw_only=True)
class CriticRequest:
    path: str
    fresh: bool  # build from the policy checkpoint at `path` with a zeroed head
    resume_state: str | None
    out_dir: str
    lr: float
    value_clip: float
    coef: float


@dataclass(frozen=True, kw_only=True)
class PtxRequest:
    coef: float
    batch: int
    data_path: str  # prompt_token_ids, response_token_ids


@dataclass(frozen=True, kw_only=True)
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
    # False: the checkpoint is the weights only (checkpoint.every): the resident trainer keeps the engine and its
    # optimizer state, and a trainer that lost them replays the updates since the last full checkpoint.
    save_state: bool = True
    # The id the checkpoint's trainer_state.json gets (a replay gives the update its recorded id); "": a new one.
    state_id: str = ""
    # False: a weights-only checkpoint without its weight files (engines.weight_sync collective): the resident trainer
    # holds the weights and sends them to the sampler over a process group; a trainer that lost them replays.
    save_weights: bool = True


@dataclass(frozen=True, kw_only=True)
class LogprobsRequest:
    policy_path: str
    ref_path: str
    samples_path: str
    out_path: str
    micro_batch_size: int
    dtype: str
    critic_path: str | None
    critic_fresh: bool
    teacher_path: str | None = None  # on-policy distillation: the teacher scores the same tokens
    micro_batch_tokens: int | None = None  # optim.logprob_micro_batch_tokens (or micro_batch_tokens): a token budget
    # loss.old_logprobs sampler: π_old is the samples file's sampler_logprobs, and the policy is not run (no entropy)
    old_from_sampler: bool = False
    with_ref: bool = True  # False: no KL reads the reference, and π_old is the sampler's: the ref pass is skipped too
    # rollout.temperature: the policy's and the reference's logprobs are of softmax(logits / T), the distribution the
    # samples were drawn from (as verl, OpenRLHF and TRL score them); the teacher's are its own (T = 1).
    temperature: float = 1.0


@dataclass(frozen=True, kw_only=True)
class PreferenceTrainRequest:
    """A Bradley–Terry reward model (rm), a process reward model (prm) or DPO (dpo), trained by DeepSpeed."""

    kind: Literal["rm", "prm", "dpo"]
    model_path: str
    tmp_dir: str
    data_path: str
    metrics_path: str
    seed: int
    engine: EngineSettings
    schedule: Schedule
    beta: float  # DPO only
    nll_coef: float  # DPO only
    trainable_layers: int | None = None  # rm and prm: train only the top N blocks (reward_model.trainable_layers)


@dataclass(frozen=True, kw_only=True)
class TrainerWarmStart:
    """What a resident trainer loads as it starts, while the rest of the run starts too: the model the first update
    starts from (the run's starting weights), as the frozen reference the logprobs stage reads, and its DeepSpeed
    engine with a fresh optimizer, which the first update takes only if it asks for exactly that
    (tasks/engines/workers/engine_cache.py)."""

    model_path: str
    dtype: str
    engine: EngineSettings


@dataclass(frozen=True, kw_only=True)
class ScoreRequest:
    """Forward passes without training: a reward model's score of each sequence (rm_score), a process reward model's
    step probabilities (prm_score), or a causal LM's sequence logprobs of each pair's two responses (seq_logprobs)."""

    kind: Literal["rm_score", "prm_score", "seq_logprobs"]
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
        GenerationReply,
        WeightGroup,
        SendWeightsRequest,
        WeightUpdateCall,
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
    return {"kind": type(request).__name__, "fields": dataclasses.asdict(request, dict_factory=_plain)}


def _plain(items: list[tuple[str, object]]) -> dict:
    """asdict's dicts with config sections (pydantic, carried whole by LossSettings) as their JSON form."""
    return {k: v.model_dump(mode="json") if isinstance(v, BaseModel) else v for k, v in items}


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
        if isinstance(arg, type) and issubclass(arg, BaseModel) and isinstance(value, dict):
            return arg.model_validate(value)
    origin = typing.get_origin(hint)
    if origin is tuple:
        inner = typing.get_args(hint)[0]
        return tuple(_build(inner, v) if dataclasses.is_dataclass(inner) else v for v in value)
    return value
