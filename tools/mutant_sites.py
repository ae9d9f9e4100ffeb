"""Where a mutant applies: a named *site tag* in the library source, found with ``ast``.

A site is one statement (or a run of consecutive sibling statements) of a source file, named
by a comment tag::

    # mutant-site: purge-recheck          <- alone on a line: the next statement is the site
    if self.rooms.get(room) is not entry:
        return False

    entry.claim()  # mutant-site: claim   <- at the end of a line: the statement starting there

Names are short, kebab-case and unique per file; several mutants may share one site. A mutant
replaces the site's source lines (its first statement's first line, decorators included, to
its last statement's last line) with its replacement, dedented and then indented to the
site's indentation. The tools never quote a library line: a library line may change freely;
only a missing or duplicated tag makes a mutant stale.
"""

from __future__ import annotations

import ast
import io
import re
import textwrap
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass

TAG_RE = re.compile(r"#\s*mutant-site:\s*(?P<name>\S+)\s*$")
"""A site tag comment; the name must match :data:`NAME_RE`."""
NAME_RE = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
"""A site name: lower-case kebab-case."""


class SiteError(Exception):
    """A site tag that is missing, duplicated, malformed or not at a statement."""


@dataclass(frozen=True)
class Tag:
    """One site tag comment in a file."""

    name: str
    line: int
    """1-based line of the comment."""
    col: int
    """Column of the ``#``."""
    own_line: bool
    """Alone on its line (the next statement is the site) or trailing a statement."""


@dataclass(frozen=True)
class Site:
    """The lines a mutant replaces."""

    first: int
    """1-based first line (decorators included)."""
    last: int
    """1-based last line, inclusive."""
    indent: str
    """The first statement's indentation."""


def tags(text: str) -> list[Tag]:
    """Every site tag comment of ``text`` (real comments only, never inside a string).

    Raises:
        SiteError: the text does not tokenize, or a tag name is not kebab-case.
    """
    found: list[Tag] = []
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError) as exc:
        raise SiteError(f"cannot tokenize: {exc}") from exc
    lines = text.splitlines()
    for tok in tokens:
        if tok.type != tokenize.COMMENT:
            continue
        match = TAG_RE.search(tok.string)
        if match is None or not tok.string.lstrip("#").strip().startswith("mutant-site:"):
            continue
        name = match["name"]
        line, col = tok.start
        if not NAME_RE.match(name):
            raise SiteError(f"line {line}: site name {name!r} is not kebab-case")
        own_line = not lines[line - 1][:col].strip()
        found.append(Tag(name, line, col, own_line))
    return found


def _bodies(node: ast.AST) -> Iterator[list[ast.stmt]]:
    """The statement lists directly inside ``node`` (bodies, else, handlers, cases)."""
    for name in ("body", "orelse", "finalbody"):
        body = getattr(node, name, None)
        if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
            yield body
    for handler in getattr(node, "handlers", ()):
        yield handler.body
    for case in getattr(node, "cases", ()):
        yield case.body


def statement_lists(tree: ast.AST) -> Iterator[list[ast.stmt]]:
    """Every list of sibling statements in ``tree``, outermost first."""
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop(0)
        for body in _bodies(node):
            yield body
            todo.extend(body)


def first_line(stmt: ast.stmt) -> int:
    """A statement's first line, its decorators included."""
    decorators: list[ast.expr] = getattr(stmt, "decorator_list", [])
    return min([stmt.lineno, *(d.lineno for d in decorators)])


def _end(stmt: ast.stmt) -> int:
    return stmt.end_lineno if stmt.end_lineno is not None else stmt.lineno


def locate(text: str, name: str, statements: int = 1) -> Site:
    """The lines of site ``name`` in ``text``: its tag must occur exactly once.

    Raises:
        SiteError: the tag is missing or duplicated, no statement sits at it, there are
            fewer than ``statements`` siblings from it on, or a site line holds code that
            is not the site's.
    """
    found = [t for t in tags(text) if t.name == name]
    if len(found) != 1:
        raise SiteError(f"site tag {name!r} found {len(found)} times (expected exactly once)")
    tag = found[0]
    try:
        tree = ast.parse(text)
    except SyntaxError as exc:
        raise SiteError(f"does not parse: {exc}") from exc
    best: tuple[int, list[ast.stmt], int] | None = None  # (start line, siblings, index)
    for body in statement_lists(tree):  # outermost first: the first hit at a line wins
        for i, stmt in enumerate(body):
            start = first_line(stmt)
            hit = start > tag.line if tag.own_line else stmt.lineno == tag.line
            if hit and (best is None or start < best[0]):
                best = (start, body, i)
    if best is None:
        where = "after" if tag.own_line else "at"
        raise SiteError(f"site tag {name!r} (line {tag.line}): no statement {where} it")
    start, body, i = best
    if tag.own_line and start != tag.line + 1:
        between = text.splitlines()[tag.line : start - 1]
        if any(line.strip() and not line.strip().startswith("#") for line in between):
            raise SiteError(f"site tag {name!r} (line {tag.line}): code between it and its site")
    run = body[i : i + statements]
    if statements < 1 or len(run) != statements:
        raise SiteError(
            f"site {name!r} (line {start}): statements={statements}, but only {len(run)} "
            "sibling statements from it on"
        )
    lines = text.splitlines()
    head = lines[start - 1]
    indent = head[: len(head) - len(head.lstrip())]
    if tag.own_line and tag.col != len(indent):
        raise SiteError(f"site tag {name!r} (line {tag.line}): not at its statement's indent")
    first_col = run[0].col_offset if start == run[0].lineno else len(indent)
    if first_col != len(indent) or head.lstrip().startswith("elif"):
        raise SiteError(f"site {name!r} (line {start}): the statement does not start its line")
    last = run[-1]
    tail = lines[_end(last) - 1][last.end_col_offset or 0 :].strip()
    if tail and not tail.startswith("#"):
        raise SiteError(f"site {name!r} (line {_end(last)}): code after the site on its line")
    return Site(start, _end(last), indent)


def reindent(replacement: str, indent: str) -> list[str]:
    """``replacement`` dedented, then indented by ``indent``: the lines that replace a site."""
    body = textwrap.indent(textwrap.dedent(replacement), indent)
    return body.splitlines(keepends=True) if body else []


def mutate(text: str, name: str, replacement: str, statements: int = 1) -> str:
    """``text`` with site ``name`` replaced by ``replacement``.

    Raises:
        SiteError: see :func:`locate`.
    """
    site = locate(text, name, statements)
    lines = text.splitlines(keepends=True)
    new = reindent(replacement, site.indent)
    if new and not new[-1].endswith("\n"):
        new[-1] += "\n"
    return "".join(lines[: site.first - 1] + new + lines[site.last :])
