"""`--help` works for every command a user runs: spotcr and each of its subcommands, the rehearsal, the benchmarks."""

import argparse
import subprocess
import sys
from collections.abc import Iterator

import pytest
from spotcr_cli.main import build_parser

import bench.__main__ as bench


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every command path of the parser, found in its subparsers (so a new command is covered without a list)."""
    yield path
    for action in parser._actions:  # argparse keeps its subparsers only here
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                yield from _commands(subparser, (*path, name))


SPOTCR_COMMANDS = sorted(_commands(build_parser()))


def test_the_spotcr_parser_has_its_commands():
    assert {("plan",), ("submit",), ("status",), ("restore",)} <= set(SPOTCR_COMMANDS)


@pytest.mark.parametrize("command", SPOTCR_COMMANDS, ids=lambda path: " ".join(("spotcr", *path)))
def test_spotcr_help_prints_usage(command, capsys):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([*command, "--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {' '.join(('spotcr', *command))}")


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "spotcr_cli", "--help"],
        ["-m", "rehearsal", "--help"],
        ["-m", "bench", "--help"],
        *(["-m", "bench", name, "--help"] for name in (*bench.BENCHMARKS, *bench.GPU_BENCHMARKS)),
    ],
    ids=" ".join,
)
def test_module_help_prints_usage(argv):
    ran = subprocess.run([sys.executable, *argv], capture_output=True, text=True, check=False, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.startswith("usage: "), ran.stdout
