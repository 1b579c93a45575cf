"""The resident trainer's reuse rule (tasks/engines/workers/engine_cache.py): an engine is reused only for the exact
checkpoint it wrote, resumed with its own optimizer state and the same settings; one built ahead from a model folder
only for that unchanged folder with a fresh optimizer. The engines here are plain objects: the rule is pure
bookkeeping over files (the e2e PPO test checks reused engines against fresh ones, at iterations 1 and 2)."""

import dataclasses
import os
from types import SimpleNamespace

from tasks.engines.workers.engine_cache import EngineCache, write_state_id
from tests.conftest import engine_settings

SETTINGS = engine_settings()


def checkpoint_with_engine(tmp_path, cache, name="iter=1"):
    ckpt = tmp_path / name
    ckpt.mkdir()
    engine = SimpleNamespace(module=f"module of {name}")
    cache.keep_engine("policy", write_state_id(str(ckpt)), engine, "optimizer", SETTINGS)
    return str(ckpt), engine


def test_reused_only_for_the_checkpoint_it_wrote_with_its_optimizer_state(tmp_path):
    cache = EngineCache()
    ckpt, engine = checkpoint_with_engine(tmp_path, cache)
    assert cache.engine_module("policy", ckpt) == "module of iter=1"
    assert cache.take_engine("policy", ckpt, os.path.join(ckpt, "ds_state"), SETTINGS) == (engine, "optimizer")
    # Taken out while it trains: a second request (or one after a failed update) loads from disk.
    assert cache.take_engine("policy", ckpt, os.path.join(ckpt, "ds_state"), SETTINGS) is None
    assert cache.engine_module("policy", ckpt) is None
    assert cache.hits["engine"] == 2


def test_any_other_state_is_loaded_from_disk(tmp_path):
    cache = EngineCache()
    ckpt, _ = checkpoint_with_engine(tmp_path, cache)
    other = tmp_path / "iter=0"
    other.mkdir()
    assert cache.take_engine("policy", str(other), str(other / "ds_state"), SETTINGS) is None  # another checkpoint
    ckpt, _ = checkpoint_with_engine(tmp_path, cache, "iter=2")
    assert cache.take_engine("policy", ckpt, None, SETTINGS) is None  # a fresh optimizer was asked for
    ckpt, _ = checkpoint_with_engine(tmp_path, cache, "iter=3")
    assert (
        cache.take_engine("policy", ckpt, os.path.join(ckpt, "ds_state"), dataclasses.replace(SETTINGS, lr=2e-4))
        is None
    )
    ckpt, _ = checkpoint_with_engine(tmp_path, cache, "iter=4")
    write_state_id(ckpt)  # the folder was rewritten by another trainer (a rerun, a resumed run)
    assert cache.take_engine("policy", ckpt, os.path.join(ckpt, "ds_state"), SETTINGS) is None
    assert cache.hits["engine"] == 0


def test_frozen_models_load_once_per_weights_and_evict_the_oldest(tmp_path):
    cache, loads = EngineCache(), []
    folders = []
    for name in ("ref", "a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"x")
        folders.append(str(tmp_path / name))

    def load(path):
        loads.append(path)
        return f"model at {path}"

    ref = folders[0]
    assert cache.frozen(ref, lambda: load(ref)) == cache.frozen(ref, lambda: load(ref)) == f"model at {ref}"
    assert loads == [ref] and cache.hits["frozen"] == 1
    os.utime(os.path.join(ref, "model.safetensors"), (1, 1))  # new weights in the same folder
    cache.frozen(ref, lambda: load(ref))
    assert loads == [ref, ref]
    for path in folders[1:]:
        cache.frozen(path, lambda p=path: load(p))
    assert len(cache._frozen) == EngineCache.MAX_FROZEN
    cache.frozen(ref, lambda: load(ref))  # evicted by the two newer ones: loaded again
    assert loads == [ref, ref, *folders[1:], ref]


def test_an_engine_built_ahead_is_reused_only_for_its_unchanged_folder_with_a_fresh_optimizer(tmp_path):
    start = tmp_path / "sft"
    start.mkdir()
    (start / "model.safetensors").write_bytes(b"x")
    cache, engine = EngineCache(), SimpleNamespace(module="module of sft")

    def built_ahead():
        cache.keep_loaded_engine("policy", str(start), engine, "fresh optimizer", SETTINGS)

    built_ahead()
    assert cache.engine_module("policy", str(start)) is None  # logprobs read the starting model as a frozen one
    assert (
        cache.take_engine("policy", str(start), str(start / "ds_state"), SETTINGS) is None
    )  # optimizer state asked for
    built_ahead()
    assert cache.take_engine("policy", str(tmp_path / "other"), None, SETTINGS) is None
    built_ahead()
    assert cache.take_engine("policy", str(start), None, dataclasses.replace(SETTINGS, zero_stage=2)) is None
    built_ahead()
    os.utime(start / "model.safetensors", (1, 1))  # new weights in the folder since
    assert cache.take_engine("policy", str(start), None, SETTINGS) is None
    built_ahead()
    write_state_id(str(start))  # the folder was rewritten by a trainer since
    assert cache.take_engine("policy", str(start), None, SETTINGS) is None
    assert cache.hits["engine"] == 0
    built_ahead()
    assert cache.take_engine("policy", str(start), None, SETTINGS) == (engine, "fresh optimizer")
    assert cache.take_engine("policy", str(start), None, SETTINGS) is None  # taken out while it trains
    assert cache.hits["engine"] == 1
