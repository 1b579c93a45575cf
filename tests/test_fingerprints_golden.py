"""Golden fingerprints: each config section's hash (RunConfig.section_hash, part of every stage fingerprint that reads
the section) for three configs, pinned. A change here recomputes the stages of every existing run that reads the
section when it is resumed or rerun. The rule every new key follows: a key added to a section goes into that
section's HASHED_WHEN_SET, so a run that never set it keeps its fingerprints (nested sections too, as a judge's keys
in reward.judges); a new section sets OMITTED_AT_DEFAULT. `engines` is left out: no stage reads it."""

import pytest
from pydantic import BaseModel

from schemas.config import RunConfig, build_config

CASES = {
    "default": {},
    "judges": {"reward": {"judges": {"j": {"base_url": "http://127.0.0.1:9/v1", "model": "m", "weight": 0.5}}}},
    "dapo": {"advantage": {"estimator": "grpo"}, "loss": {"clip_eps_high": 0.28}, "kl": {"placement": "none"}},
}

GOLDEN = {
    "dapo": {
        "advantage": "18f17a5335f39b6c",
        "agent": "de7d7744ccd7722e",
        "batch": "df0a8b1720d72e6c",
        "checkpoint": "44051b2f88a8e30f",
        "critic": "9ad9af72c5499176",
        "data": "1dd11f6f34feec9a",
        "dpo": "7bc35a4a981f88e4",
        "eval": "c456a83b9942cc7e",
        "kl": "4d86eb3f0a5f86f7",
        "lora": "de7d7744ccd7722e",
        "loss": "f5e967a5e621c8ea",
        "model": "3f9241e910e81d94",
        "optim": "acdcda47b7729bae",
        "preference": "0f808c547d265241",
        "prompt": "1d03322705a66678",
        "reward": "27e326b9cf8ec9fc",
        "reward_model": "2decfbe8400f94cf",
        "rl": "1fee5cc737e76d99",
        "rollout": "9f508eca180443b8",
        "sft": "123f060e8df7a91c",
    },
    "default": {
        "advantage": "18f17a5335f39b6c",
        "agent": "de7d7744ccd7722e",
        "batch": "df0a8b1720d72e6c",
        "checkpoint": "44051b2f88a8e30f",
        "critic": "9ad9af72c5499176",
        "data": "1dd11f6f34feec9a",
        "dpo": "7bc35a4a981f88e4",
        "eval": "c456a83b9942cc7e",
        "kl": "1c90185a985011b5",
        "lora": "de7d7744ccd7722e",
        "loss": "8f14f15770744fe0",
        "model": "3f9241e910e81d94",
        "optim": "acdcda47b7729bae",
        "preference": "0f808c547d265241",
        "prompt": "1d03322705a66678",
        "reward": "27e326b9cf8ec9fc",
        "reward_model": "2decfbe8400f94cf",
        "rl": "1fee5cc737e76d99",
        "rollout": "9f508eca180443b8",
        "sft": "123f060e8df7a91c",
    },
    "judges": {
        "advantage": "18f17a5335f39b6c",
        "agent": "de7d7744ccd7722e",
        "batch": "df0a8b1720d72e6c",
        "checkpoint": "44051b2f88a8e30f",
        "critic": "9ad9af72c5499176",
        "data": "1dd11f6f34feec9a",
        "dpo": "7bc35a4a981f88e4",
        "eval": "c456a83b9942cc7e",
        "kl": "1c90185a985011b5",
        "lora": "de7d7744ccd7722e",
        "loss": "8f14f15770744fe0",
        "model": "3f9241e910e81d94",
        "optim": "acdcda47b7729bae",
        "preference": "0f808c547d265241",
        "prompt": "1d03322705a66678",
        "reward": "d932fdda4cf8fa86",
        "reward_model": "2decfbe8400f94cf",
        "rl": "1fee5cc737e76d99",
        "rollout": "9f508eca180443b8",
        "sft": "123f060e8df7a91c",
    },
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_section_fingerprints_are_pinned(case):
    cfg = build_config(CASES[case])
    sections = [s for s in RunConfig.model_fields if isinstance(getattr(cfg, s), BaseModel) and s != "engines"]
    got = {s: cfg.section_hash(s) for s in sections}
    changed = sorted(s for s in got if got[s] != GOLDEN[case].get(s))
    assert not changed, (
        f"{case}: the fingerprint of {changed} changed: a new key belongs in its section's HASHED_WHEN_SET"
    )
    assert set(got) == set(GOLDEN[case])


def test_a_new_key_set_away_from_its_default_changes_its_sections_fingerprint():
    judge = {"base_url": "http://127.0.0.1:9/v1", "model": "m", "weight": 0.5}
    base = build_config(CASES["judges"]).section_hash("reward")
    for key, value in (("max_reply_chars", 100), ("max_failure_rate", 0.2), ("on_failure", "stop")):
        changed = build_config({"reward": {"judges": {"j": {**judge, key: value}}}})
        assert changed.section_hash("reward") != base, key
