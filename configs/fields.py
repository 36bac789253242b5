"""What a schema field declares beyond its Python type, and how that reads to a person.

A field's choices are a `Literal[...]`, its range a `Range` inside `Annotated[...]`, a key a
resumed run must keep a `Resume` there too, and its documentation the string literal right under
it. Pydantic checks the choices and the range (and ignores `Resume`); the functions here read the
same declarations back for the error lines (`configs/load.py`), the resume check
(`trainer/checkpoint.py`), and `python train.py --help-config` and docs/config.md
(`configs/doc.py`). Nothing here knows the schema itself, so `configs/schema.py` can import it.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import annotated_types


def _number(x: float) -> str:
    """A bound as a person writes it: large powers of two as 2**k (a seed's 2**32)."""
    if isinstance(x, int) and x >= 2**16 and x & (x - 1) == 0:
        return f"2**{x.bit_length() - 1}"
    return str(x)


@dataclass(frozen=True, kw_only=True)
class Range(annotated_types.Interval):
    """A numeric range, `Annotated[int, Range(ge=0, hint="0: off")]`. Pydantic checks its bounds
    (it reads them as annotated_types' `Interval`); the hint says what a special value means, and
    follows the bound in the error line and the docs."""

    hint: str = ""

    def text(self) -> str:
        """'>= 0', '> 0', 'in [0, 1)': the range as the error line and the docs write it."""
        lower = (">=", self.ge) if self.ge is not None else (">", self.gt) if self.gt is not None else None
        upper = ("<=", self.le) if self.le is not None else ("<", self.lt) if self.lt is not None else None
        if lower and upper:
            left, right = "[" if lower[0] == ">=" else "(", "]" if upper[0] == "<=" else ")"
            return f"in {left}{_number(lower[1])}, {_number(upper[1])}{right}"
        op, bound = lower or upper  # type: ignore[misc]
        return f"{op} {_number(bound)}"

    def hinted(self) -> str:
        """`text()` with the hint: '>= 0 (0: off)'."""
        return self.text() + (f" ({self.hint})" if self.hint else "")

    def message(self, value: Any) -> str:
        """The error line's text after the key, for a value outside the range."""
        return f"must be {self.hinted()}, got {value}"


@dataclass(frozen=True)
class Resume:
    """Marks a key a resumed run must share with the run that wrote its checkpoints, as
    `Annotated[int, Range(gt=0), Resume()]`: it fixes the shapes of the state, or which example
    comes at which step. `read`: a property of the same section compared in the field's place,
    for a field whose value is resolved from others (model.head_dim's 0: d_model // num_heads)."""

    read: str = ""


def plain(tp: Any) -> Any:
    """The type without its `Annotated` markers."""
    return typing.get_args(tp)[0] if typing.get_origin(tp) is Annotated else tp


def markers(tp: Any) -> tuple[Any, ...]:
    """The `Annotated` markers of a type (a Range, annotated_types.MinLen, ...); () for none."""
    return typing.get_args(tp)[1:] if typing.get_origin(tp) is Annotated else ()


def range_of(tp: Any) -> Range | None:
    return next((m for m in markers(tp) if isinstance(m, Range)), None)


def resume_of(tp: Any) -> Resume | None:
    return next((m for m in markers(tp) if isinstance(m, Resume)), None)


def choices_of(tp: Any) -> tuple[Any, ...]:
    """The values a `Literal` type (or a list of one) accepts, in declaration order; () for others."""
    tp = plain(tp)
    if typing.get_origin(tp) is list:
        tp = typing.get_args(tp)[0]
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else ()


def choices(cls: type, name: str) -> tuple[Any, ...]:
    """The choices of field `name` of dataclass `cls`: a tuple other code needs, derived from the
    one declaration on the field instead of written again."""
    return choices_of(typing.get_type_hints(cls)[name])


def describe(tp: Any) -> str:
    """A type as a person reads it: 'int >= 0', 'none | fp8 | int8', 'list of int', 'str (not empty)'."""
    base = plain(tp)
    if typing.get_origin(base) is Literal:
        text = " | ".join(str(c) for c in typing.get_args(base))
    elif typing.get_origin(base) is list:
        inner = describe(typing.get_args(base)[0])
        text = f"list of ({inner})" if " " in inner else f"list of {inner}"
    elif typing.get_origin(base) is dict:
        text = "mapping"
    else:
        text = getattr(base, "__name__", str(base))
    for marker in markers(tp):
        if isinstance(marker, Range):
            text += f" {marker.hinted()}"
        elif isinstance(marker, annotated_types.MinLen) and marker.min_length == 1:
            text += " (not empty)"
    return text


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its docstring (the string literal right under the field), for one dataclass."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


@dataclass(frozen=True)
class Key:
    """One settable dotted key of a schema: what --help-config and the error lines read."""

    name: str
    annotation: Any  # the type, with its Annotated markers
    default: Any
    doc: str  # "" where the field has no docstring
    section: type  # the dataclass that declares the field


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


@functools.cache  # every key of every load_config resolves here: typing.get_type_hints is slow
def keys(cls: type, prefix: str = "") -> dict[str, Key]:
    """Dotted key -> Key, for every settable key under dataclass `cls` (a dict field is one key).
    Shared between callers: read it, never change it."""
    hints, docs, out = typing.get_type_hints(cls, include_extras=True), field_docs(cls), {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.update(keys(tp, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = Key(f"{prefix}{f.name}", tp, _default(f), docs.get(f.name, ""), cls)
    return out


@functools.cache
def keys_fixed_on_resume(cls: type) -> dict[str, str]:
    """Dotted key -> the dotted attribute a resume compares (the key itself, or the property its
    `Resume` names), for every key under dataclass `cls` marked `Resume`, in schema order.
    Shared between callers: read it, never change it."""
    out = {}
    for name, key in keys(cls).items():
        marker = resume_of(key.annotation)
        if marker:
            out[name] = f"{name.rpartition('.')[0]}.{marker.read}".lstrip(".") if marker.read else name
    return out
