"""README.md has the commands tests/system/test_readme.py runs (extracted from its fenced blocks and inline code
the same way).
"""

from __future__ import annotations


from conftest import readme_commands, ROOT

README = ROOT / "README.md"


COMMANDS = readme_commands()


def test_the_readme_has_the_commands_this_test_runs():
    assert len(COMMANDS) >= 20 and COMMANDS[0] == "python -m recipe.prepare"
    assert any("strategy=ddp" in c for c in COMMANDS) and any("strategy=fsdp" in c for c in COMMANDS)
