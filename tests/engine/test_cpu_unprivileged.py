"""An ordinary (not root) user: a cache directory they cannot enter or write gives one CacheWarning and
plans in memory, and every `fusekit cache` command and `doctor` answers with one line. Root passes every
permission check, so these run only as another user: `.ci/run` runs this file a second time as
nobody (setpriv)."""

import os
import subprocess
import sys
import warnings

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                                reason="needs an unprivileged user (root passes permission checks); .ci/run runs it as one")


@pytest.fixture
def locked(tmp_path):
    """A directory this user cannot enter, and a read-only one."""
    no_entry, read_only = tmp_path / "no-entry", tmp_path / "read-only"
    no_entry.mkdir()
    read_only.mkdir()
    no_entry.chmod(0)
    read_only.chmod(0o555)
    yield no_entry, read_only
    no_entry.chmod(0o700)
    read_only.chmod(0o700)


@pytest.mark.parametrize("which", [0, 1])
def test_default_cache_falls_back_to_memory_with_one_warning(locked, monkeypatch, which, fresh_session):
    from fusekit.engine import cache as cache_mod
    from fusekit.errors import CacheWarning

    monkeypatch.setenv("FUSEKIT_CACHE_DIR", str(locked[which] / "cache"))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        c = cache_mod.default_cache()
    assert c.store is None
    assert [type(x.message) for x in w] == [CacheWarning] and "going on with plans in memory" in str(w[0].message)


@pytest.mark.parametrize("cmd", [["doctor"], ["cache", "ls"], ["cache", "verify"], ["cache", "verify", "--fix"], ["cache", "show", "0a"],
                                 ["cache", "export", "OUT"], ["cache", "import", "OUT"], ["cache", "clear", "--yes"]])
@pytest.mark.parametrize("which", [0, 1])
def test_cli_answers_in_one_line(locked, tmp_path, cmd, which):
    env = dict(os.environ, FUSEKIT_CACHE_DIR=str(locked[which] / "cache"))
    args = [str(tmp_path / "x.tar.gz") if a == "OUT" else a for a in cmd]
    r = subprocess.run([sys.executable, "-m", "fusekit", *args], capture_output=True, text=True, env=env, timeout=120)
    out = r.stdout + r.stderr
    assert "Traceback" not in out, out
    if cmd != ["doctor"] and r.returncode != 0:
        errors = [ln for ln in out.splitlines() if ln.startswith("Error: ")]
        assert len(errors) == 1, out
