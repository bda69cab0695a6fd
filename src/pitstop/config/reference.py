"""The config reference, generated from the schemas and ``conf/`` (the docs site renders it at build time, so it
cannot drift from the code): every schema'd group, its options, and every key with its type, default and doc.

    python -m pitstop.config.reference conf > reference.md
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Iterator

from omegaconf import MISSING, OmegaConf

from pitstop.config import compose, schema

GROUPS = ("trainer", "strategy", "ckpt", "loader", "fault", "logger")


def keys(cls: type, prefix: str = "") -> Iterator[tuple[str, str, Any, str, str]]:
    """(dotted key, type, default, doc, allowed range) of every key of a schema, nested sections flattened."""
    for f in dataclasses.fields(cls):
        factory = f.default_factory
        if isinstance(factory, type) and dataclasses.is_dataclass(factory):
            yield from keys(factory, f"{prefix}{f.name}.")
        elif f.name != "_target_":
            default = factory() if factory is not dataclasses.MISSING else f.default
            check = f.metadata.get("check")
            yield f"{prefix}{f.name}", str(f.type), default, f.metadata.get("doc", ""), check.text if check else ""


def yaml(value: Any) -> str:
    """A value as a user writes it on the command line: ``null``, ``true``, ``[a, b]``, ``{}``."""
    if isinstance(value, list):
        return "[" + ", ".join(yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml(v)}" for k, v in value.items()) + "}"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def shown(value: Any) -> str:
    """A default in a table cell."""
    return "required" if value == MISSING else f"`{yaml(value)}`"


def cell(text: str) -> str:
    """Prose in a table cell (a ``|`` would end the cell; reST's double backquotes read as Markdown's single)."""
    return text.replace("``", "`").replace("|", "\\|")


def typename(annotation: str) -> str:
    """``Optional[int]`` -> ``int or null``; ``Any`` -> ``any``."""
    text = annotation.replace("typing.", "")
    if text.startswith("Optional[") and text.endswith("]"):
        return f"{typename(text[9:-1])} or null"
    return "any" if text == "Any" else text


def options(conf: str, group: str) -> list[tuple[str, type, str, dict]]:
    """(name, schema, first comment line, keys it sets) of each option of ``group`` in ``conf``."""
    out = []
    for name in sorted(n[:-5] for n in os.listdir(os.path.join(conf, group)) if n.endswith(".yaml")):
        path = os.path.join(conf, group, f"{name}.yaml")
        with open(path) as f:
            lines = f.read().splitlines()
        about = next((ln.lstrip("# ").strip() for ln in lines if ln.startswith("#")), "")
        raw = OmegaConf.to_container(OmegaConf.load(path))
        raw.pop("defaults", None)
        kind = OmegaConf.get_type(compose(os.path.abspath(conf), [f"{group}={name}"], os.getcwd())[group])
        out.append((name, kind, about, raw))
    return out


def render(conf: str) -> str:
    """The reference as Markdown: per group, its options, then a table of every key per schema."""
    parts = []
    for group in GROUPS:
        parts.append(f"## `{group}`\n")
        opts = options(conf, group)
        if len(opts) > 1 or group != "trainer":
            parts.append("| option | schema | what it is | sets |\n|---|---|---|---|")
            for name, kind, about, raw in opts:
                sets = ", ".join(f"`{k}={yaml(v)}`" for k, v in raw.items()) or "—"
                parts.append(f"| `{group}={name}` | `{kind.__name__}` | {cell(about)} | {sets} |")
            parts.append("")
        seen: set[type] = set()
        for cls in schema.SCHEMAS[group].values():
            if cls in seen:
                continue
            seen.add(cls)
            doc = " ".join((cls.__doc__ or "").split()).replace("``", "`")
            head = "| key | type | default | allowed | what it is |\n|---|---|---|---|---|"
            parts.append(f"### `{cls.__name__}`\n\n{doc}\n\n{head}")
            for key, kind, default, about, allowed in keys(cls):
                parts.append(
                    f"| `{group}.{key}` | {typename(kind)} | {shown(default)} | {cell(allowed)} | {cell(about)} |"
                )
            parts.append("")
    return "\n".join(parts)


if __name__ == "__main__":
    print(render(sys.argv[1] if len(sys.argv) > 1 else "conf"))
