"""Every mpsnn name cited in the "Selectors" section of docs/mps-mapping.md exists.

The section maps each Objective-C selector an MPS training client calls to its mpsnn
spelling, in two-column tables (``| MPS selector | mpsnn |``). Every backticked span of the
mpsnn column is a reference, written in one of these forms (the convention the section states):

* ``Name``: a public name of `mpsnn` (in ``mpsnn.__all__``);
* ``Name.member``: a member of that class: a class attribute, property, method or enum
  member (``hasattr`` on the class), a dataclass field, or an instance attribute that the
  class or one of its bases assigns (``self.member = ...`` in its source);
* ``Name(args)`` / ``Name.member(args)``: a call of the constructor or method, checked with
  `inspect.signature`: positional arguments are parameter names, given in the signature's order
  (extra ones only where it takes ``*args``); ``name=`` (or ``name=value``) is a keyword
  argument the callable accepts (any name where it takes ``**kwargs``); ``...`` elides the rest;
* ``mpsnn.function`` / ``mpsnn.function(args)``: a public function, checked the same way.

A cell without a reference says "n/a: reason" or "planned".
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

import mpsnn

DOC = Path(__file__).resolve().parent.parent / "docs" / "mps-mapping.md"
HEADING = "## Selectors"

_IDENT = r"[A-Za-z_]\w*"
_REF = re.compile(
    rf"^(?:(?P<module>mpsnn)\.(?P<function>{_IDENT})"
    rf"|(?P<name>{_IDENT})(?:\.(?P<member>{_IDENT}))?)"
    r"(?:\((?P<args>[^()]*)\))?$"
)


def _section(text: str) -> str:
    """The text of the Selectors section (up to the next ``## `` heading), or ''."""
    start = text.find(f"\n{HEADING}\n")
    if start < 0:
        return ""
    body = text[start + len(HEADING) + 2 :]
    end = body.find("\n## ")
    return body if end < 0 else body[:end]


def _rows(section: str) -> list[tuple[str, list[str]]]:
    """``(subsection heading, cells)`` for every table body row of the section."""
    rows: list[tuple[str, list[str]]] = []
    heading = ""
    lines = section.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("### "):
            heading = line[4:].strip()
            continue
        if not line.startswith("|"):
            continue
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", line.strip()) or nxt.startswith("|---"):
            continue  # the separator row, or the header row above it
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows.append((heading, cells))
    return rows


def _references(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


@functools.cache
def _assigned_attributes(cls: type) -> frozenset[str]:
    """Names assigned as ``self.<name>`` anywhere in the source of ``cls`` and its bases."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("mpsnn"):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        for node in ast.walk(tree):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, ast.AnnAssign | ast.AugAssign):
                targets = [node.target]
            while targets:
                t = targets.pop()
                if isinstance(t, ast.Tuple | ast.List):
                    targets.extend(t.elts)
                elif (
                    isinstance(t, ast.Attribute)
                    and isinstance(t.value, ast.Name)
                    and t.value.id == "self"
                ):
                    names.add(t.attr)
    return frozenset(names)


def _has_member(cls: type, member: str) -> bool:
    if hasattr(cls, member):
        return True
    if dataclasses.is_dataclass(cls) and member in {f.name for f in dataclasses.fields(cls)}:
        return True
    return member in _assigned_attributes(cls)


def _check_call(what: str, fn: Any, args: str) -> str | None:
    """None when ``fn`` accepts the arguments written ``args``; otherwise why not."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        return f"{what}: no signature ({exc})"
    params = list(sig.parameters.values())
    if params and params[0].name in ("self", "cls") and inspect.isfunction(fn):
        params = params[1:]  # a method looked up on its class
    kinds = inspect.Parameter
    positional = [
        p.name for p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
    ]
    keywords = {
        p.name for p in params if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)
    }
    var_positional = any(p.kind is kinds.VAR_POSITIONAL for p in params)
    var_keyword = any(p.kind is kinds.VAR_KEYWORD for p in params)
    items = [a.strip() for a in args.split(",")] if args.strip() else []
    index = 0
    seen_keyword = False
    for item in items:
        if item == "...":
            continue
        if "=" in item:
            name = item.split("=", 1)[0].strip()
            if not re.fullmatch(_IDENT, name):
                return f"{what}: {item!r} is not a keyword argument"
            if name not in keywords and not var_keyword:
                return f"{what}: no keyword parameter {name!r} in {sig}"
            seen_keyword = True
            continue
        if not re.fullmatch(_IDENT, item):
            return f"{what}: {item!r} is not a parameter name"
        if seen_keyword:
            return f"{what}: positional {item!r} after a keyword argument"
        if index < len(positional):
            if item != positional[index]:
                return (
                    f"{what}: positional argument {index} is {positional[index]!r} "
                    f"in {sig}, not {item!r}"
                )
        elif not var_positional:
            return f"{what}: no positional parameter for {item!r} in {sig}"
        index += 1
    return None


def resolve(ref: str) -> str | None:
    """None when the reference ``ref`` (a backticked span of the mpsnn column) names something
    that exists in mpsnn as written; otherwise the reason it does not."""
    m = _REF.match(ref.strip())
    if m is None:
        return f"{ref!r} is not written in the section's convention"
    args = m.group("args")
    if m.group("module"):
        name = m.group("function")
        if name not in mpsnn.__all__:
            return f"mpsnn.{name} is not a public name of mpsnn"
        target = getattr(mpsnn, name)
        return None if args is None else _check_call(f"mpsnn.{name}", target, args)
    name, member = m.group("name"), m.group("member")
    if name not in mpsnn.__all__:
        return f"{name} is not a public name of mpsnn"
    obj = getattr(mpsnn, name)
    if member is None:
        return None if args is None else _check_call(name, obj, args)
    if not inspect.isclass(obj):
        return f"{name} is not a class, so {name}.{member} is not a member reference"
    if not _has_member(obj, member):
        return f"{name} has no member {member!r}"
    if args is None:
        return None
    if not hasattr(obj, member):
        return f"{name}.{member} is an instance attribute, not a method: it takes no arguments"
    target = inspect.getattr_static(obj, member)
    if isinstance(target, classmethod | staticmethod):
        target = getattr(obj, member)
    if isinstance(target, property) or not callable(target):
        return f"{name}.{member} is not a method, so it takes no arguments"
    return _check_call(f"{name}.{member}", target, args)


def _cited() -> list[tuple[str, str]]:
    """``(where, reference)`` for each distinct reference of the mpsnn column."""
    found: dict[str, str] = {}
    for heading, cells in _rows(_section(DOC.read_text(encoding="utf-8"))):
        if len(cells) != 2:
            continue  # test_tables_have_two_columns reports it
        for ref in _references(cells[1]):
            found.setdefault(ref, f"{heading}: {cells[0]}")
    # an empty list would make pytest skip the test below: fail instead
    return [(where, ref) for ref, where in found.items()] or [("(no section)", "")]


def test_section_exists_and_is_last() -> None:
    text = DOC.read_text(encoding="utf-8")
    section = _section(text)
    assert section, f"{DOC.name} must have a {HEADING!r} section"
    assert "\n## " not in text[text.index(f"\n{HEADING}\n") + 1 :], (
        f"{HEADING!r} must be the last section of {DOC.name}"
    )
    assert len(_rows(section)) > 200, "the section must list the training API's selectors"


def test_tables_have_two_columns_and_every_row_says_something() -> None:
    bad = []
    for heading, cells in _rows(_section(DOC.read_text(encoding="utf-8"))):
        if len(cells) != 2:
            bad.append(f"{heading}: {cells} (want 2 cells: MPS selector, mpsnn)")
            continue
        selector, name = cells
        if not _references(selector):
            bad.append(f"{heading}: {selector!r} cites no MPS selector in backticks")
        if not _references(name) and not name.startswith(("n/a: ", "planned")):
            bad.append(f"{heading}: {selector}: {name!r} (want a reference, n/a: or planned)")
    assert not bad, "\n".join(bad)


_CITED = _cited()


@pytest.mark.parametrize(("where", "ref"), _CITED, ids=[r for _, r in _CITED])
def test_cited_name_resolves(where: str, ref: str) -> None:
    problem = resolve(ref)
    assert problem is None, f"{where}: {problem}"


@pytest.mark.parametrize(
    ("ref", "why"),
    [
        ("NoSuchClass", "not a public name"),
        ("Graph.no_such_member", "no member"),
        ("Graph(device, result_imag=)", "no keyword parameter 'result_imag'"),
        ("Graph(result_image, device)", "positional argument 0 is 'device'"),
        ("SGD.encode(command_buffer, input_gradient_vector)", "no positional parameter"),
        ("Graph.format(x)", "not a method"),
        ("mpsnn.no_such_function", "not a public name"),
        ("graph.encode", "not a public name"),
        ("Graph.encode(command_buffer, source_images, source_states=, ...)", None),
        ("FilterNode.result_image", None),  # an instance attribute set in __init__
        ("OptimizerDescriptor.learning_rate", None),
        ("TrainingStyle.UPDATE_ON_GPU", None),
        ("SpatialNormalizationNode(source, kernel_width, kernel_height)", None),  # *size
        ("mpsnn.save(obj, path)", None),
        ("ConvolutionWeightsAndBiasesState.temporary(command_buffer, descriptor)", None),
        ("Image.default_allocator()", None),
    ],
)
def test_resolver_checks_what_it_claims(ref: str, why: str | None) -> None:
    problem = resolve(ref)
    if why is None:
        assert problem is None, problem
    else:
        assert problem is not None and why in problem, problem
