"""Reward functions by reference: a built-in name, a Python file (`path` + `function`) or a module (`module` +
`function`), loaded the same way in the run's process and in every reward worker.

The contract (docs/train-your-own-model.md, "Reward functions"). A per-sample function is called with keyword arguments:

    prompt         the prompt as the model saw it (chat template applied), str
    messages       the prompt as chat messages, [{"role": ..., "content": ...}, ...]
    response       the sampled response, str (decoded, special tokens left out)
    ground_truth   the value at data.answer_key, with its type from the dataset (None without one)
    finish_reason  "stop" (EOS or a stop string) or "length" (cut off at max_tokens)
    length         the response's token count
    max_tokens     the generation limit it was sampled under
    prompt_id      the prompt's id
    <column>       every other column of the dataset row, untouched (nested values as dicts and lists)
    <kwargs>       the entry's `kwargs` from the config

    steps          the response split into steps (reward.steps): a list of str that joins back to the response
    sandbox        reward.sandbox, for a function that runs model-written code (tasks.rewards.sandbox.run_python)

It takes the ones it names, or all of them with **kwargs, and returns a number (bool and int count), or a mapping
with the number under "score" and whatever else should be kept beside it (scores.info_<name>, as JSON). A batched
function (`batched: true`) gets the same names with a list per argument (the config's kwargs stay scalars) and
returns a list of numbers, one per sample. A process reward (`per_step: true`) returns a list of numbers, one per
step of `steps` (batched: a list of such lists).

Functions written for verl or TRL run unchanged, under their own names for the same values:

    solution_str   verl: the response (`compute_score(data_source, solution_str, ground_truth, extra_info)`); verl's
                   `data_source` and `extra_info` are dataset columns, None when the dataset has no such column
    completion     TRL: the response, as chat messages [{"role": "assistant", "content": ...}] when the prompt was
                   chat messages, else the text
    completion_ids the response's token ids (as the sampler produced them)
    completions,   TRL's batched names: a function that takes `completions` or `prompts` is called batched, with
    prompts        the completions, and the prompts as chat messages (chat data) or as the model saw them (text)
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from schemas.config import ALIAS_ARGUMENTS, REWARD_ARGUMENTS, TRL_BATCHED_ARGUMENTS, RewardConfig
from schemas.errors import RewardLoadError
from tasks.rewards.builtin import BUILTIN_REWARDS


@dataclass(frozen=True)
class FunctionSpec:
    """A picklable reference to one configured reward function (what the reward workers receive)."""

    name: str
    path: str | None = None
    module: str | None = None
    function: str | None = None
    batched: bool = False
    kwargs: dict = field(default_factory=dict)
    per_step: bool = False  # a process reward: one score per step of `steps`
    kind: str = "reward function"  # what the one-line errors call it: tools and environments load the same way

    @property
    def where(self) -> str:
        if self.path:
            return f"{self.path}:{self.function or self.name}"
        if self.module:
            return f"{self.module}:{self.function or self.name}"
        return "built-in"


def specs_from_config(reward: RewardConfig) -> dict[str, FunctionSpec]:
    return {
        name: FunctionSpec(name, f.path, f.module, f.function, f.batched, dict(f.kwargs), f.per_step)
        for name, f in reward.functions.items()
    }


_MODULES: dict[tuple, object] = {}


def _module_from_file(spec: FunctionSpec):
    path = Path(spec.path).resolve()
    try:
        stat = path.stat()
    except OSError:
        raise RewardLoadError(f"{spec.kind} {spec.name!r}: file not found: {spec.path}") from None
    key = (str(path), stat.st_mtime_ns, stat.st_size)  # an edited file is loaded again
    if key in _MODULES:
        return _MODULES[key]
    # Its folder goes last on sys.path, so a helper module next to it imports, and never shadows a real package.
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    name = f"rlpipe_rewards_{hashlib.sha256(str(path).encode()).hexdigest()[:12]}"
    loader_spec = importlib.util.spec_from_file_location(name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise RewardLoadError(f"{spec.kind} {spec.name!r}: {spec.path} is not a Python file")
    module = importlib.util.module_from_spec(loader_spec)
    try:
        loader_spec.loader.exec_module(module)
    except Exception as exc:  # the user's module: any error it raises on import
        raise RewardLoadError(
            f"{spec.kind} {spec.name!r}: importing {spec.path} failed: {_describe(exc, spec.path)}"
        ) from None
    _MODULES[key] = module
    return module


def _describe(exc: BaseException, path: str | None = None) -> str:
    """`NameError: name 'x' is not defined (rewards.py, line 3)`: the type, the message, and where in the user's file
    (a SyntaxError names its line itself)."""
    text = f"{type(exc).__name__}: {exc}".splitlines()[0]
    if path and not isinstance(exc, SyntaxError):
        target = Path(path).resolve()
        lines = [f.lineno for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).resolve() == target]
        if lines:
            text += f" ({target.name}, line {lines[-1]})"
    return text[:300]


def load_function(spec: FunctionSpec) -> Callable:
    """The callable a spec names; a one-line RewardLoadError when the file, module or function cannot be used."""
    if not (spec.path or spec.module):
        return BUILTIN_REWARDS.get(spec.name)
    if spec.path:
        module = _module_from_file(spec)
    else:
        try:
            module = importlib.import_module(spec.module)
        except Exception as exc:  # ModuleNotFoundError, or the module's own import-time error
            raise RewardLoadError(
                f"{spec.kind} {spec.name!r}: importing module {spec.module} failed: {_describe(exc)}"
            ) from None
    attr = spec.function or spec.name
    fn = getattr(module, attr, None)
    if not callable(fn):
        defined = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))
        raise RewardLoadError(
            f"{spec.kind} {spec.name!r}: {spec.path or spec.module} has no function {attr!r} "
            f"(it defines: {', '.join(defined) or 'none'})"
        )
    return fn


OPTIONAL_COLUMNS = ("data_source", "extra_info")  # verl's columns, None when the dataset lacks them


def is_batched(spec: FunctionSpec, fn: Callable) -> bool:
    """`batched: true`, or a TRL-style function (it takes `completions` or `prompts`, which only exist as lists)."""
    params = inspect.signature(fn).parameters
    return spec.batched or any(name in params for name in TRL_BATCHED_ARGUMENTS)


def accepted_arguments(fn: Callable) -> frozenset[str] | None:
    """The keyword names `fn` takes, or None when it takes any (**kwargs)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(
        p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    )


