"""Requests across the process boundary (schemas/requests.py): keyword-only, one settings type per family that the
wire and the algorithms share, every field traceable to its config key."""

import dataclasses

import pytest

from schemas.config import build_config
from schemas.requests import KINDS, LossSettings, from_wire, to_wire


@pytest.mark.parametrize("name", sorted(KINDS))
def test_every_request_is_keyword_only(name):
    cls = KINDS[name]
    assert all(f.kw_only for f in dataclasses.fields(cls)), name
    required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
    if required:  # two swapped values cannot pass silently: positional construction is refused
        with pytest.raises(TypeError):
            cls(*range(len(required)))


# A value for each key that differs from its default.
CHANGED = {"loss": ("loss.clip_eps_high", 0.28), "kl": ("kl.estimator", "k1"), "kl_beta": ("kl.beta", 0.5),
           "entropy_coef": ("loss.entropy_coef", 0.01), "max_tokens": ("rollout.max_tokens", 48),
           "temperature": ("rollout.temperature", 0.7)}  # fmt: skip


def test_each_loss_setting_comes_from_the_config_key_it_names():
    fields = {f.name for f in dataclasses.fields(LossSettings)}
    assert set(LossSettings.CONFIG_KEYS) == fields == set(CHANGED)
    base = build_config({})
    before = LossSettings.for_iteration(base, kl_beta=base.kl.beta, entropy_coef=base.loss.entropy_coef)
    for name, (key, value) in CHANGED.items():
        assert LossSettings.CONFIG_KEYS[name].split(",")[0].split(".")[0] == key.split(".")[0]
        cfg = build_config({}, [f"{key}={value}"])
        # β and the entropy coefficient fixed (no kl.target, no loss.entropy_target): their keys' own values
        after = LossSettings.for_iteration(cfg, kl_beta=cfg.kl.beta, entropy_coef=cfg.loss.entropy_coef)
        moved = {f for f in fields if getattr(after, f) != getattr(before, f)}
        section = key.split(".")[0]  # a section carried whole moves with each of its keys (kl.beta: β's start)
        others = moved - {name} - ({section} if section in fields else set())
        assert name in moved and not others, (key, moved)


def test_loss_settings_cross_the_wire_whole():
    s = LossSettings.for_iteration(
        build_config({}, ["loss.objective=gspo", "loss.dual_clip=3", "kl.placement=none"]),
        kl_beta=0.1,
        entropy_coef=0.02,
    )
    back = from_wire(to_wire(s))
    assert back == s and back.loss.dual_clip == 3.0 and not back.kl_in_loss
