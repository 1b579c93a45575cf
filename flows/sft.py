"""The SFT flow: generated demonstrations → DeepSpeed training → checkpoint (the RL warm start)."""

from __future__ import annotations

from prefect import flow

from tasks.stages.sft import sft_data_task, sft_train_task


@flow(name="sft", flow_run_name="{run_id}-sft")
def sft_flow(run_id: str, storage_root: str = "runs") -> dict:
    data = sft_data_task(storage_root, run_id)
    trained = sft_train_task(storage_root, run_id, data.fingerprint)
    return {"checkpoint": trained.extra.get("checkpoint"), "exported_to": trained.extra.get("exported_to")}