def check_signature(spec: FunctionSpec, fn: Callable, columns: set[str]) -> None:
    """Refuse a function rlpipe cannot call: a required parameter it cannot fill, positional-only parameters, or a
    configured kwarg the function does not take."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        raise RewardLoadError(f"reward function {spec.name!r} ({spec.where}): its signature cannot be read") from None
    available = {*REWARD_ARGUMENTS, *ALIAS_ARGUMENTS, *OPTIONAL_COLUMNS, *columns, *spec.kwargs}
    if is_batched(spec, fn):
        available |= set(TRL_BATCHED_ARGUMENTS)
    for p in params:
        required = p.default is inspect.Parameter.empty
        if p.kind is inspect.Parameter.POSITIONAL_ONLY and required:
            raise RewardLoadError(
                f"reward function {spec.name!r} ({spec.where}): parameter {p.name!r} is positional-only; "
                "rlpipe passes keyword arguments"
            )
        if (
            p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
            and required
            and p.name not in available
        ):
            raise RewardLoadError(
                f"reward function {spec.name!r} ({spec.where}): rlpipe cannot fill parameter {p.name!r}; "
                f"it may take {', '.join(REWARD_ARGUMENTS + ALIAS_ARGUMENTS)}, the dataset's columns "
                f"({', '.join(sorted(columns)) or 'none'}), its kwargs, and TRL's completions and prompts"
            )
    accepted = accepted_arguments(fn)
    unused = sorted(set(spec.kwargs) - accepted) if accepted is not None else []
    if unused:
        raise RewardLoadError(
            f"reward function {spec.name!r} ({spec.where}) takes no argument {unused[0]!r} (set in its kwargs)"
        )


def source_hash(specs: dict[str, FunctionSpec]) -> str:
    """A hash of the code behind the functions (their whole files or modules, so a changed helper counts): part of
    the scores fingerprint, so editing a reward and rerunning `scores` re-scores."""
    h = hashlib.sha256()
    for name in sorted(specs):
        spec = specs[name]
        h.update(f"{name}:{spec.where}:{spec.batched}".encode())
        h.update(_source_file(spec).read_bytes())
    return h.hexdigest()[:16]


def _source_file(spec: FunctionSpec) -> Path:
    if spec.path:
        return Path(spec.path)
    if spec.module:
        found = importlib.util.find_spec(spec.module)
        if found is None or not found.origin or not Path(found.origin).is_file():
            raise RewardLoadError(f"reward function {spec.name!r}: module {spec.module} not found")
        return Path(found.origin)
    return Path(inspect.getsourcefile(BUILTIN_REWARDS.get(spec.name)))


def preflight(reward: RewardConfig, columns: set[str]) -> dict[str, FunctionSpec]:
    """Load every configured function in this process and check its signature against the dataset's columns: a
    broken reference fails here, with one line, before any engine starts."""
    specs = specs_from_config(reward)
    for spec in specs.values():
        fn = load_function(spec)
        check_signature(spec, fn, columns)
        if not (spec.path or spec.module) and hasattr(fn, "preflight"):  # a built-in's own check (builtin.py)
            fn.preflight(reward=reward, kwargs=spec.kwargs, columns=columns)
    source_hash(specs)
    return specs
