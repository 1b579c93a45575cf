"""The config reference, generated from the schema itself: every key of `schemas/config.py` with its type, default and
description, section by section. `python -m schemas.reference > docs/config.md` writes the page; a test checks that
the page is current and that every field has a description.
"""

from __future__ import annotations

import json
import re
import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from schemas.config import Registered, RunConfig, Section

HEADER = """# Config reference

Every key of a run's config (`schemas/config.py`), generated from the schema by `python -m schemas.reference`. A
config file sets any of them in YAML, `--set section.key=value` overrides one (a number indexes a list:
`--set data.sources.1.weight=2`), and an unknown key or a bad value fails with one line naming it. `task` takes one of
the built-in example tasks, by `name`.
"""


def _sections(annotation) -> list[type[BaseModel]]:
    """The config sections a field holds (a section, an optional one, or a union of tasks)."""
    out = []
    for arg in typing.get_args(annotation) or (annotation,):
        if typing.get_origin(arg) is typing.Annotated:
            out += _sections(typing.get_args(arg)[0])
        elif isinstance(arg, type) and issubclass(arg, Section):
            out.append(arg)
        elif typing.get_args(arg):
            out += _sections(arg)
    return out


def _type(annotation, metadata=()) -> str:
    registered = next((m for m in metadata if isinstance(m, Registered)), None)
    if registered is not None:  # a registry's names (schemas.config.registered), shown as a Literal's would be
        return " | ".join(repr(name) for name in registered.registry().names())
    sections = _sections(annotation)
    if sections and typing.get_origin(annotation) is dict:
        return f"dict[str, {sections[0].__name__}]"
    if sections and typing.get_origin(annotation) is list:
        return f"list[{sections[0].__name__}]"
    if sections:
        return " | ".join(s.__name__ for s in sections) + (
            " | None" if type(None) in typing.get_args(annotation) else ""
        )
    text = getattr(annotation, "__name__", None) if not typing.get_args(annotation) else None
    text = text or str(annotation).replace("typing.", "")
    return re.sub(r"Literal\[(.*?)\]", lambda m: m.group(1).replace(", ", " | "), text.replace("NoneType", "None"))


def _default(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section)"
    return json.dumps(value, ensure_ascii=False, default=lambda v: v.model_dump(mode="json", exclude_defaults=True))


def fields(cls: type[BaseModel] = RunConfig, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, description) of every field, depth first; a section's own fields follow its row."""
    rows = []
    for name, field in cls.model_fields.items():
        key = f"{prefix}{name}"
        rows.append((key, _type(field.annotation, field.metadata), _default(field), field.description or ""))
        for section in _sections(field.annotation):
            named = "name" in section.model_fields  # one of a union, told apart by its name
            inner = f"{key}[name={section.model_fields['name'].default}]." if named else key + "."
            if typing.get_origin(field.annotation) is dict:  # sections by name: reward.functions.NAME.weight
                inner = key + ".NAME."
            elif typing.get_origin(field.annotation) is list:  # a list of sections: data.sources[].weight
                inner = key + "[]."
            rows += fields(section, inner)
    return rows


def markdown() -> str:
    rows = fields()
    table = ["| key | type | default | description |", "|---|---|---|---|"]
    top = [r for r in rows if "." not in r[0] and "[" not in r[0] and r[2] != "(section)"]
    lines = [HEADER, "## Top level", "", *table, *map(_row, top)]
    for row in rows:
        if row in top and not row[1].endswith(("Task | None", "Task")):
            continue
        if "." not in row[0] and "[" not in row[0]:  # a section (or the task's union): its heading, then its keys
            lines += ["", f"## `{row[0]}`", "", row[3], "", *table]
        else:
            lines.append(_row(row))
    return "\n".join(lines) + "\n"


def _row(row: tuple[str, str, str, str]) -> str:
    key, kind, default, description = row
    cell = description.replace("|", "\\|").replace("\n", " ")
    return f"| `{key}` | `{kind.replace('|', '&#124;')}` | `{default}` | {cell} |"


if __name__ == "__main__":
    print(markdown(), end="")
