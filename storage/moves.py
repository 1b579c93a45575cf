"""Moving a run's files aside and sharing them with a fork: never a delete, never a copy. `rerun` and a reconfigured
`run` move what they make stale under `_superseded/{n}/` (move_aside); `rerun --fork` hard-links what stays valid
(link_tree): writers always replace files by rename, so a link is never written through."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from storage.stage_io import write_json_atomic


def move_aside(layout, stages: list[tuple[str, int]], paths: list[Path], note: dict) -> dict:
    """Move `paths` under `_superseded/{n}/` (same relative layout), never deleting, and log it in superseded.json."""

    history = json.loads(layout.superseded_log.read_text()) if layout.superseded_log.exists() else []
    target = layout.superseded_dir(len(history))
    moved = []
    for path in paths:
        rel = path.relative_to(layout.run_dir)
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target / rel)
        moved.append(str(rel))
    record = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        **note,
        "kept_in": str(target.relative_to(layout.run_dir)),
        "moved": moved,
        "stages": [[name, k] for name, k in stages],
    }
    write_json_atomic(layout.superseded_log, history + [record])
    return record


def link_tree(src: Path, dst: Path) -> int:
    """Hard-link every file of src under dst (a file, or a folder recursively); returns the file count."""
    if src.is_file():
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.link(src, dst)
        return 1
    count = 0
    for f in src.rglob("*"):
        if f.is_file():
            (dst / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            os.link(f, dst / f.relative_to(src))
            count += 1
    return count
