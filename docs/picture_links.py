"""An mkdocs hook (mkdocs.yml ``hooks:``): every picture on a page opens at full size when tapped.

Each ``<img>`` that is not already in a link is wrapped in a link to its own file. A picture
that stands alone in its paragraph (``![alt](images/x.png)`` on a line of its own) gets the
class ``jt-picture``, its pixel size as ``width``/``height`` (no layout jump while it loads)
and that width as ``--jt-width``: on a phone, docs/stylesheets/extra.css draws it no smaller
than 80% of that size, in a box that scrolls sideways, so the numbers in a heatmap stay
readable. docs/check_site.py checks the links and the size in headless Chromium.
"""

from __future__ import annotations

import html
import pathlib
import re
import struct
import urllib.parse

# <img> alone in its paragraph, or anywhere; an <img> already inside <a ...> is left alone
_ALONE = re.compile(r"<p>\s*(<img\b[^>]*>)\s*</p>")
_IMG = re.compile(r"(<a\b[^>]*>\s*)?(<img\b[^>]*>)")
_ATTR = re.compile(r'\b(src|width|height)="([^"]*)"')


def _png_size(path: pathlib.Path) -> tuple[int, int] | None:
    try:
        with open(path, "rb") as f:
            head = f.read(24)
    except OSError:
        return None
    if head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        return None
    return struct.unpack(">II", head[16:24])


def _link(img: str, page, files, alone: bool) -> str:
    attrs = dict(_ATTR.findall(img))
    src = html.unescape(attrs.get("src", ""))
    if not src or src.startswith("data:"):
        return img
    href = html.escape(src, quote=True)
    title = "Open the picture at full size"
    if not alone:
        return f'<a href="{href}" title="{title}">{img}</a>'
    style, sized = "", img
    parts = urllib.parse.urlsplit(src)
    if not parts.scheme and not parts.netloc:  # a file of the docs: read its pixel size
        # (the src is relative to the page's address by now: ../images/x.png on gallery/)
        file = files.get_file_from_path(_normalize(page.url + urllib.parse.unquote(parts.path)))
        size = _png_size(pathlib.Path(file.abs_src_path)) if file is not None and file.abs_src_path else None
        if size is not None:
            style = f' style="--jt-width: {size[0]}px"'
            if "width" not in attrs and "height" not in attrs:
                sized = img.replace("<img ", f'<img width="{size[0]}" height="{size[1]}" ', 1)
    return f'<a class="jt-picture" href="{href}" title="{title}"{style}>{sized}</a>'


def _normalize(uri: str) -> str:
    parts: list[str] = []
    for part in uri.split("/"):
        if part == "..":
            if parts:
                parts.pop()
        elif part not in ("", "."):
            parts.append(part)
    return "/".join(parts)


def on_page_content(html_text: str, page, config, files) -> str:
    alone = {m.group(1) for m in _ALONE.finditer(html_text)}

    def replace(match: re.Match) -> str:
        if match.group(1):  # already a link
            return match.group(0)
        img = match.group(2)
        return _link(img, page, files, img in alone)

    return _IMG.sub(replace, html_text)
