"""A run's tables read back whole, after the fact (the analysis commands, the run's summary): every part of every
complete iteration of a stage, as files or one LazyFrame (`scan`), each part checked against its manifest on request,
through the run's verification cache (`verified_parts`). Writing a stage, and one stage-iteration's parts and manifest,
is the stage contract's (storage/stage_io.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import polars as pl

from schemas.errors import UserError
from schemas.tables import TABLES
from storage.layout import RunLayout
from storage.stage_io import part_files, read_manifest, sha256_file, write_json_atomic


class DamagedDataError(UserError):
    pass


def verified_parts(layout: RunLayout, keys: Iterable[tuple[str, int]]) -> dict[tuple[str, int], list[Path]]:
    """The parts of each complete (stage, iteration) in `keys`, each checked against its manifest (size, then
    sha256); a damaged one is refused with one line naming it. The sha256 of a part whose size and mtime are
    unchanged since it was last checked is not recomputed (the run's verification cache, read and written once per
    call), so reading a large run stays fast. Incomplete stage-iterations map to no parts."""
    cache_path = layout.verified_cache_path
    try:
        cache = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cache = {}
    out, changed = {}, False
    try:
        for stage, iteration in keys:
            manifest = read_manifest(layout, stage, iteration, verify=False)
            out[stage, iteration] = files = []
            for part in manifest["parts"] if manifest else []:
                file = layout.stage_dir(stage, iteration) / part["file"]
                key = str(file.relative_to(layout.run_dir))
                try:
                    st = file.stat()
                except OSError:
                    raise DamagedDataError(_damaged(layout, file, "missing")) from None
                if "bytes" in part and st.st_size != part["bytes"]:
                    raise DamagedDataError(
                        _damaged(layout, file, f"{st.st_size} bytes, its manifest says {part['bytes']}")
                    )
                if cache.get(key) != [st.st_size, st.st_mtime_ns, part["sha256"]]:
                    if sha256_file(file) != part["sha256"]:
                        raise DamagedDataError(_damaged(layout, file, "its sha256 differs from its manifest's"))
                    cache[key], changed = [st.st_size, st.st_mtime_ns, part["sha256"]], True
                files.append(file)
    finally:
        if changed:  # what was checked before a damaged part stays checked
            try:
                write_json_atomic(cache_path, cache)
            except OSError:
                pass  # a read-only run folder: the check is redone next time
    return out


def _damaged(layout: RunLayout, file: Path, why: str) -> str:
    return (
        f"{file} is damaged ({why}); re-run the command that made it to repair it "
        f"(`rlpipe resume {layout.run_id}` for an RL run)"
    )


def complete_files(layout: RunLayout, stage: str, verify: bool = False) -> list[Path]:
    """Every part of every complete iteration of a stage: half-written data is never visible. With `verify`, each
    part is checked against its manifest (verified_parts)."""
    iterations = layout.iterations(stage)
    if verify:
        checked = verified_parts(layout, [(stage, it) for it in iterations])
        return [f for it in iterations for f in checked[stage, it]]
    return [f for it in iterations for f in part_files(layout, stage, it)]


def scan(run_id: str, stage: str, root: str | Path = "runs", verify: bool = False) -> pl.LazyFrame:
    """A LazyFrame over every complete iteration of one stage (`iteration` is a column); with `verify`, damaged parts
    are refused (DamagedDataError)."""
    layout = RunLayout(Path(root), run_id)
    files = complete_files(layout, stage, verify)
    if not files:
        table = TABLES.get(stage)
        return pl.LazyFrame(schema=table.polars if table else {})
    # Parts can differ in their open (metric) columns, hence a diagonal concat rather than one scan.
    return pl.concat([pl.scan_parquet(f) for f in files], how="diagonal_relaxed")
