"""`make bench`: side-by-side benchmarks (not collected by pytest: files are named bench_*.py)."""


def result_row(benchmark: str, baseline: str, baseline_value: float, rlpipe_value: float, unit: str) -> dict:
    """One row of runs/bench/results.parquet; the ratio is rlpipe's advantage (greater is better)."""
    return {
        "benchmark": benchmark,
        "baseline": baseline,
        "baseline_value": baseline_value,
        "rlpipe_value": rlpipe_value,
        "unit": unit,
        "ratio": rlpipe_value / baseline_value,
    }


def run_with_evals(config: str, overrides: list[str], run_id: str, iterations: int, algo: str):
    """(layout, start, ends): a fresh run of `config` iterated as `rlpipe run` iterates it (flows.rl.iterations: the
    generation one step ahead when the config says so, the evals it asks for, the final one on every held-out prompt),
    without the start eval (the same for every run of one model), time.time() before the first iteration and at the end
    of each. The bench's overrides should set rl.eval_every past `iterations`, so that only the final eval is timed."""
    import shutil
    import time
    from pathlib import Path

    from prefect import flow

    from flows.deployments import prepare_checked_run
    from flows.local_prefect import local_flow_settings
    from flows.rl import iterations as iterate
    from schemas.config import load_config
    from storage import RunLayout
    from tasks.engines.resident import close_all
    from tasks.stages.common import plan_task
    from tasks.stages.dataset import dataset_task

    @flow(name="bench-rl", flow_run_name="{run_id}")
    def loop(run_id: str, root: str) -> None:  # a flow, as rl_run: the generation ahead is a task submitted in it
        dataset_task(root, run_id)
        ends.append(time.time())
        for _ in iterate(run_id, root, plan_task(root, run_id)):
            ends.append(time.time())

    shutil.rmtree(Path(load_config(config, overrides, algo).storage_root) / run_id, ignore_errors=True)
    ends = []
    try:
        root = prepare_checked_run(config, [*overrides, f"rl.iterations={iterations}"], run_id, algo)
        with local_flow_settings():
            loop(run_id, root)
    finally:
        close_all()
    return RunLayout(Path(root), run_id), ends[0], ends[1:]


def run_rows(name: str, root, rows: list[str], measure, table) -> list[dict]:
    """A bench of rows, each a run under root/<row> whose result.json a finished run has (read back, not rerun):
    the rows RLPIPE_<NAME>_ROWS picks (default: all) measured, the table of every finished row printed and written to
    root/table.md, and each measured row's held-out greedy accuracy against the `grpo` row's, as results rows."""
    import json
    import os

    variable = f"RLPIPE_{name.upper()}_ROWS"
    chosen = os.environ.get(variable)
    unknown = set(chosen.split(",")) - set(rows) if chosen else set()
    if unknown:
        raise SystemExit(f"{variable}: unknown rows {sorted(unknown)}; rows: {', '.join(rows)}")
    root.mkdir(parents=True, exist_ok=True)
    results = [measure(r) for r in rows if not chosen or r in chosen.split(",")]
    done = [json.loads((root / r / "result.json").read_text()) for r in rows if (root / r / "result.json").exists()]
    text = table(done)
    (root / "table.md").write_text(text + "\n")
    print(text)
    grpo = next((r for r in done if r["row"] == "grpo"), None)
    return [
        result_row(f"{name}_accuracy_{r['row']}", "grpo", grpo["accuracy"], r["accuracy"], "held-out greedy accuracy")
        for r in results
        if grpo and r["row"] != "grpo"
    ]
