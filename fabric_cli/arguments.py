"""Split ``fabric run model`` command lines into the CLI's own options and the script's arguments.

The rule: before SCRIPT every option is the CLI's (an unknown one is an error naming it). After SCRIPT,
the CLI's *long* options still count, as Lightning's documented ``fabric run model train.py --devices=2``
needs; short ones (``-v``, ``-n 2``, ``-c cfg.yaml``, ``-m``) belong to the script, whose own flags
they usually are. Everything after ``--``, every option the CLI does not know and every plain word after
SCRIPT go to the script untouched and in order. A long option given both before SCRIPT and after it has
two possible meanings (a second value for the CLI, or the script's own option of that name) and is an
error naming both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import click
from typing_extensions import override


@dataclass(frozen=True)
class OptionNames:
    """The option strings a command knows, split by whether they take a value, and whose each is."""

    flags: frozenset[str]
    valued: frozenset[str]
    owners: Mapping[str, str]  # option string -> the parameter it sets

    @classmethod
    def of(cls, params: Sequence[click.Parameter]) -> OptionNames:
        flags: set[str] = set()
        valued: set[str] = set()
        owners: dict[str, str] = {}
        for param in params:
            if isinstance(param, click.Option):
                names = [*param.opts, *param.secondary_opts]
                (flags if param.is_flag or param.count else valued).update(names)
                owners.update(dict.fromkeys(names, param.name or names[0]))
        return cls(frozenset(flags), frozenset(valued), owners)

    def tokens_taken(self, token: str, following: str | None, after_script: bool = False) -> int:
        """How many tokens the CLI option starting at ``token`` spans (0: ``token`` is not one of ours).

        After SCRIPT only long options are ours.
        """
        if token.startswith("--"):
            name, has_value, _ = token.partition("=")
            if name in self.valued:
                return 1 if has_value or following is None else 2
            return 1 if name in self.flags else 0
        if after_script or not token.startswith("-") or len(token) < 2:
            return 0
        for index, letter in enumerate(token[1:], start=2):  # a cluster such as -vm, or -n2
            if f"-{letter}" in self.valued:
                return 1 if index < len(token) or following is None else 2
            if f"-{letter}" not in self.flags:
                return 0
        return 1

    def owner(self, token: str) -> str | None:
        """The parameter a long option token sets (``--devices=2`` -> ``devices``)."""
        return self.owners.get(token.partition("=")[0]) if token.startswith("--") else None


def split_arguments(names: OptionNames, args: Sequence[str]) -> tuple[list[str], list[str]]:
    """``args`` -> (the CLI's own tokens ending with SCRIPT, the script's arguments).

    Raises ``click.UsageError`` for a long option given both before and after SCRIPT.
    """
    own: list[str] = []
    script_args: list[str] = []
    script: str | None = None
    before_script: dict[str, str] = {}  # parameter -> the token that set it before SCRIPT
    index = 0
    while index < len(args):
        token = args[index]
        if token == "--":
            rest = list(args[index + 1 :])
            if script is None and rest:
                own.append(rest.pop(0))
            script_args += rest
            break
        following = args[index + 1] if index + 1 < len(args) else None
        taken = names.tokens_taken(token, following, after_script=script is not None)
        if taken:
            owner = names.owner(token)
            if script is None and owner is not None:
                before_script.setdefault(owner, token)
            elif owner in before_script:
                raise click.UsageError(_given_twice(before_script[owner], args[index : index + taken], script))
            own += args[index : index + taken]
            index += taken
            continue
        if script is not None:
            script_args.append(token)
        else:
            own.append(token)  # SCRIPT, or an unknown option that click reports by name
            if not token.startswith("-") or token == "-":
                script = token
        index += 1
    return own, script_args


def _given_twice(first: str, again: Sequence[str], script: str | None) -> str:
    option = again[0].partition("=")[0]
    return (
        f"{option} is given before SCRIPT ({first}, for fabric run model) and again after {script} "
        f"({' '.join(again)}), where it means either a second value for fabric run model or {script}'s own "
        f"{option}. Give the CLI's once, before or after SCRIPT; pass the script's after `--`: "
        f"fabric run model {first} {script} -- {' '.join(again)}."
    )


class ScriptCommand(click.Command):
    """A click command ``[OPTIONS] SCRIPT [SCRIPT_ARGS]...`` whose options may also follow SCRIPT."""

    @override
    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        own, script_args = split_arguments(OptionNames.of(self.get_params(ctx)), args)
        return super().parse_args(ctx, [*own, "--", *script_args])


class DefaultCommandGroup(click.Group):
    """A group that runs ``default_command`` when the first word is not one of its commands.

    ``fabric run train.py --devices 2`` is then ``fabric run model train.py --devices 2``.
    """

    default_command = "model"

    @override
    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ctx.help_option_names:
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)
