"""The temporary Prefect API's database for local commands (flows/local_prefect.py): each command gets its own copy
of a migrated database, removed when it ends; a user's database URL is kept; a parent command's copy is not shared."""

import os
import subprocess
import sys
from pathlib import Path

from flows.local_prefect import DATABASE_OWNER, DATABASE_URL

ROOT = Path(__file__).resolve().parents[1]
PRINT_URL = "import os, flows.cli; print(os.environ['PREFECT_SERVER_DATABASE_CONNECTION_URL'])"


def command_database(env: dict) -> str:
    base = {k: v for k, v in os.environ.items() if k not in (DATABASE_URL, DATABASE_OWNER, "PREFECT_API_URL")}
    out = subprocess.run(
        [sys.executable, "-c", PRINT_URL],
        env={**base, "PYTHONPATH": str(ROOT), **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_each_command_gets_its_own_migrated_copy_removed_at_exit():
    first, second = command_database({}), command_database({})
    assert first != second and first.startswith("sqlite+aiosqlite:///")
    for url in (first, second):
        assert not Path(url.removeprefix("sqlite+aiosqlite:///")).exists()  # removed when the command ended


def test_a_parent_commands_copy_is_not_shared_and_a_users_database_is_kept(tmp_path):
    parents = f"sqlite+aiosqlite:///{tmp_path / 'parent.db'}"
    assert command_database({DATABASE_URL: parents, DATABASE_OWNER: "1"}) != parents
    users = f"sqlite+aiosqlite:///{tmp_path / 'mine.db'}"
    assert command_database({DATABASE_URL: users}) == users
