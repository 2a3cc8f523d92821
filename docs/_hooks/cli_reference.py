"""mkdocs hook: the `tensorstore-py` command reference, generated from its argparse parser."""

from __future__ import annotations

import argparse
from typing import Any

MARKER = "<!-- cli-help -->"


def cli_reference() -> str:
    from tensorstore_py.cli import build_parser

    parser = build_parser()
    parts = ["## tensorstore-py\n", "```text", parser.format_help().rstrip(), "```\n"]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                parts += [f"## tensorstore-py {name}\n", "```text", sub.format_help().rstrip(), "```\n"]
    return "\n".join(parts)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, cli_reference())
    return markdown
