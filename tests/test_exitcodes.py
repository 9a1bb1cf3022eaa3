"""Every exit code README.md (and docs/admin/install.md, for install.sh) documents is the one
the programs' own --help lists and the one they return: the lists cannot drift apart again."""
import os
import re
import subprocess
import sys

from cudawrap.cli.manpages import exit_codes
from support.installsh import SOURCE, clean_env, install_sh

README = (SOURCE / "README.md").read_text(encoding="utf-8")
INSTALL_DOC = (SOURCE / "docs" / "admin" / "install.md").read_text(encoding="utf-8")


def codes_in(text: str) -> set:
    """The numbers that open each item of an exit-code list: "64 bad option, 65 ..."."""
    return {int(n) for n in re.findall(r"(?:^|[:,;.]\s+|\s)(\d{1,3})\s+(?=[a-z`(])", text)}


def readme_install_codes() -> set:
    para = INSTALL_DOC.split("`./install.sh --help` lists the exit codes:", 1)[1].split("\n\n", 1)[0]
    return codes_in(" " + para.split("; otherwise", 1)[0])  # then those of cudawrap's commands


def readme_table_codes() -> dict:
    """The 'What users see' table: code -> its meaning."""
    section = README.split("## What users see", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+)(?:, or the program's own)? \| (.*) \|$", section, re.M)
    return {int(code): meaning for code, meaning in rows}


def test_install_sh_help_and_readme_list_the_same_codes():
    r = install_sh("--help", env=clean_env())
    helped = codes_in(" " + " ".join(r.stdout.split("Exit codes:", 1)[1].split("other codes are", 1)[0].split()))
    assert 74 in helped
    assert readme_install_codes() == helped - {0}


def test_readme_table_and_the_error_classes_agree():
    table = readme_table_codes()
    classes = set(exit_codes())
    assert set(table) - {0} == classes, (sorted(table), sorted(classes))


def test_cudawrap_help_lists_every_code():
    r = subprocess.run([sys.executable, "-c", "from cudawrap.cli import main; main()", "--help"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    listed = {int(n) for n in re.findall(r"(\d+): ", " ".join(r.stdout.split("Exit codes:", 1)[1].split()))}
    assert listed == {0} | set(readme_table_codes())


def test_behaviour_matches_the_documented_meaning(installed, tmp_path):
    inst = installed("four-gpus")
    table = readme_table_codes()

    r = inst.cli("wrap", str(tmp_path / "nonexistent"))
    assert r.returncode == 65, r.stderr
    assert b"no such file" in r.stderr and "`create-cudawrap /nonexistent`: no such file" in table[65]

    r = inst.cli("status", "--frobnicate")
    assert r.returncode == 64 and "a bad switch or argument" in table[64]

    recon = inst.wrap("recon")
    r = inst.run(str(recon), CUDAWRAP_WAIT="soon")
    assert r.returncode == 64 and "a bad `CUDAWRAP_WAIT`" in table[64]

    inst.machine.set_fault("driver_not_loaded")
    r = inst.cli("status")
    assert r.returncode == 69, r.stderr
    assert r.stdout.decode().startswith(f"install root {inst.layout.root}: devices unknown")
    assert len(r.stderr.decode().splitlines()) == 2  # one line and a hint
    assert "`cudawrap status` without a driver" in table[69]
    r = inst.cli("sync")
    assert r.returncode == 69 and "`cudawrap sync`" in table[69]

    inst.layout.config_file.write_text("[policy]\ngpus = 'many'\n")
    r = inst.run(str(recon))
    assert r.returncode == 78 and "configuration file is broken" in table[78]
    inst.layout.config_file.unlink()

    os.unlink(inst.bindir / "CUDAWRAP_recon")
    r = inst.run(str(recon))
    assert r.returncode == 127 and "the real program is missing" in table[127]
