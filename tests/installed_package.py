"""The package as a user installs it: run by ``make package-check`` inside a fresh venv.

``make package-check`` builds an sdist and a wheel, installs the wheel with torch alone into a new
venv, and runs this file there from outside the source tree. It checks what a user relies on and
what a packaging mistake breaks silently: ``sharded`` comes from the venv, not the checkout; the
three layers, the checkpoint engine and the invariant mode import; the venv holds nothing beyond
torch and what torch itself requires; the wheel ships ``py.typed`` and no tests, examples or
benchmarks; the sdist carries the license, the changelog and the build configuration.
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

BUILD_TOOLS = {"pip", "setuptools", "wheel"}


def _requirement_names(dist: str) -> set[str]:
    """Names ``dist`` requires unconditionally or for this platform (extras left out)."""
    names = set()
    for requirement in metadata.requires(dist) or []:
        name, _, marker = requirement.partition(";")
        if "extra" in marker:
            continue
        names.add(_canonical(re.split(r"[ <>=!~\[(]", name.strip(), maxsplit=1)[0]))
    return names


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(root: str, installed: set[str]) -> set[str]:
    seen, todo = set(), [_canonical(root)]
    while todo:
        name = todo.pop()
        if name in seen or name not in installed:
            continue
        seen.add(name)
        todo.extend(_requirement_names(name))
    return seen


def check_installed_tree() -> None:
    import sharded

    site = Path(sys.prefix).resolve()
    where = Path(sharded.__file__).resolve()
    assert site in where.parents, f"sharded was imported from {where}, not from the venv {site}"
    assert sharded.__version__ == metadata.version("sharded"), "sharded.__version__ differs from the metadata"
    sharded.OSS, sharded.ShardedDataParallel, sharded.ShardedGradScaler
    sharded.fully_shard, sharded.FullyShardedDataParallel, sharded.estimate_memory, sharded.plan
    from sharded import checkpoint, fsdp, invariant

    checkpoint.save, fsdp.Owned, invariant.MicroBatches
    assert (where.parent / "py.typed").exists(), "the wheel does not ship py.typed"
    assert _requirement_names("sharded") == {"torch"}, metadata.requires("sharded")
    installed = {_canonical(d.metadata["Name"]) for d in metadata.distributions()}
    extra = installed - _closure("torch", installed) - BUILD_TOOLS - {"sharded"}
    assert not extra, f"the venv holds more than torch and its requirements: {sorted(extra)}"
    subprocess.run([sys.executable, "-m", "sharded.plan", "--help"], check=True, capture_output=True)


def check_artifacts(dist_dir: Path) -> None:
    (wheel,) = dist_dir.glob("sharded-*.whl")
    (sdist,) = dist_dir.glob("sharded-*.tar.gz")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"sharded"}, f"the wheel ships {sorted(tops)}"
    names = {name.split("/", 1)[1] for name in tarfile.open(sdist).getnames() if "/" in name}
    missing = {"LICENSE", "CHANGELOG.md", "README.md", "pyproject.toml", "setup.cfg", "setup.py"} - names
    assert not missing, f"the sdist lacks {sorted(missing)}"


if __name__ == "__main__":
    check_installed_tree()
    check_artifacts(Path(sys.argv[1]))
    print(f"installed wheel OK: sharded {metadata.version('sharded')} with torch {metadata.version('torch')} only")
