"""The API reference (docs/api/*.md) documents every public name, so a new one cannot be left out.

The pages name each object in an autodoc directive; this reads those names, imports what they
point at and checks that every name in the ``__all__`` of each public module is among them (a
re-export counts when the same object is documented under its other path, as
``sharded.fsdp.fully_shard`` is under ``sharded.fully_shard``), and that no directive names
something that does not exist. Sphinx's build (``make docs``) renders them; this runs in
``make test`` without Sphinx.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
PUBLIC_MODULES = ["sharded", "sharded.fsdp", "sharded.fsdp.wrap", "sharded.checkpoint", "sharded.invariant",
                  "sharded.lightning", "sharded.lightning.fabric", "sharded.lightning.fabric_fsdp"]
DIRECTIVE = re.compile(r"^\.\. auto(module|class|function|exception|data|method|attribute):: (\S+)", re.MULTILINE)


def _resolve(dotted: str) -> Any:
    """The object a dotted path names: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            target: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            target = getattr(target, name)
        return target
    raise ImportError(dotted)


def documented() -> dict[str, str]:
    """Every autodoc target of the API pages, by its dotted path: the directive kind."""
    found = {}
    for page in sorted((ROOT / "docs" / "api").glob("*.md")):
        for kind, target in DIRECTIVE.findall(page.read_text()):
            found[target] = kind
    return found


def test_every_documented_target_exists():
    missing = []
    for target in documented():
        try:
            _resolve(target)
        except (ImportError, AttributeError):
            missing.append(target)
    assert not missing, f"the API pages document names that do not exist: {missing}"


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_public_name_is_in_the_api_reference(module_name):
    pytest.importorskip("lightning") if module_name.startswith("sharded.lightning") else None
    module = importlib.import_module(module_name)
    targets = documented()
    objects = [_resolve(t) for t in targets]
    undocumented = []
    for name in module.__all__:
        value = getattr(module, name)
        if inspect.ismodule(value) and hasattr(value, name):
            value = getattr(value, name)  # sharded.plan: the function, once its module is imported
        if f"{module_name}.{name}" in targets:
            continue
        if not isinstance(value, str) and any(value is obj for obj in objects):
            continue
        undocumented.append(f"{module_name}.{name}")
    assert not undocumented, f"public names missing from docs/api/*.md: {undocumented}"
