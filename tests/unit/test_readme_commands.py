"""README.md has the commands tests/system/test_readme.py runs (extracted from its fenced blocks and inline code
the same way).
"""

from __future__ import annotations

import re

from conftest import ROOT

README = ROOT / "README.md"


def readme_commands() -> list[str]:
    text = README.read_text()
    cmds: list[str] = []
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.split(r"\s#\s", line, maxsplit=1)[0].strip()
            if line.startswith("python -m "):
                cmds.append(line)
    for inline in re.findall(r"`(python -m [^`]+)`", text):
        cmds.append(inline.strip())
    return cmds


COMMANDS = readme_commands()


def test_the_readme_has_the_commands_this_test_runs():
    assert len(COMMANDS) >= 20 and COMMANDS[0] == "python -m recipe.prepare"
    assert any("strategy=ddp" in c for c in COMMANDS) and any("strategy=fsdp" in c for c in COMMANDS)
