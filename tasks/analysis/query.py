"""`rlpipe sql` and `rlpipe show`: read-only views over a run's complete stage data."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from schemas.errors import NotFound, UserError

READ_ONLY_STATEMENTS = {"SELECT", "EXPLAIN"}


class QueryError(UserError, ValueError):
    pass


def connect(run_ids: list[str], root: str):
    """An in-memory DuckDB with one view per stage. With several runs, views union them with a run_id column."""
    import duckdb

    from storage import RunLayout, complete_files

    con = duckdb.connect(":memory:")
    stages: dict[str, list[tuple[str, list[Path]]]] = {}
    for run_id in run_ids:
        layout = RunLayout(Path(root), run_id)
        if not layout.run_dir.is_dir():
            raise NotFound(f"run {run_id!r} not found under {root}")
        for stage in layout.stages():
            files = complete_files(layout, stage)
            if files:
                stages.setdefault(stage, []).append((run_id, files))
    for stage, runs in stages.items():
        selects = [
            f"SELECT *, '{rid}' AS run_id FROM read_parquet({[str(f) for f in files]!r}, union_by_name=true, hive_partitioning=false)"
            for rid, files in runs
        ]
        con.execute(f'CREATE VIEW "{stage}" AS ' + " UNION ALL BY NAME ".join(selects))
    return con


def check_read_only(query: str) -> None:
    import duckdb

    try:
        statements = duckdb.extract_statements(query)
    except duckdb.Error as exc:
        raise QueryError(f"invalid SQL: {str(exc).splitlines()[0]}") from None
    for st in statements:
        kind = st.type.name
        if kind not in READ_ONLY_STATEMENTS:
            raise QueryError(f"refused: {kind} statements are not allowed (rlpipe sql is read-only)")


def run_sql(run_ids: list[str], query: str, root: str, console: Console) -> None:
    import duckdb

    check_read_only(query)
    con = connect(run_ids, root)
    try:
        rel = con.sql(query)
    except duckdb.Error as exc:
        raise QueryError(f"query failed: {str(exc).splitlines()[0]}") from None
    table = Table()
    for col in rel.columns:
        table.add_column(col)
    for row in rel.fetchall():
        table.add_row(*[f"{v:.4f}" if isinstance(v, float) else str(v) for v in row])
    Console().print(table)


def superseded_stages(layout) -> set[tuple[str, int]]:
    """(stage, iteration) pairs that `rlpipe rerun` moved aside (see superseded.json)."""
    import json

    log = layout.superseded_log
    records = json.loads(log.read_text()) if log.exists() else []
    return {(name, k) for record in records for name, k in record["stages"]}


def show_run(run_id: str, root: str, console: Console) -> None:
    from storage import RunLayout, read_manifest, scan

    layout = RunLayout(Path(root), run_id)
    if not layout.run_dir.is_dir():
        raise NotFound(f"run {run_id!r} not found under {root}")
    superseded = superseded_stages(layout)
    present = {s: set(layout.iterations(s)) for s in layout.stages()}  # listed once, not per cell
    stages = sorted(set(present) | {s for s, _ in superseded}, key=lambda s: (s not in present, s))
    iterations = sorted({it for its in present.values() for it in its} | {it for _, it in superseded})
    status = Table(title=f"{run_id}: stages")
    status.add_column("iteration")
    for s in stages:
        status.add_column(s)
    for it in iterations:
        cells = []
        for s in stages:
            here = it in present.get(s, ())
            m = read_manifest(layout, s, it, verify=False) if here else None
            if m:
                cells.append(f"complete ({m['wall_seconds']:.1f}s)")
            else:
                cells.append("superseded" if (s, it) in superseded else "missing" if here else "")
        status.add_row(str(it), *cells)
    Console().print(status)
    metrics = scan(run_id, "train_metrics", root).collect()
    if metrics.height:
        keys = [c for c in ("iteration", "reward_mean", "score_accuracy_mean", "kl_ref", "entropy", "clip_frac_high",
                            "response_length_mean", "seconds_optimize") if c in metrics.columns]
        t = Table(title="train_metrics")
        for k in keys:
            t.add_column(k)
        for row in metrics.sort("iteration").select(keys).iter_rows():
            t.add_row(*[f"{v:.4f}" if isinstance(v, float) else str(v) for v in row])
        Console().print(t)
    evals = Table(title="eval (greedy pass@1 and sampled pass@k on held-out prompts)")
    for col in ("iteration", "accuracy", "pass@k", "prompts"):
        evals.add_column(col)
    for it in layout.iterations("eval"):
        m = read_manifest(layout, "eval", it, verify=False)
        if m:
            e = m["extra"]
            pk = next((v for k, v in e.items() if k.startswith("pass_at_")), float("nan"))
            evals.add_row(str(it), f"{e['accuracy']:.4f}", f"{pk:.4f}", str(e["prompts"]))
    Console().print(evals)
