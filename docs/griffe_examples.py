"""A griffe extension for the API reference: read ``Example:`` as Google style's ``Examples:``.

jaxtrace's docstrings open their doctests with ``Example:`` (as Napoleon reads it); griffe
takes that for an admonition and renders ``>>>`` lines as quoted text. Renamed here, the
section becomes an examples section, shown as highlighted console code. Sphinx roles
(``:func:`summarize```) become plain code spans.
"""

import re

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.M)
_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|obj|exc):`~?([^`]+)`")


class ExampleSections(griffe.Extension):
    def on_object(self, *, obj, **kwargs):
        if obj.docstring is not None:
            text = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
            obj.docstring.value = _ROLE.sub(r"``\1``", text)
