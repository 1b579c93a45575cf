"""`summary.json`: the headline numbers of a run, gathered from its manifests and tables."""

from __future__ import annotations

import json

from storage import read_manifest, scan, write_json_atomic
from tasks.algos.metrics import split_by_source
from tasks.stages.common import load_run, stage_task


def collect_summary(storage_root: str, run_id: str) -> dict:
    ctx = load_run(storage_root, run_id)
    layout = ctx.layout
    manifests = {it: read_manifest(layout, "eval", it, verify=False) for it in layout.iterations("eval")}
    evals = {it: m["extra"] for it, m in manifests.items() if m}
    metrics = scan(run_id, "train_metrics", storage_root).collect()
    iterations = metrics.height
    final_it = max(evals) if evals else None
    walls: dict[str, float] = {}
    for stage in layout.stages():
        for it in layout.iterations(stage):
            m = read_manifest(layout, stage, it, verify=False)
            if m:
                walls[stage] = walls.get(stage, 0.0) + float(m["wall_seconds"])
    k = ctx.cfg.eval.pass_k
    cfg = ctx.cfg
    files = ", ".join(cfg.data.train_files) or ", ".join(f"{s.name} ×{s.weight:g}" for s in cfg.data.sources)
    task = f"{cfg.task.name} ({files})" if cfg.task else files
    summary = {
        "run_id": run_id,
        "model": cfg.model.path,
        "task": task,
        "iterations": iterations,
        "stage_seconds_total": {s: round(v, 2) for s, v in sorted(walls.items())},
    }
    if evals:  # a reward-model run has no eval of a policy
        summary.update(
            {
                "eval_prompts": evals[final_it]["prompts"],
                "eval_accuracy_start": evals.get(0, {}).get("accuracy"),
                "eval_accuracy_final": evals[final_it]["accuracy"],
                f"eval_pass_at_{k}_start": evals.get(0, {}).get(f"pass_at_{k}"),
                f"eval_pass_at_{k}_final": evals[final_it].get(f"pass_at_{k}"),
                "eval_mean_length_start": evals.get(0, {}).get("mean_length"),
                "eval_mean_length_final": evals[final_it].get("mean_length"),
                "eval_by_iteration": {str(it): e.get("accuracy") for it, e in sorted(evals.items())},
                # Interim evals (eval.interim_prompts) see fewer prompts than the first and the last.
                "eval_prompts_by_iteration": {str(it): e.get("prompts") for it, e in sorted(evals.items())},
                "eval_seconds_by_iteration": {
                    str(it): round(float(manifests[it]["wall_seconds"]), 1) for it in sorted(evals)
                },
            }
        )
        for when, it in (("start", 0), ("final", final_it)):  # per source, when the dataset names its sources
            if by := split_by_source(evals.get(it, {})):
                summary[f"eval_by_source_{when}"] = by
        rhos = {
            str(it): e["reward_model_rule_spearman"]
            for it, e in sorted(evals.items())
            if "reward_model_rule_spearman" in e
        }
        if rhos:  # RL scored by a reward model: its agreement with the rule on the held-out prompts
            summary["eval_reward_model_rule_spearman_by_iteration"] = rhos
    if iterations:
        last = metrics.sort("iteration").row(-1, named=True)
        summary["final_train_metrics"] = {k2: v for k2, v in last.items() if isinstance(v, (int, float))}
        summary["reward_mean_by_iteration"] = metrics.sort("iteration")["reward_mean"].to_list()
    return summary


@stage_task("summary")
def summary_task(storage_root: str, run_id: str, extra: dict | None = None) -> dict:
    layout = load_run(storage_root, run_id).layout
    previous = {}
    if layout.summary_path.exists():
        previous = json.loads(layout.summary_path.read_text())
    summary = {**previous, **collect_summary(storage_root, run_id), **(extra or {})}
    write_json_atomic(layout.summary_path, summary)
    return summary
