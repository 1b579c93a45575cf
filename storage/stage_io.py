"""The stage contract: atomic Parquet parts, a manifest written last, fingerprints, validation.

A stage-iteration folder is complete when its `_manifest.json` exists; the manifest lists every part with its
row count and sha256. Parts are written to a temporary name and renamed, then the manifest is rewritten the
same way, so a crash at any point leaves either the old complete state or nothing visible.

A stage may hold several parts (dynamic-sampling rounds). Each part carries its own fingerprint; writing
part n drops parts after n, because later rounds were drawn knowing the earlier ones. A whole run's tables are read
back, verified, by storage/scans.py.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import os
import shutil
import subprocess
import time
import warnings
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import polars as pl

from schemas.errors import NotFound, UserError
from schemas.tables import TABLES, TableSchema
from storage.crash import crash_point
from storage.layout import RunLayout

MANIFEST_VERSION = 1


@dataclass(frozen=True)
class StageOutput:
    """What a stage task returns: never a DataFrame, only where the data is and what it is."""

    stage: str
    iteration: int
    path: str
    rows: int
    fingerprint: str
    skipped: bool = False
    extra: dict = field(default_factory=dict)


def fingerprint(stage: str, config_hash: str, inputs: dict[str, str]) -> str:
    payload = json.dumps({"stage": stage, "config": config_hash, "inputs": inputs}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class DiskFullError(UserError, OSError):
    pass


def is_disk_full(exc: BaseException, folder: Path | None = None) -> bool:
    """ENOSPC, as an OSError or inside another library's message (polars: "No space left on device (os error 28)"), or
    a failure (a worker's: torch's zip writer says "unexpected pos") while the folder's filesystem is nearly full."""
    if (
        getattr(exc, "errno", None) == errno.ENOSPC
        or "No space left on device" in str(exc)
        or "os error 28" in str(exc)
    ):
        return True
    if folder is None:
        return False

    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    usage = shutil.disk_usage(folder)
    return usage.free < min(16 << 20, usage.total // 50)


@contextlib.contextmanager
def written(final: Path, *temporaries: Path):
    """Around a write of `final` through temporary files: a full disk becomes one line naming the path, and the
    temporaries are removed, so nothing half-written is left filling the disk."""
    try:
        yield
    except Exception as exc:
        full = is_disk_full(exc, final.parent)  # before the cleanup frees space
        for tmp in temporaries:
            _rmtree(tmp) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        if full:
            raise DiskFullError(f"no space left on device writing {final}") from None
        raise


def write_bytes_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with written(path, tmp):
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def write_json_atomic(path: Path, obj) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode())


def folder_bytes(path: Path) -> int:
    """The bytes of every file under `path` (0 when it does not exist); a file a live run renames or removes meanwhile
    counts 0."""
    total = 0
    for f in path.rglob("*") if path.exists() else ():
        try:
            total += f.stat().st_size if f.is_file() else 0
        except OSError:
            pass
    return total


def state_bytes(checkpoint: Path) -> int:
    """The bytes of a checkpoint's DeepSpeed optimizer state: every `ds_state/` under it (policy's and critic's)."""
    return sum(folder_bytes(d) for d in checkpoint.rglob("ds_state") if d.is_dir())


def has_weight_files(path) -> bool:
    """Whether a model folder (or checkpoint) holds its weights: safetensors files (a model's, or an adapter's). A
    weights-only checkpoint under engines.weight_sync collective holds none: its trainer keeps them."""
    path = Path(path)
    return path.is_dir() and any(f.suffix == ".safetensors" for f in path.iterdir())


def ensure_free(folder: Path, needed: int, what: str) -> None:
    """Refuse, with one line naming the path and the bytes, to start writing `needed` bytes where fewer are free:
    a checkpoint found the full disk only after minutes of training."""
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed:
        raise DiskFullError(
            f"not enough free disk for {what} at {folder}: it needs about {needed / 1e9:.2f} GB, "
            f"{free / 1e9:.2f} GB are free"
        )


def temp_dir_for(final: Path) -> Path:
    """The folder to write `final` under before `commit_dir` renames it into place. Whatever a crash
    mid-save left there is removed first, so old and new files never mix."""
    tmp = final.with_name(final.name + ".tmp")
    _rmtree(tmp)
    return tmp


def state_dir_for(final: Path) -> Path:
    """Where the resident trainer writes a committed checkpoint's optimizer state before moving it in
    (tasks/engines/workers/deferred_state.py): beside `final`, so that no rename of `final` disturbs it."""
    return final.with_name(final.name + ".state-tmp")


def commit_dir(tmp: Path, final: Path) -> None:
    """Publish a folder written under a temporary name (a checkpoint) by renaming it into place."""
    if final.exists():
        old = final.with_name(final.name + f".old-{os.getpid()}")
        os.replace(final, old)
        os.replace(tmp, final)
        _rmtree(old)
    else:
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, final)


def _rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


@functools.cache
def git_sha() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def package_versions(*names: str) -> dict[str, str | None]:
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def read_manifest(layout: RunLayout, stage: str, iteration: int, verify: bool = True) -> dict | None:
    """The manifest, or None if the stage-iteration is missing or (with verify) its files are damaged."""
    path = layout.manifest_path(stage, iteration)
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
        parts = manifest["parts"]
    except (OSError, ValueError, KeyError):
        warnings.warn(f"{path}: unreadable manifest; the stage will be recomputed", stacklevel=2)
        return None
    if verify:
        for part in parts:
            file = path.parent / part["file"]
            if not file.exists() or sha256_file(file) != part["sha256"]:
                warnings.warn(f"{file}: missing or sha256 mismatch; the stage will be recomputed", stacklevel=2)
                return None
    return manifest


