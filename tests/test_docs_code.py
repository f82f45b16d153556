"""Every Python example in the README and the docs site runs, at world 1 and 2 on gloo.

A ```python block must be preceded by a marker comment, invisible on GitHub and on the site:

    <!-- doc-test: world 1, 2                  run it on 1 rank and on 2 ranks
    setup:                                     (optional) code run first, in the same namespace
        from tests._docs_setup import *
    check:                                     (optional) code run after it: its asserts
        assert len(set(losses.values())) == 1
    compare: micro_batches.mean(losses)        (optional) must be equal at every world size
    -->

or ``<!-- doc-test: not run (why: a CUDA launch, needs Lightning on 8 GPUs...) -->``. An
unmarked block fails the suite, so a new example cannot go untested by accident. All marked
blocks of a world size run in one launch, each in a fresh namespace and a fresh working folder;
the example's own ``init_process_group`` and ``destroy_process_group`` calls are taken by the
harness's group (a script written for torchrun runs as it is). A failure names the file and
line of the block.
"""

from __future__ import annotations

import os
import re
import textwrap
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests._harness import run_on_ranks

ROOT = Path(__file__).resolve().parent.parent
MARKER = "<!-- doc-test:"


@dataclass(frozen=True)
class DocBlock:
    """One fenced code block of a Markdown file and the doc-test marker above it."""

    where: str
    language: str
    code: str
    marker: str = ""
    sections: dict[str, str] = field(default_factory=dict)

    @property
    def worlds(self) -> tuple[int, ...]:
        match = re.fullmatch(r"world ([0-9, ]+)", self.marker)
        return tuple(int(w) for w in match.group(1).split(",")) if match else ()


def doc_files() -> list[Path]:
    """README.md and every Markdown page of the docs site (the built site left out)."""
    pages = sorted(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)
    return [ROOT / "README.md", *pages]


def parse_blocks(path: Path) -> list[DocBlock]:
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = re.match(r"^(`{3,})(\S*)", lines[i])
        if not opening:
            i += 1
            continue
        fence, language = opening.groups()
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith(fence))
        marker, sections = _marker_above(lines, i)
        where = f"{path.relative_to(ROOT)}:{i + 1}"
        found.append(DocBlock(where, language, "\n".join(lines[i + 1:end]) + "\n", marker, sections))
        i = end + 1
    return found


def _marker_above(lines: list[str], fence_line: int) -> tuple[str, dict[str, str]]:
    """The marker's first line after ``doc-test:`` and its indented sections, if one ends just above."""
    end = fence_line - 1
    if end < 0 or not lines[end].rstrip().endswith("-->"):
        return "", {}
    start = next((k for k in range(end, -1, -1) if lines[k].startswith(MARKER)), None)
    if start is None:
        return "", {}
    body = [*lines[start:end], lines[end].rstrip()[:-3]] if start != end else [lines[end].rstrip()[:-3]]
    head = body[0][len(MARKER):].strip()
    sections: dict[str, list[str]] = {}
    current = None
    for line in body[1:]:
        named = re.match(r"^(setup|check|compare):\s*(.*)$", line)
        if named:
            current = named.group(1)
            sections[current] = [named.group(2)] if named.group(2) else []
        elif current is not None and line.strip():
            sections[current].append(line)
    return head, {k: textwrap.dedent("\n".join(v)).strip() + "\n" for k, v in sections.items()}


ALL_BLOCKS = [b for path in doc_files() for b in parse_blocks(path)]
PYTHON_BLOCKS = [b for b in ALL_BLOCKS if b.language == "python"]


def test_every_python_example_is_marked_run_or_not_run_with_a_reason():
    unmarked = [b.where for b in PYTHON_BLOCKS if not b.worlds and not re.fullmatch(r"not run \(.+\)", b.marker)]
    assert not unmarked, f"python blocks without '{MARKER} world 1, 2 -->' or '... not run (why) -->': {unmarked}"
    markers = sum(path.read_text().count(MARKER) for path in doc_files())
    attached = sum(1 for b in ALL_BLOCKS if b.marker)
    assert markers == attached, "a doc-test marker is not directly above a code block"
    assert sum(1 for b in PYTHON_BLOCKS if b.worlds) >= 6, "the examples that run went missing"


def _run_blocks(rank: int, world_size: int, blocks: list[tuple[str, str, str, str, str]], folder: str) -> list[Any]:
    """Each block in its own namespace and folder; what its ``compare`` expression gives."""
    init, destroy = dist.init_process_group, dist.destroy_process_group
    dist.init_process_group = lambda *args, **kwargs: None  # type: ignore[assignment]
    dist.destroy_process_group = lambda *args, **kwargs: None  # type: ignore[assignment]
    here = os.getcwd()
    compared = []
    try:
        for index, (where, setup, code, check, compare) in enumerate(blocks):
            os.chdir(os.path.join(folder, str(index)))
            namespace: dict[str, Any] = {"__name__": "__main__"}
            try:
                for part, text in (("setup", setup), ("block", code), ("check", check)):
                    exec(compile(text, f"{where} ({part})", "exec"), namespace)
                value = eval(compare, namespace) if compare else None
            except Exception as error:
                raise AssertionError(f"the example at {where} failed on rank {rank} of {world_size}:\n"
                                     f"{traceback.format_exc()}") from error
            compared.append(value.tolist() if isinstance(value, torch.Tensor) else value)
            dist.barrier()
    finally:
        dist.init_process_group, dist.destroy_process_group = init, destroy
        os.chdir(here)
    return compared


def test_python_examples_run_at_world_1_and_2(tmp_path):
    results = {}
    for world in (1, 2):
        runnable = [b for b in PYTHON_BLOCKS if world in b.worlds]
        for index in range(len(runnable)):
            (tmp_path / str(world) / str(index)).mkdir(parents=True)
        jobs = [(b.where, b.sections.get("setup", ""), b.code, b.sections.get("check", ""),
                 b.sections.get("compare", "").strip()) for b in runnable]
        per_rank = run_on_ranks(_run_blocks, world, jobs, str(tmp_path / str(world)), timeout=240)
        results[world] = dict(zip((b.where for b in runnable), per_rank[0]))
    for block in PYTHON_BLOCKS:
        if "compare" in block.sections:
            values = {world: results[world][block.where] for world in block.worlds}
            assert len({repr(v) for v in values.values()}) == 1, f"{block.where}: differs across world sizes: {values}"


@pytest.mark.parametrize("block", [b for b in PYTHON_BLOCKS if b.worlds], ids=lambda b: b.where)
def test_runnable_examples_compile(block):
    """A syntax error shows here at once, named, before any launch."""
    for text in (block.sections.get("setup", ""), block.code, block.sections.get("check", "")):
        compile(text, block.where, "exec")


def test_readme_links_point_at_files_that_exist():
    """README.md is read on GitHub, outside the site's own link check (make docs)."""
    readme = ROOT / "README.md"
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme.read_text())
    local = [link for link in links if "://" not in link]
    assert local, "README.md links into the docs"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README.md links to missing files: {missing}"
