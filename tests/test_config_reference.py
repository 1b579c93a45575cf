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
