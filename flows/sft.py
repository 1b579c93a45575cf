"""The SFT flow: generated demonstrations → DeepSpeed training → checkpoint (the RL warm start): its graph
(tasks/stages/graph.py `SFT`)."""

from __future__ import annotations

from prefect import flow

from tasks.stages.graph import SFT, run_stages


@flow(name="sft", flow_run_name="{run_id}-sft")
def sft_flow(run_id: str, storage_root: str = "runs") -> dict:
    trained = run_stages(SFT, storage_root, run_id)["sft_metrics"]
    return {"checkpoint": trained.extra.get("checkpoint"), "exported_to": trained.extra.get("exported_to")}
