"""A griffe extension for the API reference: read ``Example:`` as Google style's ``Examples:``.

jaxtrace's docstrings open their doctests with ``Example:`` (as Napoleon reads it); griffe
takes that for an admonition and renders ``>>>`` lines as quoted text. Renamed here, the
section becomes an examples section, shown as highlighted console code.
"""

import re

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.M)


class ExampleSections(griffe.Extension):
    def on_object(self, *, obj, **kwargs):
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
