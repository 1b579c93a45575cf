"""The embedded Ray instance and the user's ~/.ray (issue 57 item 6): Ray 2.60 turns token authentication on for a
new local instance and keeps its token in ~/.ray/auth_token, after which the user's own `ray start` and clusters
on that machine demanded it. The embedded instance uses a token of its own, in its session folder, and leaves the
user's HOME as it was, whatever it holds."""

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

SCRIPT = """
import os
from tasks.engines import ray_cluster
ray_cluster.connect(None)
import ray
@ray.remote
def f():
    return os.environ["RAY_AUTH_MODE"], os.path.dirname(os.environ["RAY_AUTH_TOKEN_PATH"])
mode, folder = ray.get(f.remote())
print("RESULT", mode, folder == ray_cluster.temp_dir_for(os.getpid()))
ray_cluster.stop()
print("LEFT", os.path.exists(ray_cluster.temp_dir_for(os.getpid())))
"""


@pytest.mark.parametrize("home_token", [None, "a token of the user's own cluster"])
def test_the_embedded_instance_neither_reads_nor_writes_the_users_ray_folder(tmp_path, home_token):
    home = tmp_path / "home"
    home.mkdir()
    if home_token:
        (home / ".ray").mkdir()
        (home / ".ray" / "auth_token").write_text(home_token)
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(ROOT), "RAY_AUTH_TOKEN": "the user's"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "RESULT token True" in proc.stdout and "LEFT False" in proc.stdout  # auth on, its token gone with it
    if home_token:
        assert os.listdir(home / ".ray") == ["auth_token"] and (home / ".ray/auth_token").read_text() == home_token
    else:
        assert not (home / ".ray").exists()
