"""Bash completion: generated from the commands' definitions, and tried in a real bash."""
import re
import subprocess
from pathlib import Path
from typing import List

import pytest

from cudawrap.cli import Cudawrap
from cudawrap.cli.admin import CreateCudawrap
from cudawrap.cli.completion import specs
from cudawrap.policy.config import FOREIGN_RULES, PLACEMENTS

FILE = Path(__file__).parent.parent / "packaging" / "cudawrap.bash-completion"
FUNCTIONS = {"cudawrap": "_cudawrap", "create-cudawrap": "_create_cudawrap"}


def complete(*words: str) -> List[str]:
    """What bash offers for WORDS, the last being the word under the cursor."""
    script = f'source "{FILE}"; COMP_WORDS=("$@"); COMP_CWORD=$(( $# - 1 )); {FUNCTIONS[words[0]]}; ' \
             'printf "%s\\n" "${COMPREPLY[@]}"'
    done = subprocess.run(["bash", "-c", script, "bash", *words], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and not done.stderr, done.stderr
    return [line for line in done.stdout.splitlines() if line]


@pytest.mark.parametrize("words, offered, not_offered", [
    (("cudawrap", "status", "--"), {"--json", "--watch", "--count", "--help"}, {"--help-all", "--repair"}),
    (("cudawrap", "usage", "--"), {"--since", "--until", "--by", "--json", "--plot"}, {"--watch"}),
    (("cudawrap", "drain", "--"), {"--reason", "--wait"}, {"--json"}),
    (("cudawrap", "run", "-n", "2", "--"), {"--gpus", "--wait", "--model", "--share", "--substitute"}, {"--json"}),
    (("cudawrap", "mps", "status", "--"), {"--json"}, {"--help-all"}),
    (("cudawrap", "wrap", "--"), {"--gpus", "--placement", "--force"}, {"--json"}),
    (("cudawrap", "--"), {"--help-all", "--debug", "--version"}, {"--json"}),
    (("create-cudawrap", "--"), {"--gpus", "--wait", "--placement", "--model", "--force", "--share"}, {"--json"}),
    (("create-cudawrap", "--gpus", "2", "--f"), {"--force", "--foreign"}, {"--gpus"}),
], ids=["status", "usage", "drain", "run-after-a-value", "mps-status", "wrap", "top", "create", "create-after-a-value"])
def test_switches_of_each_command(words, offered, not_offered):
    got = set(complete(*words))
    assert offered <= got, got
    assert not got & not_offered, got


@pytest.mark.parametrize("words, expected", [
    (("cudawrap", "st"), ["status"]),
    (("cudawrap", "--debug", "st"), ["status"]),
    (("cudawrap", "mps", "s"), ["start", "status", "stop"]),
    (("cudawrap", "usage", "--by", "p"), ["program"]),
    (("cudawrap", "wrap", "--placement", ""), list(PLACEMENTS)),
    (("create-cudawrap", "--foreign", ""), list(FOREIGN_RULES)),
    (("cudawrap", "--completions", ""), ["bash", "fish"]),
    (("cudawrap", "drain", "--reason", "list", "--w"), ["--wait"]),  # a switch's value is no command
    (("create-cudawrap", "--model", ""), []),  # any value: bash's file names (complete -o default)
    (("cudawrap", "run", "--", "python", "--"), []),  # the command's own arguments
    (("cudawrap", "status", ""), []),
])
def test_subcommands_and_values(words, expected):
    assert complete(*words) == expected


def test_every_switch_and_subcommand_of_the_definitions_is_offered():
    for app, program in ((Cudawrap, "cudawrap"), (CreateCudawrap, "create-cudawrap")):
        for spec in specs(app, program):
            path = spec.path.split()
            assert set(complete(program, *path, "-")) == set(spec.switches), (program, path)
            if spec.subcommands:
                assert complete(program, *path, "") == spec.subcommands


def test_the_file_runs_no_program_and_loads_for_both_commands():
    text = FILE.read_text()
    assert set(re.findall(r"\$\((\w+)", text)) == {"compgen"}  # no `create-cudawrap --complete`
    done = subprocess.run(["bash", "-c", f'source "{FILE}"; complete -p cudawrap create-cudawrap'],
                          capture_output=True, text=True, timeout=30)
    assert done.stdout.splitlines() == ["complete -o default -F _cudawrap cudawrap",
                                        "complete -o default -F _create_cudawrap create-cudawrap"]
