"""The config reference the docs site shows is generated from the schemas and conf/ (pitstop.config.reference)."""

from __future__ import annotations

from conftest import CONF
from pitstop.config import schema
from pitstop.config.reference import GROUPS, keys, render, shown


def test_the_reference_names_every_key_of_every_schema_with_its_default_and_doc():
    text, bar, escaped = render(CONF), "|", "\\|"
    assert set(GROUPS) == set(schema.SCHEMAS)  # (a new group would be missing from the page)
    for group, schemas in schema.SCHEMAS.items():
        for cls in schemas.values():
            for key, _, default, doc, allowed in keys(cls):
                row = f"| `{group}.{key}` |"
                assert row in text, row
                about = doc.replace("``", "`").replace("|", "\\|")
                assert any(
                    ln.startswith(row)
                    and f" {shown(default)} | {allowed.replace(bar, escaped)} |" in ln
                    and about in ln
                    for ln in text.splitlines()
                ), (group, key, shown(default), about)  # (keys of one name in two schemas: the row of each)
    # each option with the schema it is, and what it sets beyond the schema's defaults
    assert "| `ckpt=async_dcp_pinned` | `AsyncCkpt` |" in text and "`pinned=true`" in text
    assert "| `trainer.preempt_grace_seconds` | float | `30.0` | >= 0 |" in text
    assert "| `loader.num_workers` | int | `2` | integer >= 0 |" in text
    assert "| `fault.step` | int | required |" in text
