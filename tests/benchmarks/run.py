"""`make bench`: run the side-by-side benchmarks and write runs/bench/results.parquet (schemas.tables.BENCH_RESULTS).

Each benchmark times its baseline and rlpipe in the same process on the same inputs, so the ratio holds on a
noisy machine where absolute times do not. Usage: python -m tests.benchmarks.run [NAME-PREFIX ...]
"""

from __future__ import annotations

import io
import sys
from functools import partial
from pathlib import Path

import polars as pl
from rich.console import Console
from rich.table import Table

import flows.cli  # noqa: F401  (first: Prefect's home, start-up timeout and local API database, as the rlpipe command sets them)
from flows.local_prefect import local_flow_settings
from schemas.tables import BENCH_RESULTS
from storage.stage_io import write_bytes_atomic
from tests.benchmarks import (
    bench_advantages,
    bench_arpo,
    bench_async,
    bench_attention,
    bench_frontier,
    bench_iteration,
    bench_long,
    bench_long_iteration,
    bench_lora,
    bench_memory,
    bench_multiturn,
    bench_partial,
    bench_real,
    bench_real_trl,
    bench_reasoning,
    bench_rollout,
    bench_sync,
    bench_trl,
)

RESULTS = Path("runs/bench/results.parquet")
SUITES = {
    "rollout": bench_rollout.run,
    "advantages": bench_advantages.run,
    "iteration": bench_iteration.run,
    "e2e_vs_trl": bench_trl.run,
    "e2e_long": bench_long.run,
    "long_memory": bench_memory.run,
    "attention": bench_attention.run,
    "partial": bench_partial.run,
    "long_iteration": bench_long_iteration.run,
    "e2e_real": bench_real_trl.run,
    "real": bench_real.run,
    "lora": bench_lora.run,
    "sync": bench_sync.run,
    "async": bench_async.run,
    "frontier": bench_frontier.run,
    "multiturn": bench_multiturn.run,
    "arpo": bench_arpo.run,
    **{f"reasoning_{n}": partial(bench_reasoning.run, n) for n in ("baseline", "easy", "steps", "candidates")},
}


def main(prefixes: list[str]) -> None:
    rows = []
    for name, suite in SUITES.items():
        if not prefixes or any(name.startswith(p) for p in prefixes):
            with local_flow_settings():  # as the rlpipe command runs its flows
                rows += suite()
    table = BENCH_RESULTS.validate(pl.DataFrame(rows, schema=BENCH_RESULTS.polars))
    if prefixes and RESULTS.exists():  # a partial run replaces its own rows and keeps the others
        kept = pl.read_parquet(RESULTS).join(table.select("benchmark"), on="benchmark", how="anti")
        table = BENCH_RESULTS.validate(pl.concat([kept, table]))
    buffer = io.BytesIO()
    table.write_parquet(buffer)
    write_bytes_atomic(RESULTS, buffer.getvalue())
    view = Table("benchmark", "baseline", "baseline", "rlpipe", "unit", "ratio", title=str(RESULTS))
    for r in table.iter_rows(named=True):
        view.add_row(
            r["benchmark"],
            r["baseline"],
            f"{r['baseline_value']:.4g}",
            f"{r['rlpipe_value']:.4g}",
            r["unit"],
            f"{r['ratio']:.2f}",
        )
    Console(width=150).print(view)


if __name__ == "__main__":
    main(sys.argv[1:])
