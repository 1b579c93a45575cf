"""The SFT flow under prefect_test_harness, with a real DeepSpeed engine on a tiny model."""

import json
from pathlib import Path

import pytest
from prefect.testing.utilities import prefect_test_harness

from flows.deployments import prepare_run
from flows.sft import sft_flow
from storage import RunLayout, read_stage
from tasks.data.model_recipe import init_model
from tasks.stages.preflight import preflight
from tasks.stages.summary import summary_task
from tests.conftest import tiny_config


@pytest.fixture(scope="module")
def harness():
    with prefect_test_harness(server_startup_timeout=120):
        yield


def test_sft_flow_trains_checkpoints_and_skips_on_restart(harness, tmp_path):
    cfg_path = tiny_config(tmp_path, sft={"steps": 6})
    cfg, layout = prepare_run(str(cfg_path), [], "sft-test")
    init_model(cfg.model.recipe, cfg.model.base_path)
    preflight(cfg.storage_root, "sft-test", "sft")  # what `rlpipe sft` does first: the task's files, then sft_data
    result = sft_flow("sft-test", cfg.storage_root)
    assert Path(result["exported_to"], "model.safetensors").exists()
    assert Path(result["checkpoint"], "ds_state").is_dir()
    metrics = read_stage(layout, "sft_metrics", 0)
    assert metrics["step"].to_list() == list(range(6))
    manifest = json.loads(layout.manifest_path("sft_metrics", 0).read_text())
    assert manifest["engines"]["deepspeed"] == "0.19.8" and manifest["engines"]["zero_stage"] == cfg.sft.zero_stage
    before = layout.manifest_path("sft_metrics", 0).read_bytes()
    sft_flow("sft-test", cfg.storage_root)  # a restart: every stage is complete, nothing is redone
    assert layout.manifest_path("sft_metrics", 0).read_bytes() == before
    assert RunLayout(layout.root, "sft-test").iterations("sft_data") == [0]
    first = summary_task.fn(cfg.storage_root, "sft-test", extra={"wall_seconds": 1.0})
    second = summary_task.fn(cfg.storage_root, "sft-test")  # merges into the existing summary.json
    assert first["run_id"] == second["run_id"] == "sft-test" and second["wall_seconds"] == 1.0
