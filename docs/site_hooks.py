"""mkdocs hooks (mkdocs.yml ``hooks:``): the page's HTML, made for a phone and a desktop.

Code lines: each line of a code block becomes ``<span class="jt-l" style="--jt-i: N">``, N
the line's indentation in characters, so that docs/stylesheets/extra.css can wrap a long
line on a desktop with its continuation indented past the line's own start (a hanging
indent per line); on a phone the spans stay inline and lines scroll. The text of the block
(what the copy button copies, what search indexes) is unchanged.

Pictures: each ``<img>`` that is not already in a link is wrapped in a link to its own file.
A picture that stands alone in its paragraph (``![alt](images/x.png)`` on a line of its own) gets the
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


_CODE = re.compile(r"(<pre\b[^>]*>(?:<span></span>)?<code\b[^>]*>)(.*?)(</code></pre>)", re.DOTALL)
_PIECE = re.compile(r"(<[^>]+>)")


def _code_lines(inner: str) -> str:
    """The highlighted HTML of a code block, each line in a span of its own (a token span that
    runs over a line end, as a docstring's does, is closed at the end of the line and opened
    again on the next)."""
    lines: list[list[str]] = [[]]
    texts: list[list[str]] = [[]]
    stack: list[str] = []  # the open token tags
    for piece in _PIECE.split(inner):
        if not piece:
            continue
        if piece.startswith("<"):
            if piece.startswith("</"):
                stack.pop()
            elif not piece.endswith("/>"):
                stack.append(piece)
            lines[-1].append(piece)
            continue
        parts = piece.split("\n")
        for i, part in enumerate(parts):
            if i:  # a line ends: close the open tokens, and open them again on the next line
                lines[-1].append("</span>" * len(stack) + "\n")
                lines.append(list(stack))
                texts.append([])
            lines[-1].append(part)
            texts[-1].append(part)
    if len(lines) > 1 and not stack and not "".join(texts[-1]):
        lines.pop()  # after the block's last line end: no text, only tags opened again and closed
        texts.pop()
    out = []
    for line, text in zip(lines, texts):
        plain = html.unescape("".join(text))
        indent = len(plain) - len(plain.lstrip(" "))
        style = f' style="--jt-i: {indent}"' if indent else ""
        out.append(f'<span class="jt-l"{style}>' + "".join(line) + "</span>")
    return "".join(out)


def on_page_content(html_text: str, page, config, files) -> str:
    alone = {m.group(1) for m in _ALONE.finditer(html_text)}

    def replace(match: re.Match) -> str:
        if match.group(1):  # already a link
            return match.group(0)
        img = match.group(2)
        return _link(img, page, files, img in alone)

    html_text = _IMG.sub(replace, html_text)
    return _CODE.sub(lambda m: m.group(1) + _code_lines(m.group(2)) + m.group(3), html_text)
