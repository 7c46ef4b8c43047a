"""Check the built documentation site: served on loopback, over HTTP and in headless Chromium.

Run after ``mkdocs build --strict`` (which writes ``site/``):

    python docs/check_site.py                    # HTTP checks, and the browser checks where possible
    python docs/check_site.py --require-browser  # fail, rather than skip, without a browser
    python docs/check_site.py --screenshots DIR  # also save a screenshot of each page

Serves ``site/`` on 127.0.0.1 (a free port) and checks the pages a newcomer reads first (home,
getting started, concepts, the loss-paths guide), the API reference and the gallery:

- over HTTP (standard library only): each page answers, has its ``<h1>`` (and the API page
  its ``jaxtrace.grad`` entry), every ``<img>`` it shows resolves to an image, and the search
  index ``search/search_index.json`` has the ``jaxtrace.grad`` entry;
- in headless Chromium, driven by playwright (``pip install playwright``; the browser is the
  system's: Debian's ``chromium`` package, ``apt-get install chromium``, or ``$CHROMIUM``; no
  browser download): each page renders its headings, every picture has loaded (non-zero
  natural size), no code block on the first pages is wider than its box (a line cut off
  behind a scroll bar), at a desktop and a phone width, and typing a public name in the search
  box lists its API entry first.

Without playwright or a Chromium binary the browser checks are skipped with a message (an
error with ``--require-browser``). Exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import functools
import html.parser
import http.server
import json
import os
import pathlib
import shutil
import sys
import threading
import urllib.error
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]

# page -> (its <h1>, further headings that must render)
PAGES = {
    "": ("jaxtrace", ["How it compares"]),
    "api/core/": ("Tags and transforms", ["jaxtrace.tag", "jaxtrace.grad", "jaxtrace.patch_grad"]),
    "gallery/": ("Gallery", ["Grad-CAM for every class", "Attribution patching"]),
}
PAGES.update({
    "getting-started/": ("Getting started", ["Install", "The first example"]),
    "concepts/": ("Concepts", []),
    "guides/loss-paths/": ("Which loss reaches which layer", []),
})
MIN_IMAGES = {"gallery/": 6}
SEARCH_QUERY, SEARCH_HIT = "grad", "jaxtrace.grad"
# The pages a newcomer reads first: no code line on them may be cut off (wider than its box).
WHOLE_CODE = ["", "getting-started/", "concepts/", "guides/loss-paths/"]
WIDTHS = (1280, 390)  # a desktop and a phone
# query -> the API entry that must be the first result (a page of the API reference)
# (the API pages' search boost, docs/api/*.md front matter, and mkdocs.yml's search separator)
SEARCH_FIRST = {
    "grad": "jaxtrace.grad",
    "jaxtrace.grad": "jaxtrace.grad",
    "summarize": "jaxtrace.stats.summarize",
    "tag_modules": "jaxtrace.tag_modules",
}


class _Page(html.parser.HTMLParser):
    """The headings and image sources of a page."""

    def __init__(self):
        super().__init__()
        self.headings: list[tuple[str, str]] = []  # (tag, text)
        self.images: list[str] = []
        self._in: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag in ("h1", "h2", "h3"):
            self._in, self._text = tag, []
        elif tag == "img":
            self.images.append(dict(attrs).get("src", ""))

    def handle_data(self, data):
        if self._in:
            self._text.append(data)

    def handle_endtag(self, tag):
        if tag == self._in:
            self.headings.append((tag, "".join(self._text).replace("¶", "").strip()))
            self._in = None


def serve(site: pathlib.Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass


def fetch(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.headers.get("Content-Type", ""), response.read()
    except urllib.error.HTTPError as error:  # a 404 is a finding, not a crash
        return error.code, error.headers.get("Content-Type", ""), b""


def check_http(base: str, failures: list[str]) -> None:
    for path, (title, headings) in PAGES.items():
        status, _, body = fetch(base + path)
        if status != 200:
            failures.append(f"HTTP /{path}: status {status}")
            continue
        page = _Page()
        page.feed(body.decode())
        texts = [text for _, text in page.headings]
        h1 = [text for tag, text in page.headings if tag == "h1"]
        if status != 200 or h1[:1] != [title]:
            failures.append(f"HTTP /{path}: status {status}, <h1> {h1}, expected {title!r}")
        for heading in headings:
            if heading not in texts:
                failures.append(f"HTTP /{path}: no heading {heading!r} among {texts[:12]}")
        shown = [src for src in page.images if not src.startswith("data:")]
        if len(shown) < MIN_IMAGES.get(path, 0):
            failures.append(f"HTTP /{path}: {len(shown)} pictures, expected at least {MIN_IMAGES[path]}")
        for src in shown:
            url = urllib.request.urljoin(base + path, src)
            status, kind, data = fetch(url)
            if status != 200 or not kind.startswith("image/") or not data:
                failures.append(f"HTTP /{path}: picture {src} -> {status} {kind}, {len(data)} bytes")
        print(f"HTTP  /{path:10} <h1> {h1[:1]}, {len(texts)} headings, {len(shown)} pictures resolve")
    status, _, body = fetch(base + "search/search_index.json")
    docs = json.loads(body)["docs"] if status == 200 else []
    hits = [d["location"] for d in docs if SEARCH_HIT in d["title"]]
    if not any(location.endswith("#" + SEARCH_HIT) for location in hits):
        failures.append(f"search index: no entry titled {SEARCH_HIT!r} (found {hits})")
    print(f"HTTP  search index: {len(docs)} entries; {SEARCH_HIT!r} at {hits[:3]}")


def find_chromium() -> str | None:
    for candidate in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "google-chrome", "chrome"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    return None


def check_browser(base: str, failures: list[str], require: bool, screenshots: pathlib.Path | None) -> None:
    chromium = find_chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    if chromium is None or sync_playwright is None:
        missing = "playwright (pip install playwright)" if sync_playwright is None else "a Chromium binary"
        message = f"browser checks need {missing}; apt-get install chromium gives the browser"
        if require:
            failures.append(message)
        else:
            print("SKIP  " + message)
        return
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        print(f"browser: {chromium} (Chromium {browser.version}), headless")
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        for path, (title, headings) in PAGES.items():
            page.goto(base + path, wait_until="load")
            h1 = page.locator("article h1").first
            if not h1.is_visible() or h1.inner_text().replace("¶", "").strip() != title:
                failures.append(f"browser /{path}: <h1> not shown as {title!r}")
            for heading in headings:
                if not page.locator("article :is(h1, h2, h3)", has_text=heading).first.is_visible():
                    failures.append(f"browser /{path}: heading {heading!r} not shown")
            images = page.eval_on_selector_all(
                "article img", "els => els.map(e => [e.getAttribute('src'), e.complete, e.naturalWidth])"
            )
            broken = [src for src, complete, width in images if not (complete and width > 0)]
            if broken or len(images) < MIN_IMAGES.get(path, 0):
                failures.append(f"browser /{path}: {len(images)} pictures, not drawn: {broken}")
            if screenshots:
                screenshots.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(screenshots / f"{path.strip('/').replace('/', '_') or 'home'}.png"))
            print(f"browser /{path:10} <h1> {title!r} and {len(headings)} headings shown, {len(images)} pictures drawn")
        check_code_fits(browser, base, failures)
        # the search box (in the header at this width): type, wait for the result list (a web
        # worker builds the index from search/search_index.json)
        results = page.locator(".md-search-result__item")
        for query, hit in SEARCH_FIRST.items():
            page.goto(base, wait_until="load")
            try:
                box = page.locator("input[data-md-component=search-query]")
                box.click(timeout=10_000)
                box.press_sequentially(query, delay=100)  # key events, as a person types
                results.filter(has_text=hit).first.wait_for(state="visible", timeout=20_000)
                found = results.filter(has_text=hit).count()
                # the first result is a page with its matching sections: the entry's page, with the entry
                links = results.first.locator("a").evaluate_all("els => els.map(e => e.getAttribute('href'))")
                print(f"browser search {query!r}: {results.count()} results, {found} with {hit!r}; first: {links[:2]}")
                if not any("/api/" in link and link.endswith("#" + hit) for link in links):
                    failures.append(f"browser search {query!r}: the first result {links[:2]} is not the API entry {hit!r}")
            except Exception as error:  # playwright's TimeoutError
                failures.append(f"browser search {query!r}: no result with {hit!r} ({error.__class__.__name__})")
            if screenshots:
                page.screenshot(path=str(screenshots / f"search-{query}.png"))
        if errors:
            failures.append(f"browser: JavaScript errors: {errors}")
        browser.close()


def check_code_fits(browser, base: str, failures: list[str]) -> None:
    """No code block on the first pages is wider than its box: every line is shown whole."""
    for width in WIDTHS:
        page = browser.new_page(viewport={"width": width, "height": 900})
        for path in WHOLE_CODE:
            page.goto(base + path, wait_until="load")
            blocks = page.eval_on_selector_all(
                "article pre > code",
                "els => els.map(e => [e.scrollWidth, e.clientWidth, e.innerText.split('\\n')"
                ".reduce((a, b) => (a.length >= b.length ? a : b), '')])",
            )
            clipped = [(sw, cw, line) for sw, cw, line in blocks if sw > cw + 1]
            for sw, cw, line in clipped:
                failures.append(f"browser /{path} at {width} px: a code block {sw} px wide in a {cw} px box: {line[:80]!r}")
            print(f"browser /{path:18} at {width:4} px: {len(blocks)} code blocks, {len(clipped)} wider than their box")
        page.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", default=str(ROOT / "site"), help="the built site (default: site/)")
    parser.add_argument("--require-browser", action="store_true", help="fail when no browser can run")
    parser.add_argument("--screenshots", type=pathlib.Path, help="save a screenshot of each page here")
    args = parser.parse_args()
    site = pathlib.Path(args.site)
    if not (site / "index.html").exists():
        print(f"no built site at {site}: run `mkdocs build --strict` first", file=sys.stderr)
        return 2
    server, base = serve(site)
    failures: list[str] = []
    try:
        check_http(base, failures)
        check_browser(base, failures, args.require_browser, args.screenshots)
    finally:
        server.shutdown()
    for failure in failures:
        print("FAIL  " + failure)
    print("site check: " + ("FAILED" if failures else "passed"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
