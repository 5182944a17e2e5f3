"""An install from pyproject.toml alone gives a working server (issue 35): the package is built
and installed into a fresh venv (as `pip install kvconnect` would, no Makefile, no extra, no
editable path), its `kvconnect serve` answers a structured-output request; without xgrammar
(a broken or partial install) the same request is a 400 that names it, never a 500. uv does
the install (a dev dependency, as in the Makefile), with pip's find-links passed on as the
Makefile passes them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.serving import Serve, post

# heavy: it runs in `make test-vllm` (part of CI), where it does not hold `make test`'s
# other workers idle for its 15 s.
pytestmark = [pytest.mark.slow, pytest.mark.alone, pytest.mark.heavy, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parent.parent
UV = Path(sys.executable).with_name("uv")


def uv_env() -> dict[str, str]:
    """This environment, with pip's find-links (where the machine keeps the CPU torch wheel)
    given to uv, which reads no pip configuration."""
    links = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.find-links"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return {**os.environ, "UV_FIND_LINKS": links} if links else dict(os.environ)


def uv(*args: str) -> None:
    done = subprocess.run([str(UV), *args], env=uv_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]


def structured_request(url: str) -> tuple[int, dict[str, object]]:
    status, body, _ = post(
        url + "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "yes or no?"}],
            "max_tokens": 16,
            "temperature": 0,
            "structured_outputs": {"choice": ["yes", "no"]},
        },
    )
    return status, body


def source_copy(dest: Path) -> Path:
    """The checkout's files that a build reads, copied: setuptools builds in the source tree
    (build/, *.egg-info), and its build/lib keeps modules that were since moved or deleted,
    which the wheel would then ship."""
    junk = shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__")
    return Path(shutil.copytree(ROOT, dest, ignore=junk))


def test_a_fresh_install_from_pyproject_serves_structured_output(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    uv("venv", "--quiet", "--python", sys.executable, str(venv))
    python = str(venv / "bin" / "python")
    uv("pip", "install", "--quiet", "--python", python, str(source_copy(tmp_path / "src")))
    where = subprocess.run(  # from another directory: the installed copy, not this checkout
        [python, "-c", "import kvconnect; print(kvconnect.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    ).stdout
    assert where.startswith(str(venv)), where

    server = Serve(tmp_path)
    server.launcher = [str(venv / "bin" / "kvconnect")]
    server.start()
    try:
        status, body = structured_request(server.url)
        assert status == 200, body
        assert body["choices"][0]["message"]["content"] in ("yes", "no"), body  # type: ignore[index]
    finally:
        assert server.stop() == 0, server.logs()

    uv("pip", "uninstall", "--quiet", "--python", python, "xgrammar")
    server.start()
    try:
        status, body = structured_request(server.url)
        assert status == 400, body
        error = body["error"]
        assert error["param"] == "structured_outputs.choice", error  # type: ignore[index]
        assert "xgrammar" in error["message"], error  # type: ignore[index]
    finally:
        assert server.stop() == 0, server.logs()
