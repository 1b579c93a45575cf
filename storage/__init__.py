"""Run storage: the path layout and the stage contract (atomic parts, manifests, fingerprints)."""

from storage.layout import LayoutError, RunLayout, check_name
from storage.stage_io import (
    DamagedDataError,
    DiskFullError,
    StageOutput,
    commit_dir,
    complete_files,
    find_complete,
    fingerprint,
    package_versions,
    read_manifest,
    read_stage,
    scan,
    temp_dir_for,
    verified_parts,
    write_json_atomic,
    write_stage,
    written,
)

__all__ = [
    "DamagedDataError",
    "DiskFullError",
    "LayoutError",
    "RunLayout",
    "StageOutput",
    "check_name",
    "commit_dir",
    "complete_files",
    "find_complete",
    "fingerprint",
    "package_versions",
    "read_manifest",
    "read_stage",
    "scan",
    "temp_dir_for",
    "verified_parts",
    "write_json_atomic",
    "write_stage",
    "written",
]
