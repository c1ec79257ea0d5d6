"""Split ``fabric run model`` command lines into the CLI's own options and the script's arguments.

The rule (Lightning's): the CLI's own options count wherever they appear before a ``--``, also after
SCRIPT, so ``fabric run model train.py --devices=2`` starts two processes. Everything after ``--``,
every option the CLI does not know that follows SCRIPT, and every plain word after SCRIPT goes to the
script untouched and in order. An unknown option *before* SCRIPT is an error naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import click


@dataclass(frozen=True)
class OptionNames:
    """The option strings a command knows, split by whether they take a value."""

    flags: frozenset[str]
    valued: frozenset[str]

    @classmethod
    def of(cls, params: Sequence[click.Parameter]) -> OptionNames:
        flags: set[str] = set()
        valued: set[str] = set()
        for param in params:
            if isinstance(param, click.Option):
                names = [*param.opts, *param.secondary_opts]
                (flags if param.is_flag or param.count else valued).update(names)
        return cls(frozenset(flags), frozenset(valued))

    def tokens_taken(self, token: str, following: str | None) -> int:
        """How many tokens the CLI option starting at ``token`` spans (0: ``token`` is not one of ours)."""
        if token.startswith("--"):
            name, has_value, _ = token.partition("=")
            if name in self.valued:
                return 1 if has_value or following is None else 2
            return 1 if name in self.flags else 0
        if not token.startswith("-") or len(token) < 2:
            return 0
        for index, letter in enumerate(token[1:], start=2):  # a cluster such as -vm, or -n2
            if f"-{letter}" in self.valued:
                return 1 if index < len(token) or following is None else 2
            if f"-{letter}" not in self.flags:
                return 0
        return 1


def split_arguments(names: OptionNames, args: Sequence[str]) -> tuple[list[str], list[str]]:
    """``args`` -> (the CLI's own tokens ending with SCRIPT, the script's arguments)."""
    own: list[str] = []
    script_args: list[str] = []
    have_script = False
    index = 0
    while index < len(args):
        token = args[index]
        if token == "--":
            rest = list(args[index + 1 :])
            if not have_script and rest:
                own.append(rest.pop(0))
            script_args += rest
            break
        taken = names.tokens_taken(token, args[index + 1] if index + 1 < len(args) else None)
        if taken:
            own += args[index : index + taken]
            index += taken
            continue
        if have_script:
            script_args.append(token)
        else:
            own.append(token)  # SCRIPT, or an unknown option that click reports by name
            have_script = not token.startswith("-") or token == "-"
        index += 1
    return own, script_args


class ScriptCommand(click.Command):
    """A click command ``[OPTIONS] SCRIPT [SCRIPT_ARGS]...`` whose options may also follow SCRIPT."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        own, script_args = split_arguments(OptionNames.of(self.get_params(ctx)), args)
        return super().parse_args(ctx, [*own, "--", *script_args])


class DefaultCommandGroup(click.Group):
    """A group that runs ``default_command`` when the first word is not one of its commands.

    ``fabric run train.py --devices 2`` is then ``fabric run model train.py --devices 2``.
    """

    default_command = "model"

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ctx.help_option_names:
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)
