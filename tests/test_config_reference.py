"""The config reference (docs/config.md) is generated from the schema: every field has a description, and the page in
the repository is the generator's output (regenerate with `python -m schemas.reference > docs/config.md`)."""

from schemas.reference import fields, markdown
from tests.conftest import ROOT


def test_every_config_field_has_a_description():
    missing = [key for key, _, _, description in fields() if not description.strip()]
    assert not missing, f"config fields without a description: {missing}"


def test_the_config_reference_is_current():
    assert (ROOT / "docs" / "config.md").read_text() == markdown(), (
        "regenerate: python -m schemas.reference > docs/config.md"
    )


def test_the_reference_lists_every_key_once():
    keys = [key for key, *_ in fields()]
    expected = {"optim.lr", "lora.rank", "tracking", "reward.functions.NAME.weight"}
    assert len(keys) == len(set(keys)) and expected <= set(keys)


def test_the_reward_functions_description_lists_every_built_in_from_the_registry():
    """The names are stated once (schemas/builtin_rewards.py, which the registry checks itself against at import):
    the description, and so the reference, are built from them."""
    from schemas.config import RewardConfig
    from tasks.rewards.builtin import BUILTIN_REWARDS

    description = RewardConfig.model_fields["functions"].description
    assert f"a built-in ({', '.join(sorted(BUILTIN_REWARDS, key=description.index))})" in description
    row = next(line for line in markdown().splitlines() if line.startswith("| `reward.functions` |"))
    assert all(name in row for name in BUILTIN_REWARDS)
