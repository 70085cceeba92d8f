"""The README's "From nothing to a fleet" commands stay true to the code: every ``pfl-edge`` command line in it
parses with the real CLI parser (a renamed or removed flag fails here, not on a new user's machine), and the
federation its curl creates is a valid ``FederationCreate`` with a valid config."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from pfl_edge.cli.parser import build_parser
from pfl_edge.federation import FederationConfig, check_device_config
from pfl_edge.protocol import FederationCreate

README = Path(__file__).resolve().parents[1] / "README.md"


def _section() -> str:
    text = README.read_text()
    start = text.index("## From nothing to a fleet")
    return text[start:text.index("\n## ", start + 1)]


def _shell_lines(section: str) -> list[str]:
    """The sh blocks' commands, continuation lines joined, comments dropped."""
    lines: list[str] = []
    for block in re.findall(r"```sh\n(.*?)```", section, flags=re.S):
        for cmd in block.replace("\\\n", " ").splitlines():
            cmd = cmd.split(" #", 1)[0].strip()
            if cmd and not cmd.startswith("#"):
                lines.append(cmd)
    return lines


def _pfl_edge_commands(section: str) -> list[list[str]]:
    cmds = [line for line in _shell_lines(section) if line.startswith("pfl-edge ")]
    # inline ones: `pfl-edge report --server ... --out report/` (a backquoted span may wrap lines)
    cmds += [" ".join(m.split()) for m in re.findall(r"`(pfl-edge [^`]+)`", section) if "RUN_DIR" not in m]
    return [shlex.split(c)[1:] for c in cmds]


def test_every_pfl_edge_command_in_the_walkthrough_parses() -> None:
    cmds = _pfl_edge_commands(_section())
    assert {c[0] for c in cmds} >= {"bundle", "report"}, cmds
    parser = build_parser()
    for argv in cmds:
        try:
            parser.parse_args(argv)
        except SystemExit as e:  # argparse exits on an unknown or malformed flag
            pytest.fail(f"README command does not parse ({e.code}): pfl-edge {' '.join(argv)}")


def test_a_broken_flag_would_be_caught() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bundle", "--server", "http://x", "--federation", "f", "--profile", "p",
                                   "--out", "o", "--no-such-flag"])


def test_the_walkthrough_federation_is_valid() -> None:
    section = _section()
    body = re.search(r"-d '(\{.*?\})'", section, flags=re.S)
    assert body is not None, "the curl that creates the federation is gone"
    create = FederationCreate.model_validate(json.loads(body.group(1)))
    cfg = FederationConfig.from_dict(dict(create.config))
    check_device_config(cfg)
    # the enrolment secret step 2 writes for the bundle is the one the federation is created with
    assert f"'{create.enrol_secret}' > enrol-secret" in section


def _boards_section() -> str:
    text = (README.parent / "docs" / "operations.md").read_text()
    start = text.index("#### Boards")
    after = re.search(r"\n#{2,4} ", text[start + 1:])
    return text[start:start + 1 + after.start()] if after else text[start:]


def test_the_board_recipes_commands_parse() -> None:
    """docs/operations.md's Boards recipes (a real board, an emulated one): every ``pfl-edge`` line parses with the
    CLI and every ``bench/boards.py`` line with that tool's parser; the emulated board is built, filled and run by
    the functions tests/integration/test_boards.py drives (rootfs, copy_in, run)."""
    import importlib
    import sys

    section = _boards_section()
    lines = _shell_lines(section)
    pfl = [shlex.split(c)[1:] for c in lines if c.startswith("pfl-edge ")]
    assert pfl and pfl[0][0] == "bundle" and "--torch-free" in pfl[0]
    for argv in pfl:
        build_parser().parse_args(argv)
    bench = str(README.parent / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    boards = importlib.import_module("boards")
    cmds = [shlex.split(c)[2:] for c in lines if c.startswith("python3 bench/boards.py ")]
    assert [c[0] for c in cmds] == ["check", "build", "copy", "shell", "shell"], cmds
    for argv in cmds:
        assert boards.build_parser().parse_args(argv).cmd == argv[0]
    assert "/proc/cpuinfo" in section and "mmdebstrap" in section
