"""The help formatter of the build and index CLIs."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Description and epilog kept as written; every option's default shown (help texts
    that explain their default themselves, and flags that default to off, are left as
    they are)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "default" not in text
            and action.default not in (None, False, argparse.SUPPRESS)
            and action.option_strings
            and action.nargs != 0
        ):
            text += " (default: %(default)s)"
        return text
