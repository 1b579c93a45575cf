"""`rlpipe export-data RUN OUT`: a run's scored rollouts as data, for the next step (docs/data-out.md).

One row per sample: rollouts joined with their scores, their advantages (null where the group was not trained on) and
their prompt, filtered by a SQL `WHERE` over those columns (in `rlpipe sql`'s read-only sandbox: subqueries may read
any of the run's tables, nothing else), and written in one of three shapes, each row with its provenance:

- `raw`: every column of the joined tables;
- `sft`: prompt (chat messages) and response: `rlpipe sft`'s `sft.files` as they are;
- `pairs`: prompt, chosen and rejected, two samples of one group by a pair rule (`best-worst`, `all`), ties never
  paired: `rlpipe dpo`'s `preference.data` as it is.

Provenance: run_id, iteration, prompt_id, sample_idx, policy_version (the tables' own: they join back in SQL),
config_hash (the rollouts manifest's: the config the sampling read) and reward_fingerprint (the fingerprint the scores
manifest records for the round's part: it changes with the reward's config, its code and the rollouts it scored).
Pure but for reading the run (DuckDB) and writing the file.
Imports: DuckDB inside the functions that query.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import Callable

import polars as pl
from rich.console import Console

from schemas.errors import NotFound, UserError
from storage import RunLayout, read_manifest
from tasks.analysis.query import QueryError, connect
from tasks.registry import Registry

FORMATS = {".parquet": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl"}  # a file's suffix → its format; hf: a folder
PROVENANCE = ["run_id", "iteration", "prompt_id", "sample_idx", "policy_version", "config_hash", "reward_fingerprint"]
GROUP = ["run_id", "iteration", "prompt_id"]
# A pair's columns taken once from each side (chosen_X, rejected_X); the group's are shared.
SIDE = ["sample_idx", "reward", "policy_version", "reward_fingerprint"]
ADVANTAGE_COLUMNS = {"advantage": "DOUBLE", "token_advantages": "FLOAT[]", "returns": "FLOAT[]"}
# Multi-turn rollouts: `response` is only the model's last turn, so sft and pairs would be wrong; raw holds them whole.
MULTI_TURN = "conversation"
# The columns the sft and pairs shapes are made from (provenance's config_hash and reward_fingerprint come after).
SHAPED_FROM = [*PROVENANCE[:5], "round", "prompt", "response", "reward", MULTI_TURN]


class ExportError(UserError, ValueError):
    pass


def _columns(con, view: str) -> list[str]:
    return con.sql(f'SELECT * FROM "{view}" LIMIT 0').columns


def samples_sql(columns: dict[str, list[str]]) -> str:
    """The one-row-per-sample SELECT over the run's views (`columns`: each view's columns). The prompt's row is the
    iteration's that drew it (`prompt_iteration`: a partial rollout's group began in an earlier one); the prompts'
    formatted text is `prompt_text`, their messages `prompt`; the rollouts' `text` is `response`."""
    r, s, p = columns["rollouts"], columns["scores"], columns["prompts"]
    picked = ["r.run_id", "r.iteration", "r.prompt_id", "r.sample_idx", "r.policy_version", "r.round"]
    picked += ["p.messages AS prompt", "p.text AS prompt_text", "p.answer", "r.text AS response"]
    taken = {"run_id", "iteration", "prompt_id", "sample_idx", "policy_version", "round", "prompt", "prompt_text"}
    taken |= {"answer", "response", "text"}
    picked += [f'r."{c}"' for c in r if c not in taken]
    taken |= set(r)
    picked += [f's."{c}"' for c in s if c not in taken]
    taken |= set(s)
    advantages = columns.get("advantages")
    picked += [f"a.{c}" if advantages else f"NULL::{t} AS {c}" for c, t in ADVANTAGE_COLUMNS.items()]
    taken |= set(ADVANTAGE_COLUMNS) | {"messages", "prompt_token_ids"}
    picked += [f'p."{c}"' for c in p if c not in taken]  # the dataset's own columns (`extra`)
    prompt_iteration = "coalesce(r.prompt_iteration, r.iteration)" if "prompt_iteration" in r else "r.iteration"
    keys = "r.run_id = {t}.run_id AND r.prompt_id = {t}.prompt_id"
    sql = (
        f"SELECT {', '.join(picked)} FROM rollouts r "
        f"JOIN scores s ON {keys.format(t='s')} AND s.iteration = r.iteration AND s.round = r.round "
        f"AND s.sample_idx = r.sample_idx "
        f"JOIN prompts p ON {keys.format(t='p')} AND p.iteration = {prompt_iteration}"
    )
    if advantages:
        sql += (
            f" LEFT JOIN advantages a ON {keys.format(t='a')} AND a.iteration = r.iteration "
            "AND a.sample_idx = r.sample_idx"
        )
    return sql


