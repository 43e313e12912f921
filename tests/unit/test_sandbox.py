"""Sandbox command construction and mode selection."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from nbfleet.agent.sandbox import Sandbox, SandboxUnavailable, make_sandbox, unseen


def test_wrap_hides_then_binds_back_and_ignores_sigint() -> None:
    sandbox = Sandbox("/usr/bin/bwrap", ("/srv/agent", "/srv/home"))
    argv = sandbox.wrap(["python", "-m", "ipykernel_launcher"], ["/srv/agent/rt/ws_1"],
                        "/srv/agent/rt/ws_1/files")
    assert argv[:3] == ["/bin/sh", "-c", 'trap "" INT; exec "$@"']
    inner = argv[4:]
    assert inner[0] == "/usr/bin/bwrap"
    # Hidden directories are covered before the kernel's own directory is bound back.
    hide = inner.index("/srv/agent")
    bind = inner.index("--bind")
    assert inner[hide - 1] == "--tmpfs" and hide < bind
    assert inner[inner.index("--ro-bind") + 1 : inner.index("--ro-bind") + 3] == ["/", "/"]
    assert inner[-4:] == ["--", "python", "-m", "ipykernel_launcher"]
    assert "--die-with-parent" in inner


def test_modes() -> None:
    assert make_sandbox("none", ["/x"]) is None
    with pytest.raises(ValueError, match="sandbox must be one of"):
        make_sandbox("docker", [])


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_bwrap_mode_really_hides_paths(tmp_path) -> None:  # type: ignore[no-untyped-def]
    hidden, visible = tmp_path / "hidden", tmp_path / "hidden" / "mine"
    visible.mkdir(parents=True)
    (hidden / "secret").write_text("s")
    sandbox = make_sandbox("bwrap", [str(hidden)])
    assert sandbox is not None
    argv = sandbox.wrap(["/bin/sh", "-c", "ls -A ..; touch ok"], [str(visible)], str(visible))
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["mine"]  # the secret is not there
    assert (visible / "ok").exists()


def test_bwrap_mode_fails_clearly_without_bubblewrap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda _name: None)
    with pytest.raises(SandboxUnavailable, match="install the 'bubblewrap' package"):
        make_sandbox("bwrap", [])
    assert make_sandbox("auto", []) is None  # auto degrades, with a warning


def test_a_python_environment_under_a_hidden_path_stays_visible(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A checkout under /tmp (as in CI) keeps its venv inside the sandbox, read-only."""
    import nbfleet.agent.sandbox as sandbox_module

    monkeypatch.setattr(shutil, "which", lambda _name: "/usr/bin/bwrap")
    monkeypatch.setattr(sandbox_module, "_works", lambda _bwrap: True)
    monkeypatch.setattr(sandbox_module, "python_paths",
                        lambda: ["/tmp/clone/.venv", "/usr", "/srv/agent/venv"])
    sandbox = make_sandbox("auto", ["/srv/agent"])
    assert sandbox is not None
    assert sandbox.readonly == ("/tmp/clone/.venv", "/srv/agent/venv")
    argv = sandbox.wrap(["python"], [], "/w")
    ro = argv.index("/tmp/clone/.venv")
    assert argv[ro - 1] == "--ro-bind" and ro > argv.index("/srv/agent")  # after the tmpfs


def test_only_files_the_sandbox_would_hide_are_bound_back(tmp_path: Path) -> None:
    hidden = tmp_path / "state"
    venv = tmp_path / "venv"
    sandbox = Sandbox("/usr/bin/bwrap", (str(hidden),), (str(venv),))
    paths = ["/usr/bin/env", "/tmp/tool/gen", str(hidden / "bin" / "x"), str(venv / "python"),
             "/tmp/tool/gen"]
    assert unseen(sandbox, paths) == [os.path.realpath("/tmp/tool/gen"),
                                      os.path.realpath(hidden / "bin" / "x")]
