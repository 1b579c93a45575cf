"""`rlpipe diff RUN_A RUN_B --stage S`: the per-sample differences of one stage between two runs (a fork and
its origin, or any two runs over the same prompts). Rows are matched on the table's key columns."""

from __future__ import annotations

from pathlib import Path

import polars as pl
from rich.console import Console
from rich.table import Table

from schemas.errors import NotFound
from schemas.tables import TABLES
from storage import RunLayout, scan


def diff_frames(a: pl.DataFrame, b: pl.DataFrame, keys: list[str]) -> tuple[pl.DataFrame, dict[str, int]]:
    """Rows present in both whose shared columns differ, as `col_a`/`col_b` pairs, and the count per column
    (plus `only_in_a`/`only_in_b`). Nulls compare equal to nulls; list columns compare whole lists."""
    shared = [c for c in a.columns if c in b.columns and c not in keys]
    joined = a.join(b, on=keys, how="full", suffix="__b", coalesce=True)
    counts = {
        "only_in_a": joined.filter(~pl.any_horizontal(*(pl.col(f"{c}__b").is_not_null() for c in shared))).height,
        "only_in_b": joined.filter(~pl.any_horizontal(*(pl.col(c).is_not_null() for c in shared))).height,
    }
    both = joined.filter(
        pl.any_horizontal(*(pl.col(c).is_not_null() for c in shared))
        & pl.any_horizontal(*(pl.col(f"{c}__b").is_not_null() for c in shared))
    )
    flags = {c: ~pl.col(c).eq_missing(pl.col(f"{c}__b")) for c in shared}
    marked = both.with_columns(**{f"_diff_{c}": e for c, e in flags.items()})
    for c in shared:
        counts[c] = int(marked[f"_diff_{c}"].sum())
    changed = [c for c in shared if counts[c]]
    rows = marked.filter(pl.any_horizontal(*(pl.col(f"_diff_{c}") for c in changed))) if changed else marked.head(0)
    return rows.select(
        *keys, *(x for c in changed for x in (pl.col(c).alias(f"{c}_a"), pl.col(f"{c}__b").alias(f"{c}_b")))
    ), counts


def _cell(v) -> str:
    if isinstance(v, list):
        return f"[{len(v)}] mean {sum(v) / len(v):.4g}" if v else "[]"
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def diff_runs(run_a: str, run_b: str, stage: str, iteration: int | None, root: str, limit: int = 20) -> dict:
    for run in (run_a, run_b):
        if not RunLayout(Path(root), run).config_path.exists():
            raise NotFound(f"run {run!r} not found under {root}")
    table = TABLES.get(stage)
    if table is None or not table.unique:
        raise NotFound(f"no per-sample table named {stage!r}")
    frames = []
    for run in (run_a, run_b):
        lf = scan(run, stage, root, verify=True)
        frames.append((lf.filter(pl.col("iteration") == iteration) if iteration is not None else lf).collect())
    rows, counts = diff_frames(frames[0], frames[1], list(table.unique))
    out = Console()
    summary = Table(title=f"{stage}: {run_a} (a) vs {run_b} (b), {frames[0].height} vs {frames[1].height} rows")
    summary.add_column("column")
    summary.add_column("rows that differ", justify="right")
    for col, n in counts.items():
        summary.add_row(col, str(n))
    out.print(summary)
    scalar = [c for c in rows.columns if not isinstance(rows.schema[c], pl.List)]
    if len(scalar) > len(table.unique):  # list columns are counted above; show them only when nothing else differs
        rows = rows.select(scalar)
    if rows.height:
        detail = Table(title=f"first {min(limit, rows.height)} of {rows.height} differing samples")
        for col in rows.columns:
            detail.add_column(col, justify="right")
        for row in rows.head(limit).iter_rows():
            detail.add_row(*(_cell(v) for v in row))
        out.print(detail)
    return {"differing_rows": rows.height, **counts}
