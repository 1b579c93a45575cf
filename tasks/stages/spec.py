"""A stage, declared once: the table it writes (its name), the tables it reads, the config sections its body may
read, and how often it runs. Each stage module declares its own `SPEC`; tasks/stages/graph.py lists them in order.

The sections are the stage's whole view of the config: `load_run(..., spec)` hands the stage a `SectionView` that
refuses any other section, so a setting a stage reads is always in its fingerprint (a stage that read
`rollout.max_tokens` without declaring `rollout` was once never recomputed when it changed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal

from schemas.config import RunConfig

# What every stage may read: the seed (in every fingerprint), where runs live, how engines live (resident or one
# process per call) and which checkpoints keep their optimizer state, which change no data, so no fingerprint covers
# them; and the RL loop's schedule (iterations, evals, rl.max_staleness), whose effect on a stage's data, the weights
# it samples with, is an input of that stage's fingerprint. A key of these that shapes a stage's data otherwise is
# declared in its `key_inputs` (partial rollouts drop a carried group older than rl.max_staleness).
GLOBAL_FIELDS = ("seed", "storage_root", "engines", "checkpoint", "rl")


@dataclass(frozen=True)
class StageSpec:
    """`task` is the Prefect task that computes the stage inside its graph's flow run (an RL iteration's, or a
    run-scope flow's: SFT, DPO, reward model). The graph hands it, by parameter name (tasks/stages/graph.py,
    `task_arguments`), `storage_root`, `run_id`, `iteration` and `round_` as it asks, and `upstream`: the fingerprint
    of each table in `reads` (a per-round table read once per iteration: one `<table>_round<i>` entry per round so
    far), which is what its own fingerprint covers, with whatever non-table inputs (the weights it starts from) it
    adds (a run-scope stage's keep the names they had before its flow was a graph, `pairs` for preference_pairs, so
    that no existing run recomputes). A table in `also_reads` is read too, but its content is already fixed by those
    fingerprints (optimize reads the rollouts that its advantages were computed from). A second table
    (`also_writes`) is returned in `Computed.tables` and written by the runner, first. A stage that gathers sampling
    rounds returns `AnotherRound` while it needs one. A stage whose `task` is None is computed elsewhere (eval by the
    run's flow, every `eval.every` iterations)."""

    name: str  # the table it writes
    reads: tuple[str, ...]  # the tables its fingerprint covers: from the same iteration, or the run's (iteration 0)
    sections: tuple[str, ...]  # the config sections it reads (its fingerprint covers exactly these)
    scope: Literal["run", "iteration", "round"]  # once per run (iteration 0), per iteration, or per sampling round
    also_reads: tuple[str, ...] = ()  # tables it reads whose content `reads` already fixes (order and staleness only)
    also_writes: tuple[str, ...] = ()  # second tables (advantages writes prompt_stats) or files (checkpoints)
    aliases: tuple[str, ...] = ()  # other names `rlpipe rerun --stage` accepts (optimize for train_metrics)
    reads_previous: tuple[str, ...] = ()  # the tables it reads from iteration k − 1 (advantages: DCPO's history)
    task: Callable[..., object] | None = field(default=None, compare=False)
    rerunnable: bool = False  # `rlpipe rerun --stage` recomputes it from the cached tables its `reads` name
    # Single keys ("section.key") of sections it does not declare whole: it may read them, and its fingerprint covers
    # their values (RunConfig.section_hash), so a change elsewhere in those sections does not recompute it.
    keys: tuple[str, ...] = ()
    # Keys of the global fields above that shape its data beyond the weights it samples with, each beside the key of a
    # section it declares that makes them do so: while that key is set, the key's value is an input of its fingerprint,
    # under the key's name (`key_input_values`; rollouts: rl.max_staleness under rollout.partial_tokens).
    key_inputs: tuple[tuple[str, str], ...] = ()

    @property
    def all_reads(self) -> tuple[str, ...]:
        return self.reads + self.also_reads

    def __post_init__(self):
        unknown = set(self.sections) - set(RunConfig.model_fields) - set(GLOBAL_FIELDS)
        if unknown:
            raise ValueError(f"stage {self.name!r} declares unknown config sections {sorted(unknown)}")
        for key in self.keys:
            section, _, field_name = key.partition(".")
            model = RunConfig.model_fields[section].annotation if section in RunConfig.model_fields else None
            if section in self.sections or field_name not in getattr(model, "model_fields", {}):
                raise ValueError(f"stage {self.name!r} declares config key {key!r}, which is not a key of a section "
                                 f"it does not declare whole")  # fmt: skip
        for key, when in self.key_inputs:
            if key.partition(".")[0] not in GLOBAL_FIELDS or when.partition(".")[0] not in self.sections:
                raise ValueError(f"stage {self.name!r}: key input {key!r} is not a global field's key, or {when!r} "
                                 f"not a key of a section it declares")  # fmt: skip

    def key_input_values(self, cfg) -> dict[str, str]:
        """The fingerprint inputs of its `key_inputs` whose condition is set: the key's name → its value."""
        on = [key for key, when in self.key_inputs if _value(cfg, when)]
        return {key.partition(".")[2]: str(_value(cfg, key)) for key in on}

    def keys_of(self, section: str) -> frozenset[str]:
        """The keys of `section` the stage declares one by one."""
        return frozenset(k.partition(".")[2] for k in self.keys if k.partition(".")[0] == section)


def _value(cfg, key: str):
    section, _, name = key.partition(".")
    return getattr(getattr(cfg, section), name)


@dataclass(frozen=True)
class AnotherRound:
    """What a stage that gathers sampling rounds (batch) returns while the rounds so far are not enough: the flow
    samples one round more and asks again."""

    why: str


class _Keys:
    """A section of which a stage declares single keys (StageSpec.keys): those read through, any other refused."""

    def __init__(self, section, spec: StageSpec, name: str):
        object.__setattr__(self, "_section", section)
        object.__setattr__(self, "_where", (spec, name))

    def __getattr__(self, key: str):
        spec, name = self._where
        if key not in spec.keys_of(name):
            raise UndeclaredSection(f"stage {spec.name!r} read config key {name}.{key}, which it does not declare")
        return getattr(self._section, key)

    def __setattr__(self, key, value):
        raise AttributeError("the config is read-only")


class UndeclaredSection(AttributeError):
    """A stage read a config section it did not declare: its fingerprint would miss that setting."""


class SectionView:
    """The config as one stage may see it: its declared sections and the global fields; anything else raises.
    Properties of the config (`uses_critic`) are evaluated on the view, so what they read is checked too."""

    def __init__(self, cfg: RunConfig, spec: StageSpec):
        object.__setattr__(self, "_cfg", cfg)
        object.__setattr__(self, "_spec", spec)

    def __getattr__(self, name: str):
        cfg, spec = self._cfg, self._spec
        if name in RunConfig.model_fields and name not in spec.sections and name not in GLOBAL_FIELDS:
            if spec.keys_of(name):
                return _Keys(getattr(cfg, name), spec, name)
            raise UndeclaredSection(f"stage {spec.name!r} read config section {name!r}, which it does not declare")
        attr = getattr(type(cfg), name, None)
        if isinstance(attr, property):
            return attr.fget(self)
        if callable(attr) and name == "section_hash":
            return cfg.section_hash
        return getattr(cfg, name)

    def __setattr__(self, name, value):
        raise AttributeError("the config is read-only")
