"""Checks of the built docs site: its internal links, and its pages in a real browser.

``python docs/check_site.py links docs/_build/html`` (in ``make docs``) follows every relative
``href`` and ``src`` of every built page: the file must exist and a ``#fragment`` must be an
``id`` on the target page. Sphinx warns about a broken cross-reference it knows of; this catches
the ones it does not check (raw HTML, anchors inside generated pages, theme links).

``python docs/check_site.py browser docs/_build/html --screens DIR`` (``make docs-check``) opens
pages in headless Chromium, as a reader would, and fails unless each renders what it must: the
index, a guide and an API page with their text, the navigation sidebar linking every guide and
API page, and the search page finding a public name (search runs in the page's JavaScript, so
only a browser can check it). A screenshot of each page goes to DIR, to look at.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


class _Page(HTMLParser):
    """The ids a page defines and the relative links it makes."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if values.get("id"):
            self.ids.add(values["id"] or "")
        if tag == "a" and values.get("name"):
            self.ids.add(values["name"] or "")
        for key in ("href", "src"):
            target = values.get(key)
            if target and not urlsplit(target).scheme and not target.startswith("//"):
                self.links.append(target)


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def broken_links(site: Path) -> list[str]:
    """Every relative link of every page whose file or anchor is missing, as 'page: link'."""
    pages = {path.resolve(): _parse(path) for path in site.rglob("*.html")}
    broken = []
    for path, page in pages.items():
        for link in page.links:
            parts = urlsplit(link)
            target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{path.relative_to(site.resolve())}: {link} (no such file)")
            elif parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else _parse(target).ids
                if unquote(parts.fragment) not in ids:
                    broken.append(f"{path.relative_to(site.resolve())}: {link} (no such anchor)")
    return broken


def _browser() -> str:
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    raise SystemExit("no Chromium found: apt-get install chromium (Debian's package)")


def _chromium(browser: str, *args: str) -> str:
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               "--virtual-time-budget=5000", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return done.stdout


# page, the text it must show once rendered, what a screenshot is named
PAGES = [
    ("index.html", ["Train PyTorch models that do not fit in memory", "Quickstart"], "index"),
    ("guides/quickstart.html", ["Clipping under ZeRO-2", "fully_shard"], "guide-quickstart"),
    ("api/sharded.html", ['id="sharded.OSS"', "broadcast_fp16", 'id="sharded.fully_shard"'], "api-sharded"),
    ("api/plan-cli.html", ["--world-size", "--budget"], "api-plan-cli"),
]
SEARCH = ("search.html?q=MicroBatches", 'href="api/invariant.html#sharded.invariant.MicroBatches"')


def _sidebar_targets(site: Path, page: str, dom: str) -> set[str]:
    """The pages the rendered sidebar links to, as paths under ``site`` without ``.html``."""
    start = dom.find('class="sidebar-tree"')
    if start < 0:
        return set()
    sidebar = _Page()
    sidebar.feed(dom[start:dom.find("</aside>", start)] if "</aside>" in dom[start:] else dom[start:])
    here = (site / page).parent
    # the current page's entry links to itself as "#"
    resolved = {(here / (urlsplit(link).path or Path(page).name)).resolve() for link in sidebar.links}
    return {str(p.relative_to(site.resolve()).with_suffix("")) for p in resolved if p.is_relative_to(site.resolve())}


def browse(site: Path, screens: Path) -> list[str]:
    """What a reader would find wrong, page by page, in headless Chromium."""
    browser = _browser()
    screens.mkdir(parents=True, exist_ok=True)
    nav = sorted(str(p.relative_to(site).with_suffix("")) for p in [*site.glob("guides/*.html"), *site.glob("api/*.html")])
    problems = []
    for page, texts, name in PAGES:
        url = (site / page).resolve().as_uri()
        dom = _chromium(browser, "--dump-dom", url)
        problems += [f"{page}: does not show {text!r}" for text in texts if text not in dom]
        problems += [f"{page}: the navigation lacks {target}" for target in nav if target not in _sidebar_targets(site, page, dom)]
        shot = screens / f"{name}.png"
        _chromium(browser, "--window-size=1280,1000", f"--screenshot={shot}", url)
        # a rendered page compresses to far more than a blank one (a white 1280x1000 PNG: ~5 KB)
        if not shot.exists() or shot.stat().st_size < 30_000:
            problems.append(f"{page}: the screenshot {shot} is missing or blank")
    query, expected = SEARCH
    dom = _chromium(browser, "--dump-dom", (site / "search.html").resolve().as_uri() + query[len("search.html"):])
    if expected not in dom:
        problems.append(f"{query}: the search results lack {expected}")
    _chromium(browser, "--window-size=1280,1000", f"--screenshot={screens / 'search.png'}",
              (site / "search.html").resolve().as_uri() + query[len("search.html"):])
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("check", choices=["links", "browser"])
    parser.add_argument("site", type=Path, help="the built HTML, e.g. docs/_build/html")
    parser.add_argument("--screens", type=Path, default=Path("docs/_build/screens"))
    args = parser.parse_args(argv)
    if not (args.site / "index.html").exists():
        raise SystemExit(f"{args.site}/index.html does not exist: run make docs first")
    problems = broken_links(args.site) if args.check == "links" else browse(args.site, args.screens)
    for problem in problems:
        print(problem, file=sys.stderr)
    pages = len(list(args.site.rglob("*.html")))
    print(f"{args.check}: {len(problems)} problem(s) in {pages} pages" +
          (f"; screenshots in {args.screens}" if args.check == "browser" else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