def changed_inputs(layout: RunLayout, manifest: dict, iteration: int, tables: tuple[str, ...]) -> list[str]:
    """The inputs among `tables` (the stage's reads, from its declaration) that a complete stage-iteration recorded in
    its manifest and that are no longer complete with the fingerprint it recorded: [] when recomputing it from the
    cached tables gives its outputs again, which is when a file it wrote beside its table (a checkpoint) may be rebuilt
    by replaying it. Inputs that are not tables (the weights a stage started from) are the stage's to check; a
    per-round table is recorded once per round (`<table>_round<i>`: its part i)."""
    changed = []
    for key, fp in manifest.get("inputs", {}).items():
        table, _, round_ = key.partition("_round")
        if table not in tables:
            continue
        current = read_manifest(layout, table, iteration, verify=False)
        parts = {p["index"]: p["fingerprint"] for p in current["parts"]} if current else {}
        if (parts.get(int(round_)) if round_ else current and current["fingerprint"]) != fp:
            changed.append(key)
    return changed


def find_complete(layout: RunLayout, stage: str, iteration: int, fp: str, part: int = 0) -> StageOutput | None:
    """A StageOutput if part `part` of this stage-iteration is complete with fingerprint `fp`."""
    manifest = read_manifest(layout, stage, iteration)
    if manifest is None:
        return None
    entry = next((p for p in manifest["parts"] if p["index"] == part), None)
    if entry is None or entry["fingerprint"] != fp:
        return None
    return _output(layout, stage, iteration, manifest, fp, skipped=True)


def _output(layout, stage, iteration, manifest, fp: str, skipped=False) -> StageOutput:
    """`fingerprint` is the part's own: what a later round or stage chains on."""
    return StageOutput(
        stage=stage,
        iteration=iteration,
        path=str(layout.stage_dir(stage, iteration)),
        rows=manifest["rows"],
        fingerprint=fp,
        skipped=skipped,
        extra=manifest.get("extra", {}),
    )


def write_stage(
    layout: RunLayout,
    stage: str,
    iteration: int,
    df: pl.DataFrame,
    *,
    fp: str,
    inputs: dict[str, str],
    config_hash: str,
    started: float,
    part: int = 0,
    engines: dict | None = None,
    extra: dict | None = None,
    table: TableSchema | None = None,
) -> StageOutput:
    """Validate `df` against its table schema, write it as part `part`, then rewrite the manifest."""
    table = table or TABLES[stage]
    df = table.validate(df, what=f"{stage} iter {iteration}")
    folder = layout.stage_dir(stage, iteration)
    folder.mkdir(parents=True, exist_ok=True)
    final = layout.part_path(stage, iteration, part)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    with written(final, tmp):
        df.write_parquet(tmp, compression="zstd", statistics=True)
        os.replace(tmp, final)
    crash_point(f"{stage}:{iteration}")

    previous = read_manifest(layout, stage, iteration, verify=False)
    kept = [p for p in (previous or {}).get("parts", []) if p["index"] < part]
    sha = sha256_file(final)
    ended = time.time()
    kept.append(
        {
            "index": part,
            "file": final.name,
            "rows": df.height,
            "bytes": final.stat().st_size,
            "sha256": sha,
            "fingerprint": fp,
            "wall_seconds": round(ended - started, 3),  # this part's (a round's) own
        }
    )
    for stale in folder.glob("part-*.parquet"):  # parts after this one are no longer valid
        if stale.name not in {p["file"] for p in kept}:
            stale.unlink()
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "stage": stage,
        "iteration": iteration,
        "schema": {"name": table.name, "version": table.version},
        "rows": sum(p["rows"] for p in kept),
        "parts": kept,
        "fingerprint": fp
        if len(kept) == 1
        else fingerprint(stage, "", {str(p["index"]): p["fingerprint"] for p in kept}),
        "inputs": inputs,
        "config_hash": config_hash,
        "package": {"rlpipe": package_versions("rlpipe")["rlpipe"], "git_sha": git_sha()},
        "engines": {**package_versions("torch", "polars", "pyarrow"), **(engines or {})},
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "ended_at": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(ended)),
        # Every round's, not the last one's: a round-scoped stage's time in an iteration (parts written by a version
        # that did not record theirs count 0).
        "wall_seconds": round(sum(p.get("wall_seconds", 0.0) for p in kept), 3),
        "extra": {**(previous or {}).get("extra", {}), **(extra or {})},
    }
    write_json_atomic(layout.manifest_path(stage, iteration), manifest)
    return _output(layout, stage, iteration, manifest, fp)


def part_files(layout: RunLayout, stage: str, iteration: int) -> list[Path]:
    manifest = read_manifest(layout, stage, iteration, verify=False)
    if manifest is None:
        return []
    return [layout.stage_dir(stage, iteration) / p["file"] for p in manifest["parts"]]


def stage_part(layout: RunLayout, stage: str, iteration: int, index: int | None = None) -> tuple[Path, str] | None:
    """Part `index` (None: the last) of a complete stage-iteration: its file and its fingerprint; None if there is no
    such part."""
    manifest = read_manifest(layout, stage, iteration, verify=False)
    parts = manifest["parts"] if manifest else []
    if index is None:
        part = max(parts, key=lambda p: p["index"], default=None)
    else:
        part = next((p for p in parts if p["index"] == index), None)
    return None if part is None else (layout.stage_dir(stage, iteration) / part["file"], part["fingerprint"])


def read_stage(layout: RunLayout, stage: str, iteration: int) -> pl.DataFrame:
    files = part_files(layout, stage, iteration)
    if not files:
        raise NotFound(f"stage {stage!r} iteration {iteration} of run {layout.run_id!r} is not complete")
    return pl.concat([pl.read_parquet(f) for f in files], how="diagonal_relaxed")
