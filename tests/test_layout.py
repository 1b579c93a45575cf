"""The source tree itself: no module shadows the standard library (Prefect puts a flow's folder on sys.path, and
spawned workers inherit it: `flows/inspect.py` once broke every reward worker of a deployed RL run)."""

import sys

from tests.conftest import ROOT


def test_no_module_or_package_is_named_like_a_standard_library_module():
    names = {p.stem for top in ("flows", "tasks", "schemas", "storage") for p in (ROOT / top).rglob("*.py")}
    names |= {p.name for top in ("flows", "tasks", "schemas", "storage") for p in (ROOT / top).rglob("*") if p.is_dir()}
    assert not (names & set(sys.stdlib_module_names)), sorted(names & set(sys.stdlib_module_names))


def test_no_stage_imports_the_analysis_package():
    """The analysis commands read what the stages write; a stage computes its own figures (tasks/algos/metrics.py),
    so that `tasks/analysis/` can change without changing what a run computes."""
    import re

    offenders = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "tasks" / "stages").glob("*.py"))
        if re.search(r"^\s*(from|import) tasks\.analysis", path.read_text(), re.M)
    ]
    assert offenders == []
