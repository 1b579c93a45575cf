"""The collective weight sync's pure parts: how tensors are cut into packed chunks, which vLLM weight-transfer engine a
config gets, which stages run one step ahead, and which weights an iteration samples with. The transfer itself is
tests/test_weight_sync.py's."""

import pytest

from schemas.config import EnginesConfig, RunConfig
from tasks.engines.weight_sync import backend
from tasks.engines.workers.weight_transfer import chunks, tensor_bytes
from tasks.stages.graph import GENERATION_TASKS, ITERATION_TASKS, generation
from tasks.stages.spec import StageSpec
from tasks.stages.weights import sampling_version


def test_chunks_keep_the_order_and_the_size_bound_and_both_sides_cut_them_from_the_update_info():
    mb = 2**20
    # 1, 1, 1 MiB fp32, then 3 MiB (a chunk of its own, over the bound), a 1 MiB bf16 and 1 MiB fp32: dtypes share a
    # packed chunk (bytes), as in vLLM's packed transfer
    dtypes = ["float32", "float32", "float32", "float32", "bfloat16", "float32"]
    shapes = [[mb // 4], [mb // 8, 2], [mb // 4], [3 * mb // 4], [mb // 2], [mb // 4]]
    nbytes = tensor_bytes(dtypes, shapes)
    assert nbytes == [mb, mb, mb, 3 * mb, mb, mb]
    assert [list(c) for c in chunks(nbytes, 2 * mb)] == [[0, 1], [2], [3], [4, 5]]
    assert [list(c) for c in chunks(nbytes, 1)] == [[k] for k in range(6)]  # each alone when none fits
    assert [list(c) for c in chunks(nbytes, 100 * mb)] == [list(range(6))]
    assert chunks([], 2 * mb) == []


@pytest.mark.parametrize(
    "engines, expected",
    [
        ({}, "rlpipe_gloo"),  # the CPU path
        ({"trainer_devices": [0, 1], "rollout_devices": [2, 3]}, "nccl"),  # split over one node's GPUs
        ({"trainer_devices": [0, 1], "rollout_devices": [1, 2]}, "rlpipe_gloo"),  # a shared GPU: NCCL refuses it
        ({"trainer_bundle": {"GPU": 1}, "rollout_bundle": {"GPU": 2}}, "nccl"),  # Ray gives each its own GPUs
        ({"trainer_bundle": {"GPU": 0.5}, "rollout_bundle": {"GPU": 0.5}}, "rlpipe_gloo"),  # colocated fractions
        ({"trainer_bundle": {"GPU": 1}}, "rlpipe_gloo"),  # replicas without a GPU bundle: wherever CUDA puts them
    ],
)
def test_vllms_nccl_engine_only_between_gpus_of_their_own(engines, expected):
    assert backend(EnginesConfig(**engines), lora=False) == expected
    assert backend(EnginesConfig(**engines), lora=True) == "rlpipe_gloo"  # vLLM's engines cannot carry an adapter


def test_one_step_ahead_runs_the_sampling_stages_and_the_batch_and_nothing_that_trains():
    assert [s.name for s in GENERATION_TASKS] == ["prompts", "rollouts", "scores", "batch"]
    assert set(GENERATION_TASKS) < set(ITERATION_TASKS)
    # A stage that reads the iteration before (as advantages reads DCPO's history) never runs ahead.
    history = StageSpec("x", reads=("prompts",), sections=(), scope="round", reads_previous=("prompt_stats",))
    assert history not in generation((*ITERATION_TASKS, history))


def test_iteration_k_samples_with_update_k_minus_1_or_k_minus_2_one_step_off_policy():
    def versions(staleness: int) -> list[int]:
        cfg = RunConfig.model_validate({"rl": {"max_staleness": staleness}})
        return [sampling_version(cfg, k) for k in range(1, 6)]

    assert versions(0) == [0, 1, 2, 3, 4]
    assert versions(1) == [0, 0, 1, 2, 3]
