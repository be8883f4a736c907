"""DSML tags as the recovering parser sees them: lexing one tag, reading its attributes, tool names.

Owns the lenient, per-tag view of DSML that `streaming.StreamingParser` builds on: a tag is
`<` or `</`, a spelling of the marker (`｜DSML｜`, or the ASCII `|DSML|` drift when tools are
declared), a name, attributes and `>`. Whitespace between tags is free here (the official grammar
demands exactly "\\n"); the official parser in `encoding_dsv4` stays byte-exact and separate.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .encoding_dsv4 import DSML

ASCII_DSML = "|DSML|"  # drift spelling (ENCODING.md §6.5), honoured only when tools are declared

_NAME_MAX = 64  # longest tag name read as a name; anything longer spills into the attributes
_ATTRS_MAX = 1024  # a tag whose ">" has not come within this many characters is not a tag
_TAG_TAIL = re.compile(rf"([A-Za-z0-9_]{{0,{_NAME_MAX}}})([^<>\n]{{0,{_ATTRS_MAX}}})(>?)")
_INVOKE_ATTRS = re.compile(r'\s*name="([^"\n]*)"\s*')
_PARAM_ATTRS = re.compile(r'\s*name="([^"\n]*)"\s+string="(true|false)"\s*')
_WHITESPACE = re.compile(r"\s*")

PENDING = object()  # returned by `lex_tag` while more text is needed to decide


@dataclass(frozen=True)
class Tag:
    """One lexed DSML tag starting at the lexing position.

    `size` is what the tag covers: through ">" when `complete`; otherwise the marker and the
    name glued to it only (a marker with no "<" before it, or a "<" tag that never closed).
    """

    size: int
    spelling: str
    closing: bool
    name: str
    attrs: str
    complete: bool

    def is_open(self, name: str) -> bool:
        return self.complete and not self.closing and self.name == name

    def is_close(self, name: str) -> bool:
        return self.complete and self.closing and self.name == name and not self.attrs.strip()

    @property
    def bare(self) -> bool:
        """A complete tag without attributes (`<｜DSML｜tool_calls>`, `</｜DSML｜invoke>`)."""
        return self.complete and not self.attrs.strip()


def spellings_for(declared: dict[str, frozenset[str]]) -> tuple[str, ...]:
    """Marker spellings to recognise: the ASCII one only when tools were declared."""
    return (DSML, ASCII_DSML) if declared else (DSML,)


def _openers(spelling: str) -> tuple[str, ...]:
    # A bare fullwidth marker (no "<") is still DSML that must not reach content or reasoning.
    return ("</", "<", "") if spelling == DSML else ("</", "<")


def lex_tag(text: str, i: int, spellings: tuple[str, ...], final: bool):
    """The tag at `text[i:]`: a `Tag`, None if no tag starts there, or PENDING if undecided.

    With `final` (no more text will come) the answer is never PENDING.
    """
    rest = text[i:]
    for spelling in spellings:
        for opener in _openers(spelling):
            marker = opener + spelling
            if rest.startswith(marker):
                return _lex_tail(text, i, marker, opener, spelling, final)
    if not final and any((o + s).startswith(rest) for s in spellings for o in _openers(s)):
        return PENDING
    return None


def _lex_tail(text: str, i: int, marker: str, opener: str, spelling: str, final: bool):
    match = _TAG_TAIL.match(text, i + len(marker))
    name, attrs, gt = match.groups()
    name_end = match.start(2)
    if not opener:  # bare marker: the marker and the word glued to it
        if name_end == len(text) and len(name) < _NAME_MAX and not final:
            return PENDING
        return Tag(name_end - i, spelling, False, name, "", False)
    if not gt and match.end() == len(text) and len(attrs) < _ATTRS_MAX and not final:
        return PENDING
    if not gt:
        return Tag(name_end - i, spelling, opener == "</", name, "", False)
    return Tag(match.end() - i, spelling, opener == "</", name, attrs, True)


def whitespace_end(text: str) -> int:
    """Index of the first non-whitespace character (len(text) if none)."""
    return _WHITESPACE.match(text).end()


def invoke_name(tag: Tag) -> str | None:
    """The tool name of an `<｜DSML｜invoke name="...">` tag, else None."""
    match = _INVOKE_ATTRS.fullmatch(tag.attrs) if tag.is_open("invoke") else None
    return match[1] if match else None


def parameter_attrs(tag: Tag) -> tuple[str, str] | None:
    """(name, "true"|"false") of a `<｜DSML｜parameter name="..." string="...">` tag, else None."""
    match = _PARAM_ATTRS.fullmatch(tag.attrs) if tag.is_open("parameter") else None
    return (match[1], match[2]) if match else None


def declared_tools(tools: list[dict] | None) -> dict[str, frozenset[str]]:
    """Declared tool name -> its required parameter names, from OpenAI tool schemas
    (`{"type": "function", "function": {"name": ..., "parameters": {"required": [...]}}}`) or bare
    `{"name": ...}` dicts; entries without a string name are ignored."""
    declared = {}
    for tool in tools or ():
        spec = tool.get("function", tool) if isinstance(tool, dict) else None
        name = spec.get("name") if isinstance(spec, dict) else None
        if isinstance(name, str) and name:
            params = spec.get("parameters")
            required = params.get("required") if isinstance(params, dict) else None
            declared[name] = frozenset(r for r in required or () if isinstance(r, str))
    return declared
