"""`rlpipe sql`: read-only DuckDB views over a run's complete, verified stage data, in a sandbox.

Each stage is a view over the parts its manifests list, each part checked against its manifest first (a damaged one
is refused with one line naming it). The connection then locks DuckDB's own settings: no file, URL or extension
outside those parts can be read, and no setting can be changed back (`read_csv('/etc/passwd')`, `glob`, an https URL
or `INSTALL httpfs` fail with one line).
Imports: DuckDB inside the functions that query: `rlpipe --help` does not load it.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from schemas.errors import NotFound, UserError
from storage import RunLayout, complete_files

READ_ONLY_STATEMENTS = {"SELECT", "EXPLAIN"}


class QueryError(UserError, ValueError):
    pass


def warn_strays(layout, console: Console) -> None:
    for path in layout.strays():
        console.print(
            f"[yellow]warning:[/] ignoring {path} (not a stage folder rlpipe wrote)", highlight=False, soft_wrap=True
        )


def connect(run_ids: list[str], root: str, console: Console | None = None):
    """An in-memory DuckDB with one view per stage. With several runs, views union them with a run_id column."""
    import duckdb

    con = duckdb.connect(":memory:")
    stages: dict[str, list[tuple[str, list[Path]]]] = {}
    for run_id in run_ids:
        layout = RunLayout(Path(root), run_id)
        if not layout.run_dir.is_dir():
            raise NotFound(f"run {run_id!r} not found under {root}")
        if console is not None:
            warn_strays(layout, console)
        for stage in layout.stages():
            files = complete_files(layout, stage, verify=True)
            if files:
                stages.setdefault(stage, []).append((run_id, files))
    for stage, runs in stages.items():
        selects = [
            f"SELECT *, '{rid}' AS run_id FROM read_parquet({[str(f) for f in files]!r}, union_by_name=true, "
            f"hive_partitioning=false)"
            for rid, files in runs
        ]
        con.execute(f'CREATE VIEW "{stage}" AS ' + " UNION ALL BY NAME ".join(selects))
    sandbox(con, [str(f) for runs in stages.values() for _, files in runs for f in files])
    return con


def sandbox(con, allowed: list[str]) -> None:
    """Only the run's parts are readable; no other file, URL or extension; and the settings are locked."""
    con.execute("SET allowed_paths = ?", [allowed])
    for setting in ("enable_external_access", "autoinstall_known_extensions", "autoload_known_extensions"):
        con.execute(f"SET {setting} = false")
    con.execute("SET lock_configuration = true")


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
    con = connect(run_ids, root, console)
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
