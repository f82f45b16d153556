"""The package's shape: layers import downward only, no import cycles, and ``import sharded`` stays light.

Read from the source (every ``import`` statement, also those inside functions and under
``TYPE_CHECKING``), so a cycle or an upward import fails here before it confuses a reader.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "sharded"

# Each part of the package and the parts below it that it may import. A part may import itself.
BELOW = {
    "_common": set(),
    "_owners": {"_common"},
    "oss": {"_common", "_owners"},
    "zero_redundancy_optimizer": {"_common", "_owners", "oss"},
    "ddp_zero_hook": {"_common", "_owners", "oss"},
    "sharded_ddp": {"_common", "_owners", "oss"},
    "grad_scaler": {"_common"},
    "fsdp": {"_common"},
    "_memory": {"_common", "_owners", "fsdp"},
    "plan": {"_memory"},
    "checkpoint": {"_common", "_owners", "oss", "sharded_ddp", "fsdp"},
    "invariant": {"_common", "oss", "sharded_ddp", "fsdp"},
    "lightning": {"_common", "_owners", "oss", "sharded_ddp", "grad_scaler", "fsdp", "checkpoint"},
}

# What only the layer that uses it may import, when it is used.
HEAVY = ("torch._dynamo", "torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.checkpoint", "lightning")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    base = PACKAGE.parent.joinpath(*name.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def _imports(path: Path) -> set[str]:
    """The modules of the package that ``path`` imports (a name imported from a package counts
    as the submodule of that name where there is one)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("sharded"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("sharded"):
                source = node.module
            else:
                continue
            for alias in node.names:
                found.add(f"{source}.{alias.name}" if _is_module(f"{source}.{alias.name}") else source)
    return found - {name}


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py")}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "sharded"


def test_layers_import_downward_only():
    upward = [
        f"{module} imports {target}"
        for module, targets in _graph().items()
        if _part(module) != "sharded"  # the package's __init__ re-exports every layer
        for target in targets
        if _part(target) != _part(module) and _part(target) not in BELOW[_part(module)]
    ]
    assert not upward, "imports running up a layer:\n" + "\n".join(sorted(upward))


def test_every_part_is_placed():
    """A new top-level module or package gets its place in ``BELOW`` (and in the code layout, docs/guides/layout.md)."""
    parts = {_part(m) for m in _graph()} - {"sharded"}
    assert parts == set(BELOW), f"not placed: {sorted(parts - set(BELOW))}; gone: {sorted(set(BELOW) - parts)}"


def test_no_import_cycles():
    graph = _graph()
    cycles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_import_sharded_is_light():
    """``import sharded`` loads none of Dynamo, DTensor, torch's FSDP or DCP; layer 3 loads on use."""
    script = (
        "import sys, sharded\n"
        f"print(sorted(m for m in sys.modules if m.startswith({HEAVY!r})))\n"
        "sharded.fully_shard\n"
        "print('torch.distributed.tensor' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "[]", f"import sharded loaded {out[0]}"
    assert out[1] == "True", "sharded.fully_shard did not load layer 3"
