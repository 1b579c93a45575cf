"""Every command the docs show (README.md and docs/*.md, their bash blocks) is one this checkout still takes: each
`rlpipe` command parses against the CLI (the subcommand exists, every option and argument is accepted), each config of
the repository it names loads with its `--set` and `--algo`, each `make` target exists, each `python` script or module
exists. Running them all is `make test-long`'s and the benches' business; this catches a renamed flag, key or file."""

from __future__ import annotations

import importlib.util
import re
import shlex

import pytest
import typer
from typer._click.exceptions import ClickException

from flows.cli import app
from schemas.config import load_config
from tests.conftest import ROOT

SEPARATORS = {"&&", "||", ";", "|"}
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _statements(block: str):
    """A bash block's commands as token lists: continuations joined, a quote may span lines, `&&`/`;`/`|` split,
    a prompt (`node-a$`) and leading VAR=value assignments dropped, `...` (the docs' "and so on") left out."""
    pending = ""
    for line in block.replace("\\\n", " ").splitlines():
        pending += ("\n" if pending else "") + line
        try:
            tokens = shlex.split(pending, comments=True)
        except ValueError:  # a quote spans lines: read on
            continue
        pending, current = "", []
        for token in [*tokens, ";"]:
            if token in SEPARATORS:
                while current and (current[0].endswith("$") or re.match(r"^\w+=", current[0])):
                    current = current[1:]
                if current:
                    yield [t for t in current if t != "..."]
                current = []
            elif token.startswith(">"):  # a redirect ends the command's own arguments
                current.append("\0")
            else:
                current.append(token)


def _commands(program: str) -> list[tuple[str, list[str]]]:
    found = []
    for page in PAGES:
        for block in re.findall(r"```(?:bash|sh|console)\n(.*?)```", page.read_text(), re.S):
            for tokens in _statements(block):
                if tokens[0] == program:
                    found.append((page.name, tokens[1 : tokens.index("\0") if "\0" in tokens else None]))
    return found


RLPIPE = _commands("rlpipe")


def test_the_docs_show_commands():
    assert len(RLPIPE) > 50 and _commands("make")  # the parser still finds them


@pytest.mark.parametrize("page,args", RLPIPE, ids=[f"{p}:{' '.join(a)[:60]}" for p, a in RLPIPE])
def test_each_rlpipe_command_of_the_docs_parses_and_its_config_loads(page, args):
    cli = typer.main.get_command(app)
    try:
        command = cli.get_command(cli.make_context("rlpipe", list(args)), args[0])
        assert command is not None, f"{page}: no command `rlpipe {args[0]}`"
        params = command.make_context(args[0], args[1:]).params
    except ClickException as exc:
        raise AssertionError(f"{page}: rlpipe {' '.join(args)}: {exc.message}") from None
    config = params.get("config")
    if config and (ROOT / config).is_file():  # my_config.yaml and the like are the reader's own
        algo = {"algo": params["algo"]} if params.get("algo") else {}
        load_config(ROOT / config, list(params.get("overrides") or []), **algo)


def test_each_make_target_and_python_file_of_the_docs_exists():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    for page, args in _commands("make"):
        assert not args or args[0] in targets or "=" in args[0], f"{page}: make {args[0]}"
    for program in ("python", "python3", ".venv/bin/python"):
        for page, args in _commands(program):
            if args[:1] == ["-m"]:
                assert importlib.util.find_spec(args[1].split(".")[0]) is not None, f"{page}: python -m {args[1]}"
            elif args and args[0].endswith(".py"):
                assert (ROOT / args[0]).is_file(), f"{page}: python {args[0]}"