def filtered(con, sql: str, where: str | None):
    """The relation `sql` with the user's filter applied: one SQL expression of type BOOLEAN (parsed as an expression,
    so it cannot end the statement or add another), else one line saying why."""
    import duckdb

    rel = con.sql(sql).set_alias("samples")  # a correlated subquery names the row's columns `samples.iteration`, ...
    if not where:
        return rel
    try:
        expr = duckdb.SQLExpression(where)
    except duckdb.Error as exc:
        raise QueryError(f"--where is not one SQL expression: {str(exc).splitlines()[0]}") from None
    try:
        kind = str(rel.select(expr).types[0])
        if kind != "BOOLEAN":
            raise QueryError(f"--where must be a filter (a true/false condition); {where!r} is of type {kind}")
        return rel.filter(expr)
    except duckdb.Error as exc:
        raise QueryError(f"--where failed: {str(exc).splitlines()[0]}") from None


def provenance(layout: RunLayout, samples: pl.DataFrame) -> pl.DataFrame:
    """Each sample's config_hash (its iteration's rollouts manifest) and reward_fingerprint (the scores manifest's
    fingerprint of the part its round wrote)."""
    config, reward = [], []
    for it in sorted(set(samples["iteration"].to_list())):
        config.append((it, read_manifest(layout, "rollouts", it, verify=False)["config_hash"]))
        reward += [
            (it, p["index"], p["fingerprint"]) for p in read_manifest(layout, "scores", it, verify=False)["parts"]
        ]
    config_frame = pl.DataFrame(config, schema={"iteration": pl.Int32, "config_hash": pl.Utf8}, orient="row")
    reward_schema = {"iteration": pl.Int32, "round": pl.Int32, "reward_fingerprint": pl.Utf8}
    reward_frame = pl.DataFrame(reward, schema=reward_schema, orient="row")
    out = samples.join(config_frame, on="iteration", how="left")
    out = out.join(reward_frame, on=["iteration", "round"], how="left")
    return out.select(*PROVENANCE, pl.exclude(PROVENANCE))


def read_samples(
    run_id: str, root: str, where: str | None, console: Console | None = None, keep: list[str] | None = None
) -> pl.DataFrame:
    """The run's scored samples (complete iterations only) that pass `where`, with their provenance, in order; with
    `keep`, only those of its columns the run has (the filter still sees every column)."""
    import duckdb

    layout = RunLayout(Path(root), run_id)
    con = connect([run_id], root, console)  # NotFound for an unknown run; the parts verified against their manifests
    views = {name for (name,) in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()}
    missing = [v for v in ("rollouts", "scores", "prompts") if v not in views]
    if missing:
        raise NotFound(f"run {run_id!r} has no complete scored rollouts yet (no complete {', '.join(missing)})")
    columns = {v: _columns(con, v) for v in ("rollouts", "scores", "prompts", "advantages") if v in views}
    rel = filtered(con, samples_sql(columns), where)
    if keep is not None:  # the sft and pairs shapes need a few columns: the token lists stay in DuckDB
        rel = rel.select(*(f'"{c}"' for c in keep if c in rel.columns))
    try:
        frame = rel.order("iteration, prompt_id, sample_idx").pl()
    except duckdb.Error as exc:
        raise QueryError(f"--where failed: {str(exc).splitlines()[0]}") from None
    return provenance(layout, frame)


def sft_rows(samples: pl.DataFrame) -> pl.DataFrame:
    """SFT demonstrations: `prompt` (chat messages, formatted again by `rlpipe sft` as rollouts formatted them) and
    `response`, with each sample's provenance and reward."""
    return samples.select(*PROVENANCE, "prompt", "response", "reward")


PairRule = Callable[[pl.DataFrame, pl.DataFrame], pl.DataFrame]
PAIR_RULES: Registry[PairRule] = Registry("pair rule")


@PAIR_RULES.register("best-worst")
def best_worst(a: pl.DataFrame, b: pl.DataFrame) -> pl.DataFrame:
    """One pair a group: its highest reward chosen, its lowest rejected (the lower sample_idx among equals)."""
    best = a.sort("reward", "sample_idx", descending=[True, False]).group_by(GROUP, maintain_order=True).first()
    worst = b.sort("reward", "sample_idx").group_by(GROUP, maintain_order=True).first()
    return best.join(worst, on=GROUP, suffix="_b")


