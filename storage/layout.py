"""The run layout: a pure path builder. Nothing outside `storage/` builds run paths.

{root}/{run_id}/config.yaml
{root}/{run_id}/{stage}/iter={k:05d}/part-{n:05d}.parquet
{root}/{run_id}/{stage}/iter={k:05d}/_manifest.json
{root}/{run_id}/checkpoints/iter={k:05d}/        (RL; checkpoints/sft/ for the SFT warm start)
{root}/{run_id}/checkpoints/iter={k:05d}/critic/ (PPO's value model)
{root}/{run_id}/summary.json
{root}/{run_id}/superseded.json, _superseded/{n:03d}/  (what `rlpipe rerun` moved aside)
{root}/{run_id}/forked_from.json                  (a run made by `rlpipe rerun --fork`)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from schemas.errors import UserError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")
_ITERATION = re.compile(r"iter=(\d{5})")
# A run's folders that are not tables: checkpoints share the iter= layout; logs and the report hold plain files.
NON_TABLE_FOLDERS = ("checkpoints", "logs", "report", "tensorboard", "mlartifacts")


class LayoutError(UserError, ValueError):
    pass


def check_name(kind: str, name: str) -> str:
    """Run ids and stage names become folder names: refuse anything that could leave the run folder."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:  # fullmatch: no trailing newline
        raise LayoutError(f"invalid {kind} {name!r}: use letters, digits, '_', '-', '.' (no '/' or '..')")
    return name


@dataclass(frozen=True)
class RunLayout:
    root: Path
    run_id: str

    def __post_init__(self):
        check_name("run id", self.run_id)
        object.__setattr__(self, "root", Path(self.root))

    @property
    def run_dir(self) -> Path:
        return self.root / self.run_id

    @property
    def config_path(self) -> Path:
        return self.run_dir / "config.yaml"

    @property
    def summary_path(self) -> Path:
        return self.run_dir / "summary.json"

    @property
    def scratch_dir(self) -> Path:
        """Worker processes exchange files here before a stage commits them."""
        return self.run_dir / "_scratch"

    def log_path(self, name: str) -> Path:
        return self.run_dir / "logs" / f"{check_name('log name', name)}.log"

    def stage_root(self, stage: str) -> Path:
        return self.run_dir / check_name("stage name", stage)

    def stage_dir(self, stage: str, iteration: int) -> Path:
        return self.stage_root(stage) / f"iter={iteration:05d}"

    def manifest_path(self, stage: str, iteration: int) -> Path:
        return self.stage_dir(stage, iteration) / "_manifest.json"

    def part_path(self, stage: str, iteration: int, part: int) -> Path:
        return self.stage_dir(stage, iteration) / f"part-{part:05d}.parquet"

    @property
    def checkpoints_root(self) -> Path:
        return self.run_dir / "checkpoints"

    def checkpoint_dir(self, iteration: int) -> Path:
        return self.checkpoints_root / f"iter={iteration:05d}"

    def checkpoint_iterations(self) -> list[int]:
        """Iterations with a committed checkpoint folder (`.tmp` folders of an interrupted update excluded)."""
        return sorted(
            int(p.name.split("=", 1)[1]) for p in self.checkpoints_root.glob("iter=*") if p.name[5:].isdigit()
        )

    def critic_dir(self, iteration: int) -> Path:
        return self.checkpoint_dir(iteration) / "critic"

    @property
    def tripwires_path(self) -> Path:
        """Each iteration's tripwire figures and the lines of those that fired (tasks/stages/tripwires.py)."""
        return self.run_dir / "tripwires.json"

    @property
    def tracking_state_path(self) -> Path:
        """What experiment tracking has logged, and its MLflow run (tasks/stages/tracking.py)."""
        return self.run_dir / "tracking.json"

    @property
    def tensorboard_dir(self) -> Path:
        return self.run_dir / "tensorboard"

    @property
    def mlflow_db_path(self) -> Path:
        """The run's own MLflow store (when no tracking URI is given), with its artifacts in `mlflow_artifacts_dir`."""
        return self.run_dir / "mlflow.db"

    @property
    def mlflow_artifacts_dir(self) -> Path:
        return self.run_dir / "mlartifacts"

    @property
    def superseded_log(self) -> Path:
        return self.run_dir / "superseded.json"

    def superseded_dir(self, n: int) -> Path:
        return self.run_dir / "_superseded" / f"{n:03d}"

    @property
    def forked_from_path(self) -> Path:
        return self.run_dir / "forked_from.json"

    @property
    def sft_checkpoint_dir(self) -> Path:
        return self.checkpoints_root / "sft"

    @property
    def lock_path(self) -> Path:
        return self.run_dir / "_lock"

    @property
    def report_dir(self) -> Path:
        """The report's plots; the page itself is `report_path`."""
        return self.run_dir / "report"

    @property
    def report_path(self) -> Path:
        return self.run_dir / "report.html"

    @property
    def verified_cache_path(self) -> Path:
        """Size, mtime and sha256 of each part already checked against its manifest (storage.verified_parts)."""
        return self.run_dir / "_verified.json"

    def stages(self) -> list[str]:
        """Stage folders of the run: a valid stage name holding at least one iteration folder (checkpoints share the
        iter= layout but are not a table; folders starting with `_` are rlpipe's own)."""
        if not self.run_dir.is_dir():
            return []
        return sorted(
            p.name
            for p in self.run_dir.iterdir()
            if p.is_dir()
            and p.name not in NON_TABLE_FOLDERS
            and not p.name.startswith("_")
            and _NAME.fullmatch(p.name)
            and any(_ITERATION.fullmatch(q.name) for q in p.iterdir())
        )

    def iterations(self, stage: str) -> list[int]:
        """Iteration folders (`iter=` and five digits) of a stage; anything else in it is not the run's data."""
        root = self.stage_root(stage)
        return sorted(int(m.group(1)) for p in root.glob("iter=*") if (m := _ITERATION.fullmatch(p.name)))

    def strays(self) -> list[Path]:
        """Folders inside the run that are not rlpipe's (a copied `iter=00001.bak`, a folder named with a space):
        inspection ignores them, with a warning."""
        if not self.run_dir.is_dir():
            return []
        out = []
        for p in sorted(self.run_dir.iterdir()):
            if not p.is_dir() or p.name.startswith("_") or p.name in NON_TABLE_FOLDERS:
                continue
            if not _NAME.fullmatch(p.name):
                out.append(p)
                continue
            out += [q for q in sorted(p.iterdir()) if q.name.startswith("iter=") and not _ITERATION.fullmatch(q.name)]
        return out
