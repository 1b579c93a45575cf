"""The built-in reward functions' names and what each needs of the config: what `reward.functions` is validated
against and what its description lists (docs/config.md is generated from it).

They are stated here, below the config, and not read from the registry: the functions (tasks/rewards/builtin.py)
run code that imports the config (the sandbox's settings, the loader's argument names), so a config that imported
them would close an import circle. That module registers one function under each name here, with these needs, and
fails at import where the two differ.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BuiltinNeeds:
    runs_code: bool = False  # runs model-written programs in reward.sandbox (its timeout must fit in reward.timeout_s)


BUILTIN_REWARD_NEEDS: dict[str, BuiltinNeeds] = {
    "accuracy": BuiltinNeeds(),
    "format": BuiltinNeeds(),
    "overlong": BuiltinNeeds(),
    "code_tests": BuiltinNeeds(runs_code=True),
    "reasoning_gym": BuiltinNeeds(),
}
