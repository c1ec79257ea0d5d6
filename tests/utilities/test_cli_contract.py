"""The Fabric choices are listed once (:data:`~fabric.utilities.cli_contract.FABRIC_CHOICES`), and so are the values
each accepts (the registries): ``Fabric``, the connector, the Trainer, the CLI and the docs all agree with those lists.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import click
import pytest
from torch import nn

from fabric import Fabric
from fabric.accelerators.registry import accelerator_choices
from fabric.connector import SETTINGS, pick_settings, resolve
from fabric.plugins.precision.dtypes import PRECISION_DTYPES
from fabric.plugins.precision.registry import PRECISION_REGISTRY, parse_precision
from fabric.strategies.registry import strategy_choices
from fabric.trainer.migration import translate_fabric_choices
from fabric.trainer.trainer import Trainer
from fabric.utilities.cli_contract import CLI_SETTINGS, FABRIC_CHOICES
from fabric.utilities.device_parser import ACCEPTED_DEVICES, parse_devices
from fabric_cli.cli import run_model

ROOT = Path(__file__).resolve().parents[2]

#: The choices that take one of a list of names, with that list.
NAMED_VALUES: dict[str, list[str]] = {
    "accelerator": accelerator_choices(),
    "strategy": strategy_choices(),
    "precision": PRECISION_REGISTRY.choices(),
}

#: ``Fabric(...)``'s arguments that are objects to use, not choices to resolve.
FABRIC_OBJECT_ARGUMENTS = {"plugins", "callbacks", "loggers"}

NOT_GIVEN = {setting.name: setting.default for setting in SETTINGS}


def test_fabric_and_the_connector_take_the_choices_in_order_with_the_connectors_defaults() -> None:
    """A default that differs from the connector's "not given" would make the CLI's value lose to it."""
    fabric_parameters = inspect.signature(Fabric).parameters
    resolve_parameters = inspect.signature(resolve).parameters
    assert [setting.name for setting in SETTINGS] == list(FABRIC_CHOICES)
    assert [name for name in fabric_parameters if name not in FABRIC_OBJECT_ARGUMENTS] == list(FABRIC_CHOICES)
    assert list(resolve_parameters)[: len(FABRIC_CHOICES)] == list(FABRIC_CHOICES)
    for name in FABRIC_CHOICES:
        assert fabric_parameters[name].default == resolve_parameters[name].default == NOT_GIVEN[name], name


def test_the_cli_has_an_option_and_a_variable_per_choice_offering_exactly_the_accepted_names() -> None:
    options = {param.name: param for param in run_model.params}
    assert set(FABRIC_CHOICES) <= set(options)
    assert list(CLI_SETTINGS) == list(FABRIC_CHOICES)
    for name, accepted in NAMED_VALUES.items():
        choice = options[name].type
        assert isinstance(choice, click.Choice), name
        assert list(choice.choices) == accepted


@pytest.mark.parametrize("choice", NAMED_VALUES)
def test_the_connector_accepts_every_listed_name_and_names_them_all_when_refusing(choice: str) -> None:
    for value in NAMED_VALUES[choice]:
        pick_settings({**NOT_GIVEN, choice: value}, environ={})
    with pytest.raises(ValueError) as error:
        pick_settings({**NOT_GIVEN, choice: "unheard-of"}, environ={})
    accepted = ", ".join(map(repr, NAMED_VALUES[choice]))
    assert str(error.value) == f"Unknown {choice} 'unheard-of'. Accepted values: {accepted}."


def test_the_trainer_passes_on_exactly_the_fabric_choices() -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    for name in FABRIC_CHOICES:  # taken as a Fabric choice: refused only because a Fabric is given too
        with pytest.raises(ValueError, match="either fabric= or the Fabric choices"):
            Trainer(model=nn.Linear(2, 2), fabric=fabric, **{name: NOT_GIVEN[name]})
    with pytest.raises(TypeError) as error:
        Trainer(model=nn.Linear(2, 2), not_a_choice=1)
    assert f"Fabric choices are {list(FABRIC_CHOICES)}" in str(error.value)


def test_every_precision_name_has_its_dtype() -> None:
    assert list(PRECISION_DTYPES) == PRECISION_REGISTRY.names()


def _backticked(text: str) -> set[str]:
    """The values written in backticks in ``text``, without their quotes."""
    return {value.strip('"') for value in re.findall(r"`([^`]+)`", text)}


def test_the_choices_page_lists_every_choice_with_every_accepted_name() -> None:
    page = (ROOT / "docs" / "choices.md").read_text()
    rows = {match[1]: match[2] for match in re.finditer(r"^\| `(\w+)` \| (.*) \|$", page, re.MULTILINE)}
    assert set(FABRIC_CHOICES) <= set(rows)
    for name, accepted in NAMED_VALUES.items():
        assert set(accepted) <= _backticked(rows[name]), name
    for variable in CLI_SETTINGS.values():
        assert f"`{variable}`" in page


def test_the_docstrings_name_every_choice_and_their_values() -> None:
    fabric_doc = inspect.getdoc(Fabric) or ""
    trainer_doc = inspect.getdoc(Trainer) or ""
    for name in FABRIC_CHOICES:
        assert f"{name}:" in fabric_doc and f"``{name}``" in trainer_doc, name
    for value in [*accelerator_choices(), *PRECISION_REGISTRY.names()]:
        assert f'``"{value}"``' in fabric_doc, value
    composer_spellings = re.search(r"precision also takes Composer's (.*?)\)", trainer_doc, re.DOTALL)
    assert composer_spellings is not None
    for spelling in re.findall(r'``"([^"]+)"``', composer_spellings[1]):
        translated: dict[str, Any] = translate_fabric_choices({"precision": spelling}, None, None)
        assert parse_precision(translated["precision"]) in PRECISION_REGISTRY.names(), spelling


def _devices_descriptions() -> dict[str, str]:
    """Every place that tells users which ``devices`` values are accepted, by where it is."""
    fabric_doc = inspect.getdoc(Fabric) or ""
    docstring_line = next(line for line in fabric_doc.splitlines() if line.strip().startswith("devices:"))
    cli_option = next(param for param in run_model.params if param.name == "devices")
    page = (ROOT / "docs" / "choices.md").read_text()
    page_row = next(line for line in page.splitlines() if line.startswith("| `devices` |"))
    return {
        "the parser's error message": ACCEPTED_DEVICES,
        "Fabric's docstring": docstring_line,
        "fabric run's --devices help": getattr(cli_option, "help", None) or "",
        "docs/choices.md": page_row,
    }


def test_every_description_of_devices_names_the_forms_the_parser_accepts() -> None:
    """The accepted ``devices`` forms are written in four places: each names all, and each example parses."""
    for where, text in _devices_descriptions().items():
        for form in ("-1", "0,1", "auto"):
            assert form in text, f"{where} does not mention devices={form!r}: {text}"
    for example in ("2", "0,1", "auto", [0, 1], -1, 3):
        parse_devices(example)  # raises on a form the descriptions promise but the parser refuses
    with pytest.raises(ValueError) as refused:
        parse_devices("cuda:0")
    assert ACCEPTED_DEVICES in str(refused.value)
