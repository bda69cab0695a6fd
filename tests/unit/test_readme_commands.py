"""README.md and the guides have the commands tests/system/test_readme.py runs (extracted from their fenced blocks
and inline code the same way).
"""

from __future__ import annotations


from conftest import readme_commands, ROOT

README = ROOT / "README.md"


COMMANDS = readme_commands()


def test_the_readme_has_the_commands_this_test_runs():
    assert len(COMMANDS) >= 20 and COMMANDS[0] == "python -m recipe.prepare"
    assert any("strategy=ddp" in c for c in COMMANDS) and any("strategy=fsdp" in c for c in COMMANDS)


def test_the_readme_is_short_and_links_every_guide_of_the_site_in_one_click():
    from conftest import manual_pages

    text = README.read_text()
    assert len(text.splitlines()) <= 200
    guides = sorted(p.name for p in (ROOT / "docs" / "guides").glob("*.md"))
    assert set(guides) <= {p.name for p in manual_pages()[1:]}  # (every guide is on the site, in its nav)
    for name in guides:
        assert f"](docs/guides/{name})" in text, name
