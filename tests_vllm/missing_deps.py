"""Installs into this interpreter's environment, with pip --no-deps, kvconnect's own
dependencies (pyproject.toml's [project] dependencies whose markers hold here) that no
installed distribution satisfies; `--list` only prints them, one per line.

    python missing_deps.py [--list] pyproject.toml

The interop environments install vLLM's exact closure without the resolver and kvconnect
with --no-deps, so nothing else would bring in what kvconnect adds beyond vLLM's closure;
--no-deps here too, so that closure is never touched. A dependency vLLM's closure pins at a
version kvconnect does not accept is an error naming both.
"""

import subprocess
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, version

from packaging.requirements import Requirement


def missing(pyproject: str) -> list[str]:
    with open(pyproject, "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    out = []
    for line in deps:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            have = version(req.name)
        except PackageNotFoundError:
            extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
            out.append(f"{req.name}{extras}{req.specifier}")
            continue
        if not req.specifier.contains(have, prereleases=True):
            sys.exit(f"{req.name} {have} is installed (vLLM's closure) but kvconnect needs {req}")
    return out


if __name__ == "__main__":
    wanted = missing(sys.argv[-1])
    if "--list" in sys.argv[1:-1]:
        print("\n".join(wanted))
    elif wanted:
        print(f"# installing into {sys.prefix}: {' '.join(wanted)}")
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps"]
        sys.exit(subprocess.call([*pip, *wanted]))
