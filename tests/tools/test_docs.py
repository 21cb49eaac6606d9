"""The README, the configuration page and docker/compose.yaml say what the code does."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from llmq.cli import build_parser
from llmq.tools.settings_doc import BEGIN, END, PAGE, settings_table, undocumented

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_page_is_generated_from_settings():
    page = (ROOT / PAGE).read_text()
    section = page.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert section == settings_table(), "run: python -m llmq.tools.settings_doc --write"


def test_every_setting_has_its_description():
    """A setting added without a description would reach the page as an empty row."""
    assert undocumented() == [], "give each of these a Field(description=...)"


def test_readme_shows_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert "make up" in readme and "make test" in readme


def _commands(compose: dict):
    for name, service in compose["services"].items():
        command = service.get("command")
        if command:
            yield name, command if isinstance(command, list) else shlex.split(command)
        test = (service.get("healthcheck") or {}).get("test")
        if test and test[0] == "CMD-SHELL":
            yield name, shlex.split(test[1])


def test_compose_commands_exist_in_the_cli():
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    assert {"redis", "api", "worker", "flower"} <= set(compose["services"])
    parser = build_parser()
    checked = 0
    for name, argv in _commands(compose):
        if argv[0] == "llmq":
            try:
                parser.parse_args(argv[1:])
            except SystemExit as exc:  # argparse exits on an unknown verb or flag
                pytest.fail(
                    f"service {name}: `{' '.join(argv)}` is not a valid llmq command ({exc})"
                )
            checked += 1
        elif argv[0] == "celery":
            app = argv[argv.index("-A") + 1]
            module = __import__(app, fromlist=["app"])
            assert hasattr(module, "app"), f"service {name}: {app} has no Celery app"
            checked += 1
    assert checked >= 4


def test_compose_redis_has_aof_and_password():
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    command = " ".join(compose["services"]["redis"]["command"])
    assert "--appendonly yes" in command and "requirepass" in command


def test_compose_ships_no_default_secret_and_puts_none_in_argv():
    """Every secret must be given (`${VAR:?...}`: compose refuses to start without it), and no
    command line carries one (`ps` shows argv to every local user)."""
    text = (ROOT / "docker" / "compose.yaml").read_text()
    secrets = ("REDIS_PASSWORD", "LLMQ_API_KEY", "FLOWER_PASSWORD")
    for name in secrets:
        uses = [u for u in text.split("${")[1:] if u.startswith(name)]
        assert uses and all(u.startswith(f"{name}:?") for u in uses), (name, uses)
    assert "change-me" not in text and "--requirepass" not in text and " -a " not in text
    compose = yaml.safe_load(text)
    for name, argv in _commands(compose):
        assert not any("PASSWORD" in a or "API_KEY" in a for a in argv if "$$" not in a), name
    worker = compose["services"]["worker"]
    assert worker["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