@PAIR_RULES.register("all")
def all_pairs(a: pl.DataFrame, b: pl.DataFrame) -> pl.DataFrame:
    """Every two samples of a group whose rewards differ, the higher chosen (a group of G gives up to G(G−1)/2)."""
    return a.join(b, on=GROUP, suffix="_b")


def pair_rows(samples: pl.DataFrame, rule: str, min_margin: float = 0.0) -> pl.DataFrame:
    """Preference pairs of two samples of one group (same run, iteration and prompt) by `rule`: chosen's reward above
    rejected's by more than 0 and at least `min_margin`; equal rewards, equal texts and null rewards never pair."""
    pick = PAIR_RULES.get(rule)
    side = samples.filter(pl.col("reward").is_not_null()).select(*GROUP, "config_hash", "prompt", "response", *SIDE)
    pairs = pick(side, side.drop("config_hash", "prompt"))
    margin = pl.col("reward") - pl.col("reward_b")
    pairs = pairs.filter((margin > 0) & (margin >= min_margin) & (pl.col("response") != pl.col("response_b")))
    return pairs.sort(*GROUP, "sample_idx", "sample_idx_b").select(
        *GROUP,
        "config_hash",
        "prompt",
        pl.col("response").alias("chosen"),
        pl.col("response_b").alias("rejected"),
        *(pl.col(c).alias(f"chosen_{c}") for c in SIDE),
        *(pl.col(f"{c}_b").alias(f"rejected_{c}") for c in SIDE),
    )


def shaped(samples: pl.DataFrame, shape: str, rule: str, min_margin: float) -> pl.DataFrame:
    if shape == "raw":
        return samples
    if MULTI_TURN in samples.columns:
        raise ExportError(
            f"--shape {shape}: this run's rollouts are multi-turn trajectories (its `response` is the last turn "
            "alone); export them with --shape raw"
        )
    return sft_rows(samples) if shape == "sft" else pair_rows(samples, rule, min_margin)


def output_format(out: str, fmt: str | None) -> str:
    if fmt is None:
        fmt = FORMATS.get(Path(out).suffix.lower())
        if fmt is None:
            raise ExportError(f"{out}: name a .parquet or .jsonl file, or give --format (parquet, jsonl or hf)")
    if fmt not in ("parquet", "jsonl", "hf"):
        raise ExportError(f"unknown --format {fmt!r}: choose parquet, jsonl or hf (a Hugging Face datasets folder)")
    if fmt == "hf" and importlib.util.find_spec("datasets") is None:
        raise ExportError("--format hf needs Hugging Face's `datasets` package (pip install datasets)")
    return fmt


def write_rows(frame: pl.DataFrame, out: str, fmt: str) -> None:
    """The rows at `out`, replacing what is there: written beside it under a temporary name, then renamed."""
    target = Path(out)
    if target.is_dir() and fmt != "hf":
        raise ExportError(f"{out} is a folder; name a file (or give --format hf)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        if fmt == "parquet":
            frame.write_parquet(tmp, compression="zstd")
        elif fmt == "jsonl":
            frame.write_ndjson(tmp)
        else:
            import datasets

            datasets.Dataset.from_polars(frame).save_to_disk(str(tmp))
        if target.is_dir():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp)
        tmp.unlink(missing_ok=True)


def export_data(
    run_id: str,
    out: str,
    shape: str = "raw",
    where: str | None = None,
    fmt: str | None = None,
    rule: str = "best-worst",
    min_margin: float = 0.0,
    root: str = "runs",
    console: Console | None = None,
) -> dict:
    """`rlpipe export-data`: what was written (rows, samples matched, shape, format, out)."""
    if shape not in ("raw", "sft", "pairs"):
        raise ExportError(f"unknown --shape {shape!r}: choose sft, pairs or raw")
    PAIR_RULES.entry(rule)  # an unknown rule before the run is read
    fmt = output_format(out, fmt)
    samples = read_samples(run_id, root, where, console, None if shape == "raw" else SHAPED_FROM)
    if samples.is_empty():
        raise ExportError(f"no scored sample of run {run_id!r} matches --where {where!r}; nothing written")
    rows = shaped(samples, shape, rule, min_margin)
    if rows.is_empty():
        raise ExportError(
            f"no group of the {samples.height} matching samples holds two responses whose rewards differ by more "
            f"than 0 and at least --min-margin {min_margin}; nothing written"
        )
    write_rows(rows, out, fmt)
    return {"rows": rows.height, "samples": samples.height, "shape": shape, "format": fmt, "out": out}
