"""MkDocs hook: pages that say ``<!-- generated: config-reference -->`` get the config reference, rendered at build
time from the schemas and conf/ (pitstop.config.reference), so it cannot drift from the code."""

from __future__ import annotations

import os

MARK = "<!-- generated: config-reference -->"


def on_page_markdown(markdown, page, config, files):  # noqa: ANN001, ANN201 - MkDocs' hook signature
    if MARK not in markdown:
        return markdown
    from pitstop.config.reference import render

    conf = os.path.join(os.path.dirname(config["config_file_path"]), "conf")
    return markdown.replace(MARK, render(conf))
