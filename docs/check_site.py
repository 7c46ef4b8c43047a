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
  natural size), and typing a public name in the search box lists its API entry first;
- on every page of the site, at a desktop width (1280 px) and a phone width (390 px), what
  docs/stylesheets/extra.css and docs/site_hooks.py promise: nothing is cut off (no element
  sticks out of the screen, or out of a box that clips it, unless that box scrolls sideways:
  a wide table or a long code line scrolls inside its own box); code keeps its indentation
  (on the phone lines never wrap, the block scrolls; on the desktop each wrapped line goes on
  to the right of its own first character, and no code block on the first pages is wider
  than its box); the copy button covers no code text and copies the text as written; every
  picture is a link to its own full-size file, and on the phone a picture is drawn at 80% of
  its pixel width or more (a heatmap's numbers stay readable).

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
# The pages a newcomer reads first: on a desktop no code line on them may be cut off (wider than
# its box): long lines wrap there, so that a set-up one-liner is read whole.
WHOLE_CODE = ["", "getting-started/", "concepts/", "guides/loss-paths/"]
DESKTOP, PHONE = 1280, 390
WIDTHS = (DESKTOP, PHONE)
MIN_PICTURE_SCALE = 0.8  # on a phone, a picture is drawn at this fraction of its pixel width or more
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


def check_browser(
    base: str, site: pathlib.Path, failures: list[str], require: bool, screenshots: pathlib.Path | None
) -> None:
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
        check_layout(browser, base, site_pages(site), failures, screenshots)
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
    """On a desktop no code block on the first pages is wider than its box: every line is shown whole."""
    page = browser.new_page(viewport={"width": DESKTOP, "height": 900})
    for path in WHOLE_CODE:
        page.goto(base + path, wait_until="load")
        blocks = page.eval_on_selector_all(
            "article pre > code",
            "els => els.map(e => [e.scrollWidth, e.clientWidth, e.innerText.split('\\n')"
            ".reduce((a, b) => (a.length >= b.length ? a : b), '')])",
        )
        clipped = [(sw, cw, line) for sw, cw, line in blocks if sw > cw + 1]
        for sw, cw, line in clipped:
            failures.append(f"browser /{path} at {DESKTOP} px: a code block {sw} px wide in a {cw} px box: {line[:80]!r}")
        print(f"browser /{path:18} at {DESKTOP:4} px: {len(blocks)} code blocks, {len(clipped)} wider than their box")
    page.close()


# Runs in the page: what the layout rules of docs/stylesheets/extra.css promise, measured.
LAYOUT_JS = r"""
(minScale) => {
  const vw = document.documentElement.clientWidth;
  const article = document.querySelector("article");
  const styles = new Map();
  const cs = (e) => { let s = styles.get(e); if (!s) { s = getComputedStyle(e); styles.set(e, s); } return s; };
  const name = (e) => e.tagName.toLowerCase() + (e.className && typeof e.className === "string"
    ? "." + e.className.trim().split(/\s+/).join(".") : "");
  const text = (e) => (e.innerText || e.getAttribute("src") || "").replace(/\s+/g, " ").trim().slice(0, 70);
  const out = {cut: [], scrolls: new Set(), code: 0, codeScroll: 0, wrappedLines: 0, wrapped: [], copied: [], covered: [], noButton: 0,
               tables: 0, tablesScroll: 0, pictures: 0, unlinked: [], small: []};
  if (!article) return {...out, scrolls: 0};
  // 1. Nothing cut off: an element that sticks out (sideways) of the nearest box that clips it
  //    (at the top, the page itself: material's <html> clips at the screen's edges) is fine only
  //    where that box scrolls sideways.
  const seen = new Set();
  for (const e of article.querySelectorAll("*")) {
    const r = e.getBoundingClientRect();
    if (r.width === 0 || r.height === 0 || cs(e).position === "fixed") continue;
    for (let a = e.parentElement; a; a = a.parentElement) {
      const ox = cs(a).overflowX;
      if (ox === "visible") continue;
      const ar = a === document.documentElement ? {left: 0, right: vw} : a.getBoundingClientRect();
      if (r.left < ar.left - 1 || r.right > ar.right + 1) {
        if (ox === "auto" || ox === "scroll") out.scrolls.add(a);
        else if (!seen.has(a)) {  // one report per clipping box, the first element cut by it
          seen.add(a);
          out.cut.push(`${name(e)} ${Math.round(r.left)}..${Math.round(r.right)} px in ${name(a)} `
                       + `${Math.round(ar.left)}..${Math.round(ar.right)} px: ${JSON.stringify(text(e))}`);
        }
      }
      break;
    }
  }
  // 2. Code blocks: a line never wraps (the block scrolls), or a wrapped line hangs indented; the
  //    copy button covers no code text.
  for (const code of article.querySelectorAll("pre > code")) {
    const box = code.getBoundingClientRect();
    if (box.width === 0) continue;
    out.code += 1;
    if (code.scrollWidth > code.clientWidth + 1) out.codeScroll += 1;
    const s = cs(code);
    const wraps = !["pre", "nowrap"].includes(s.whiteSpace) && !s.whiteSpace.startsWith("pre ")
                  && s.textWrapMode !== "nowrap";
    if (wraps && vw < 720)
      out.wrapped.push(`a line wraps on a phone (white-space ${s.whiteSpace}; it should scroll): ${JSON.stringify(text(code).slice(0, 50))}`);
    else if (wraps) {  // each wrapped line goes on to the right of its own first character
      const lines = code.querySelectorAll(":scope > .jt-l");
      if (!lines.length)
        out.wrapped.push(`lines wrap with no per-line box to indent them (docs/site_hooks.py): ${JSON.stringify(text(code).slice(0, 50))}`);
      const lineHeight = parseFloat(s.lineHeight);
      for (const line of lines) {
        if (line.getBoundingClientRect().height < 1.5 * lineHeight) continue;
        out.wrappedLines += 1;
        const rects = [];
        let first = null;
        const walker = document.createTreeWalker(line, NodeFilter.SHOW_TEXT);
        const range = document.createRange();
        for (let node = walker.nextNode(); node; node = walker.nextNode()) {
          const at = node.textContent.search(/\S/);
          if (at < 0) continue;
          if (!first) { range.setStart(node, at); range.setEnd(node, at + 1); first = range.getBoundingClientRect(); }
          range.selectNodeContents(node);
          rects.push(...range.getClientRects());
        }
        const later = rects.filter((r) => r.width > 0 && r.top > first.top + lineHeight / 2);
        const left = Math.min(...later.map((r) => r.left));
        if (later.length && left <= first.left + 1)
          out.wrapped.push(`a wrapped line goes on at ${Math.round(left - first.left)} px from its first character, `
                           + `not indented past it: ${JSON.stringify(text(line).slice(0, 60))}`);
      }
    }
    // what the copy button copies (material: the code's innerText) is the block's text as written
    if (code.innerText.trimEnd() !== code.textContent.trimEnd())
      out.copied.push(`${code.innerText.length} characters copied, ${code.textContent.length} written: `
                      + JSON.stringify(text(code).slice(0, 50)));
    const nav = code.parentElement.querySelector(".md-code__nav");
    if (!nav) { out.noButton += 1; continue; }
    const nr = nav.getBoundingClientRect();
    const walker = document.createTreeWalker(code, NodeFilter.SHOW_TEXT);
    const range = document.createRange();
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      if (!node.textContent.trim()) continue;
      range.selectNodeContents(node);
      const hit = [...range.getClientRects()].find((t) =>
        Math.min(t.right, nr.right, box.right) - Math.max(t.left, nr.left, box.left) > 0.5 &&
        Math.min(t.bottom, nr.bottom) - Math.max(t.top, nr.top) > 0.5);
      if (hit) {
        const word = node.textContent.trim().split("\n")[0];
        const line = code.innerText.split("\n").find((l) => l.includes(word)) || "";
        out.covered.push(`${JSON.stringify(word.slice(0, 30))} in the line `
                         + `${JSON.stringify(line.slice(0, 70))}`);
        break;
      }
    }
  }
  // 3. Tables (counted: the check above says whether one is cut off).
  for (const table of article.querySelectorAll("table")) {
    const r = table.getBoundingClientRect();
    if (r.width === 0) continue;
    out.tables += 1;
    for (let a = table.parentElement; a && a !== article; a = a.parentElement)
      if (out.scrolls.has(a)) { out.tablesScroll += 1; break; }
  }
  // 4. Pictures: each is a link to its own file; on a phone, drawn at minScale of its pixel width or more.
  for (const img of article.querySelectorAll("img")) {
    const src = img.getAttribute("src") || "";
    if (src.startsWith("data:")) continue;
    out.pictures += 1;
    const link = img.closest("a");
    if (!link || new URL(link.getAttribute("href"), location.href).href !== img.src)
      out.unlinked.push(`${src} (${link ? "a link to " + link.getAttribute("href") : "no link"})`);
    const w = img.getBoundingClientRect().width;
    if (vw < 720 && img.naturalWidth && w < minScale * img.naturalWidth - 1)
      out.small.push(`${src} drawn ${Math.round(w)} px wide, ${Math.round(100 * w / img.naturalWidth)}% of its ${img.naturalWidth} px`);
  }
  return {...out, scrolls: out.scrolls.size};
}
"""


def site_pages(site: pathlib.Path) -> list[str]:
    """Every page of the built site, by its address (the home page is "")."""
    pages = [p.parent.relative_to(site).as_posix() for p in site.rglob("index.html")]
    return sorted("" if p == "." else p + "/" for p in pages)


def check_layout(browser, base: str, pages: list[str], failures: list[str], screenshots: pathlib.Path | None) -> None:
    """What docs/stylesheets/extra.css promises, on every page at a desktop and a phone width."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    for width in WIDTHS:
        page = browser.new_page(viewport={"width": width, "height": 900})
        totals = dict.fromkeys(["pages", "code", "codeScroll", "wrappedLines", "tables", "tablesScroll", "pictures", "scrolls"], 0)
        for path in pages:
            page.goto(base + path, wait_until="load")
            try:  # material's script adds the copy buttons once the page has loaded
                page.wait_for_function(
                    "() => [...document.querySelectorAll('article pre > code')].every("
                    "c => c.parentElement.querySelector('.md-code__nav'))",
                    timeout=5_000,
                )
            except PlaywrightTimeout:  # the count below says how many blocks have none
                pass
            found = page.evaluate(LAYOUT_JS, MIN_PICTURE_SCALE)
            where = f"browser /{path} at {width} px"
            for item in found["cut"]:
                failures.append(f"{where}: cut off (sticks out of a box that does not scroll): {item}")
            for item in found["wrapped"]:
                failures.append(f"{where}: code indentation: {item}")
            for item in found["copied"]:
                failures.append(f"{where}: the copy button would copy other text than the block shows: {item}")
            for item in found["covered"]:
                failures.append(f"{where}: the copy button covers code text {item}")
            if found["noButton"]:
                failures.append(f"{where}: {found['noButton']} code blocks without a copy button")
            for item in found["unlinked"]:
                failures.append(f"{where}: a picture that is not a link to its full-size file: {item}")
            for item in found["small"]:
                failures.append(f"{where}: a picture shrunk past reading (under {MIN_PICTURE_SCALE:.0%}): {item}")
            totals["pages"] += 1
            for key in totals.keys() - {"pages"}:
                totals[key] += found[key]
            if screenshots and path in PAGES and width != DESKTOP:
                screenshots.mkdir(parents=True, exist_ok=True)
                name = path.strip("/").replace("/", "_") or "home"
                page.screenshot(path=str(screenshots / f"{name}-{width}px.png"), full_page=True)
        print(
            f"browser layout at {width:4} px: {totals['pages']} pages; {totals['code']} code blocks "
            f"({totals['codeScroll']} scroll sideways, {totals['wrappedLines']} lines wrap), {totals['tables']} tables ({totals['tablesScroll']} scroll "
            f"sideways), {totals['pictures']} pictures, {totals['scrolls']} boxes scroll; checked: nothing cut off, "
            f"code indentation kept, copy buttons clear of code and copying the text as written, pictures linked"
            + (f" and drawn at {MIN_PICTURE_SCALE:.0%}+" if width < 720 else "")
        )
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
        check_browser(base, site, failures, args.require_browser, args.screenshots)
    finally:
        server.shutdown()
    for failure in failures:
        print("FAIL  " + failure)
    print("site check: " + ("FAILED" if failures else "passed"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
