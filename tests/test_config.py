"""The configuration: strict parsing with FILE:LINE, the generated default file, `cudawrap config`, exit 78."""
import json
import math
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cudawrap.policy.config import (
    DEFAULTS, DESCRIPTIONS, DEVICE_KEYS, FOREVER, OPS_SECTIONS, MAX_GPUS, MAX_WAIT_S, POLICY_KEYS, load_config, parse_config,
    parse_gpus, parse_wait, validate_policy,
)
from cudawrap.policy.defaults import CONFINED, render_config, sections, toml_value
from cudawrap.errors import ConfigError

P = Path("/etc/cudawrap/config.toml")


def parse(text: str):
    return parse_config(P, textwrap.dedent(text))


def refused(text: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse(text)
    assert info.value.exit_code == 78
    return info.value


def values(settings) -> dict:
    return {k: s.value for k, s in settings.items()}


# ---- parsing ---------------------------------------------------------------------------------


def test_missing_or_empty_file_means_defaults(tmp_path):
    for config in (load_config(tmp_path / "absent.toml"), parse(""), parse("# nothing\n\n")):
        assert values(config.settings) == DEFAULTS
        assert {s.source for s in config.settings.values()} == {"default"}


def test_values_and_their_lines():
    config = parse("""\
        # a comment
        [policy]
        gpus = 2
          wait="600"
        "placement" = 'pack'

        [devices]
        allow = ["GPU-5e7f6", "MIG-0a1b2c3d"]
        """)
    assert config["gpus"] == 2 and config.settings["gpus"].source == f"{P}:3"
    assert config["wait"] == 600.0 and config.settings["wait"].source == f"{P}:4"
    assert config["placement"] == "pack" and config.settings["placement"].source == f"{P}:5"
    assert config["allow"] == ("GPU-5e7f6", "MIG-0a1b2c3d") and config.settings["allow"].source == f"{P}:8"
    assert config.settings["foreign"].source == "default"


def test_unknown_key_names_file_line_key_and_the_known_keys():
    err = refused("""\
        [policy]
        gpus = 1
        gpu = 2
        """)
    assert err.message == f"{P}:3: unknown key 'gpu' in [policy]"
    assert "gpus" in err.hint and "wait" in err.hint


@pytest.mark.parametrize("text, message", [
    ('[policy]\ngpus = "two"\n', "2: bad value for 'gpus': 'two' is not a whole number of devices"),
    ("[policy]\ngpus = true\n", "2: bad value for 'gpus': True is not a whole number of devices"),
    ("[policy]\ngpus = 0\n", f"2: bad value for 'gpus': 0 is not between 1 and {MAX_GPUS}"),
    ('[policy]\nwait = "soon"\n', "2: bad value for 'wait': 'soon' is not a number of seconds or 'forever'"),
    ("[policy]\nwait = -5\n", "2: bad value for 'wait': -5 is not a number of seconds >= 0"),
    ('[policy]\nplacement = "fast"\n', "2: bad value for 'placement': 'fast' is not one of spread, pack, random"),
    ("[policy]\nbusy_memory_mib = -1\n", "2: bad value for 'busy_memory_mib': -1 is not a whole number >= 0"),
    ("[policy]\nno_driver = 1\n", "2: bad value for 'no_driver': 1 is not one of run, fail"),
    ('[devices]\nallow = "GPU-1"\n', "2: bad value for 'allow': expected a list of device UUID strings"),
    ('[devices]\nallow = ["nvidia0"]\n', "2: bad value for 'allow': 'nvidia0' is not a GPU-"),
    ('[devices]\nallow_file = "ids.txt"\n', "2: bad value for 'allow_file': 'ids.txt' is not an absolute path"),
    ("[devices]\ngpus = 2\n", "2: unknown key 'gpus' in [devices]"),
    ('[programs."recon"]\nallow = []\n', "2: unknown key 'allow' in [programs.\"recon\"]"),
], ids=["gpus-text", "gpus-bool", "gpus-zero", "wait-text", "wait-negative", "placement", "busy-negative",
        "no-driver-int", "allow-string", "allow-not-uuid", "allow-file-relative", "policy-key-in-devices",
        "device-key-per-program"])
def test_wrong_values_name_file_line_and_key(text, message):
    assert refused(text).message.startswith(f"{P}:{message}")


def test_bad_toml_says_where():
    err = refused("[policy]\ngpus = 1\nwait = \n")
    assert err.message.startswith(f"{P}: not valid TOML: ")
    assert "line 3" in err.message



def test_a_table_declared_twice_says_where_it_already_is_and_what_to_do():
    """Issue 51 item 8: not tomllib's bare "Cannot declare ('policy',) twice"."""
    err = refused("[policy]\ngpus = 1\n\n[policy]\nwait = 1\n")
    assert err.message == f"{P}:4: [policy] appears twice: it is already at line 1"
    assert err.hint == ("put these settings below the [policy] of line 1 and remove this [policy] line "
                        "(a TOML table may appear only once)")
    err = refused('[programs."my app"]\ngpus = 1\n[programs."my app"]\nwait = 1\n')
    assert err.message == f'{P}:3: [programs."my app"] appears twice: it is already at line 1'


def test_the_natural_edit_of_the_default_file_works():
    """Issue 51 item 8: a table and a key appended to the default file (its own headers are
    commented out, as its keys are), as an admin adds them; and a key uncommented without its
    table's header is told which line to uncomment."""
    for chosen in ({}, CONFINED):
        text = render_config(chosen) + "\n[policy]\ngpus = 2\n\n[ledger]\nmax_mib = 8\n"
        config = parse_config(P, text)
        assert config["gpus"] == 2 and config["max_mib"] == 8
    lines = render_config().splitlines()
    at = lines.index("#gpus = 1")
    lines[at] = "gpus = 2"
    err = refused("\n".join(lines))
    header = lines.index("#[policy]") + 1
    assert err.message == f"{P}:{at + 1}: 'gpus' belongs in [policy]"
    assert err.hint == f"remove the '#' before the #[policy] of line {header}, or put it below a [policy] line"
    lines[header - 1] = "[policy]"
    assert parse_config(P, "\n".join(lines))["gpus"] == 2


def test_unknown_section():
    err = refused("[policy]\ngpus = 1\n\n[polcy]\nwait = 1\n")
    assert err.message == f"{P}:4: unknown section [polcy]"
    assert "[policy]" in err.hint


def test_a_key_outside_any_section_is_refused():
    err = refused("gpus = 2\n")
    assert "gpus" in err.message and str(P) in err.message


def test_programs_must_hold_tables():
    err = refused("[programs]\ngpus = 2\n")
    assert "gpus" in err.message and "must be a table" in err.message


def test_per_program_override_precedence():
    config = parse("""\
        [policy]
        gpus = 2
        wait = 10
        [programs."recon"]
        wait = 20
        placement = "pack"
        [programs."/opt/app/bin/recon"]
        wait = 30
        """)
    by_path = config.for_program("/opt/app/bin/recon")
    assert by_path["wait"].value == 30 and by_path["wait"].source == f"{P}:8"  # the path beats the name
    assert by_path["placement"].value == "pack" and by_path["placement"].source == f"{P}:6"
    assert by_path["gpus"].value == 2 and by_path["gpus"].source == f"{P}:2"
    elsewhere = config.for_program("/srv/bin/recon")  # the same name elsewhere: the name's table
    assert elsewhere["wait"].value == 20 and elsewhere["wait"].source == f"{P}:5"
    other = config.for_program("/opt/app/bin/other")
    assert other["wait"].value == 10 and other["placement"].value == "spread"
    assert values(config.for_program(None)) == values(config.settings)


def test_line_numbers_follow_the_right_table():
    config = parse("""\
        #wait = 1
        [policy]
        # wait = 2
        wait = 10
        [ programs . "a" ]
        wait = 20
        [programs.'/x/a']
        gpus = 3
        wait = 30
        """)
    assert config.settings["wait"].source == f"{P}:4"
    assert config.programs["a"]["wait"].source == f"{P}:6"
    assert config.programs["/x/a"]["gpus"].source == f"{P}:8"
    assert config.programs["/x/a"]["wait"].source == f"{P}:9"
    err = refused("""\
        [programs."a"]
        wait = 1
        [programs."b"]
        gpus = 1
        wait = "later"
        """)
    assert err.message.startswith(f"{P}:5: bad value for 'wait'")


def test_policy_from_the_registry_is_checked_the_same_way():
    assert validate_policy({"gpus": 2, "wait": "forever"}, "registry")["wait"].value == FOREVER
    with pytest.raises(ConfigError, match="registry: unknown policy key 'allow'"):
        validate_policy({"allow": []}, "registry")
    with pytest.raises(ConfigError, match="registry: bad value for 'gpus'"):
        validate_policy({"gpus": 0}, "registry")


@pytest.mark.parametrize("raw, expected", [
    ("forever", FOREVER), ("FOREVER", FOREVER), (" inf ", FOREVER), ("none", FOREVER), ("infinity", FOREVER),
    (0, 0.0), ("0", 0.0), (" 15 ", 15.0), (1.5, 1.5), ("1e3", 1000.0), (MAX_WAIT_S, float(MAX_WAIT_S)),
    (MAX_WAIT_S + 1, FOREVER), (10 ** 30, FOREVER), (math.inf, FOREVER),
])
def test_parse_wait_accepts(raw, expected):
    assert parse_wait(raw) == expected


@pytest.mark.parametrize("raw", [-1, "-1", -0.5, "nan", math.nan, True, False, None, [], "", "abc", "10s", "1 0"])
def test_parse_wait_refuses(raw):
    with pytest.raises(ValueError):
        parse_wait(raw)


@given(st.floats(min_value=0, max_value=MAX_WAIT_S, allow_nan=False))
def test_parse_wait_keeps_any_reasonable_number(seconds):
    assert parse_wait(seconds) == seconds
    assert parse_wait(repr(seconds)) == seconds


@pytest.mark.parametrize("raw, expected", [(1, 1), (MAX_GPUS, MAX_GPUS), ("2", 2), (" 3 ", 3)])
def test_parse_gpus_accepts(raw, expected):
    assert parse_gpus(raw) == expected


@pytest.mark.parametrize("raw", [0, -1, MAX_GPUS + 1, True, 1.0, 2.5, "1.5", "", " ", "two", "-1", "0", None, [1]])
def test_parse_gpus_refuses(raw):
    with pytest.raises(ValueError):
        parse_gpus(raw)


# ---- the generated default file --------------------------------------------------------------

from cudawrap.policy.keys import RETIRED  # noqa: E402 - beside the tests that leave it out

# The keys that do something (a retired one parses, and is neither offered nor shown).
LIVE = [k for k in DEFAULTS if k not in RETIRED]


def test_default_file_lists_every_setting_once_in_its_section():
    text = render_config()
    head = text.split("# Per-program settings")[0]  # then an example [programs."recon"] table
    setting_lines = [line for line in head.splitlines() if line.startswith("#") and " = " in line
                     and line[1:].split(" = ")[0] in DEFAULTS]
    assert sorted(line[1:].split(" = ")[0] for line in setting_lines) == sorted(LIVE)
    assert set(sections()["devices"]) == set(DEVICE_KEYS) and set(sections()["policy"]) == set(POLICY_KEYS)
    for key in LIVE:
        assert f"# {DESCRIPTIONS[key]}\n#{key} = " in text


def test_default_file_parses_to_the_defaults_and_so_does_every_line_uncommented_with_its_header():
    text = render_config()
    assert values(parse_config(P, text).settings) == DEFAULTS
    lines = text.splitlines()
    numbers = {}
    header = 0
    for number, line in enumerate(lines, 1):
        if line.startswith("#["):
            header = number
        key = line[1:].split(" = ")[0] if line.startswith("#") and " = " in line else None
        if key in DEFAULTS and key not in numbers:
            lines[number - 1] = line[1:]
            lines[header - 1] = lines[header - 1].lstrip("#")  # and its table's header
            numbers[key] = number
    config = parse_config(P, "\n".join(lines))
    assert values(config.settings) == DEFAULTS
    assert {k: s.source for k, s in config.settings.items() if k not in RETIRED} == {
        k: f"{P}:{n}" for k, n in numbers.items()}


def _tables_and_keys(data, label=""):
    """{table: its keys} of parsed TOML DATA, a name the admin chose ("recon") shown as "*";
    a table that only holds tables ([limits.users]) is not one of its own."""
    from cudawrap.policy.config import SCHEMA

    out = {label: set()} if label in SCHEMA else {}
    for key, value in data.items():
        if isinstance(value, dict):
            name = f"{label}.{key}" if label else key
            generic = f"{label}.*" if label else "*"
            for table, keys in _tables_and_keys(value, generic if generic in SCHEMA else name).items():
                out.setdefault(table, set()).update(keys)
        else:
            out.setdefault(label, set()).add(key)
    return out


def test_default_file_shows_every_table_and_key_of_the_schema_and_nothing_else():
    import re
    import sys

    from cudawrap.policy.config import SCHEMA

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    # Every commented-out setting and table header, uncommented: what an admin could turn on.
    text = "\n".join(line[1:] if re.match(r"#(\[|[a-z_]+ = )", line) else line
                     for line in render_config().splitlines())
    shown = _tables_and_keys(tomllib.loads(text))
    schema = {table: set(keys) for table, keys in SCHEMA.items()}
    assert set(shown) == set(schema)
    for table, keys in shown.items():
        # A [programs."NAME"] example shows two of the [policy] keys it may hold; the rest, all.
        assert keys <= schema[table] if table == "programs.*" else keys == schema[table] - set(RETIRED), table
    parse_config(P, text)  # and all of it is valid


def test_default_file_example_program_table_parses_when_uncommented():
    text = render_config().replace('#[programs."recon"]\n#gpus = 2\n#wait = 600', '[programs."recon"]\ngpus = 2\nwait = 600')
    config = parse_config(P, text)
    assert config.programs["recon"]["gpus"].value == 2


@pytest.mark.parametrize("key", list(DEFAULTS))
def test_toml_value_reads_back(key):
    import sys

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    raw = tomllib.loads(f"v = {toml_value(DEFAULTS[key])}")["v"]
    parse = POLICY_KEYS.get(key) or DEVICE_KEYS.get(key) or {k: f for t in OPS_SECTIONS.values() for k, f in t.items()}[key]
    assert parse(raw) == DEFAULTS[key]


# ---- `cudawrap config` ---------------------------------------------------------------------------


def table(stdout: bytes) -> dict:
    """SETTING -> (VALUE, SOURCE) from the command's table."""
    lines = stdout.decode().splitlines()
    assert lines[0].startswith("# settings") and lines[1].split() == ["SETTING", "VALUE", "SOURCE"]
    starts = [lines[1].index(h) for h in ("SETTING", "VALUE", "SOURCE")]
    out = {}
    for line in lines[2:]:
        if not line.strip():
            break  # the limits table follows
        out[line[:starts[1]].strip()] = (line[starts[1]:starts[2]].strip(), line[starts[2]:].strip())
    return out


def wrap_with_cli(inst, name: str, *flags: str) -> Path:
    prog = inst.bindir / name
    prog.write_text("#!/bin/sh\necho real\n")
    prog.chmod(0o755)
    r = inst.cli("wrap", *flags, str(prog))
    assert r.returncode == 0, r.stderr
    return prog


def test_config_command_defaults(installed):
    inst = installed()
    r = inst.cli("config")
    assert r.returncode == 0, r.stderr
    rows = table(r.stdout)
    assert list(rows) == LIVE
    assert rows["wait"] == ("forever", "default") and rows["gpus"] == ("1", "default")
    assert str(inst.layout.config_file) in r.stdout.decode().splitlines()[0]


def test_config_command_shows_where_each_value_came_from(installed):
    inst = installed()
    inst.write_config('[policy]\ngpus = 2\n\n[programs."recon"]\nwait = 5\nplacement = "pack"\n')
    prog = wrap_with_cli(inst, "recon", "--placement", "random")
    rows = table(inst.cli("config").stdout)
    assert rows["gpus"] == ("2", f"{inst.layout.config_file}:2")
    assert rows["wait"] == ("forever", "default")

    r = inst.cli("config", "--program", "recon")
    assert r.returncode == 0, r.stderr
    rows = table(r.stdout)
    assert rows["wait"] == ("5", f"{inst.layout.config_file}:5")
    assert rows["placement"][0] == "random" and "registry" in rows["placement"][1]  # create-cudawrap's flag wins
    assert rows["gpus"] == ("2", f"{inst.layout.config_file}:2")
    assert table(inst.cli("config", "--program", str(prog)).stdout) == rows
    assert table(inst.cli("config", "--program", str(inst.bindir / "CUDAWRAP_recon")).stdout) == rows

    r = inst.cli("config", "-p", "recon", CUDAWRAP_WAIT="7")
    assert table(r.stdout)["wait"] == ("7", "environment (CUDAWRAP_WAIT)")

    data = json.loads(inst.cli("config", "--json", "-p", "recon").stdout)
    assert data["program"] == str(prog)
    assert data["settings"]["wait"] == {"value": 5, "source": f"{inst.layout.config_file}:5"}
    assert data["settings"]["allow"] == {"value": [], "source": "default"}


def test_config_command_for_a_program_not_wrapped(installed):
    inst = installed()
    inst.write_config('[programs."train"]\ngpus = 4\n')
    r = inst.cli("config", "--program", "train")
    assert r.returncode == 0
    assert table(r.stdout)["gpus"] == ("4", f"{inst.layout.config_file}:2")
    assert b"no wrapped program is named train" in r.stderr


def test_config_command_refuses_an_ambiguous_name(installed, tmp_path):
    inst = installed()
    wrap_with_cli(inst, "recon")
    other = tmp_path / "other"
    other.mkdir()
    (other / "recon").write_text("#!/bin/sh\n")
    (other / "recon").chmod(0o755)
    assert inst.cli("wrap", str(other / "recon")).returncode == 0
    r = inst.cli("config", "--program", "recon")
    assert r.returncode == 64 and r.stdout == b""
    assert r.stderr.decode().splitlines()[0].startswith("cudawrap: --program recon: several wrapped programs")


def test_config_command_broken_config_exits_78_with_file_line_key(installed):
    inst = installed()
    inst.write_config("[policy]\ngpu = 2\n")
    r = inst.cli("config")
    assert r.returncode == 78 and r.stdout == b""
    lines = r.stderr.decode().splitlines()
    assert lines[0] == f"cudawrap: {inst.layout.config_file}:2: unknown key 'gpu' in [policy]"
    assert lines[1].startswith("hint: known keys there:") and len(lines) == 2


def test_config_command_bad_cudawrap_wait_is_a_usage_error(installed):
    r = installed().cli("config", CUDAWRAP_WAIT="soon")
    assert r.returncode == 64
    assert r.stderr.decode().startswith("cudawrap: CUDAWRAP_WAIT='soon'")


# ---- the shim ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, where", [
    ("[policy]\ngpus = \"x\"\n", ":2: bad value for 'gpus'"),
    ("[policy]\nwait = 1\nwait = 2\n", ": not valid TOML"),
    ("[polcy]\n", ":1: unknown section [polcy]"),
], ids=["bad-value", "bad-toml", "unknown-section"])
def test_shim_exits_78_on_a_broken_config_and_runs_nothing(installed, text, where):
    inst = installed()
    inst.wrap("recon")
    assert inst.run("recon").returncode == 0  # the launch cache now holds the good config
    inst.write_config(text)
    r = inst.run("recon")
    assert r.returncode == 78, r.stderr
    assert r.stdout == b""  # the real program never ran
    first, hint = r.stderr.decode().splitlines()[:2]
    assert first.startswith(f"recon: {inst.layout.config_file}{where}"), first
    assert hint.startswith("recon: hint: "), hint  # what to do, after what and where
    inst.write_config("[policy]\ngpus = 1\n")
    assert inst.run("recon").returncode == 0


def test_a_setting_above_any_section_says_where_it_belongs(tmp_path):
    from cudawrap.policy.config import parse_config
    from cudawrap.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        parse_config(tmp_path / "c.toml", "# top\ngpus = 2\n[policy]\nwait = 1\n")
    assert str(err.value) == f"{tmp_path / 'c.toml'}:2: 'gpus' belongs in [policy]"


def test_the_retired_enforce_key_still_parses_and_is_said_in_one_line_where_set():
    """[service] enforce retired (docs/admin/ways.md): an older config keeps working, its
    line (true or false) is named as doing nothing; an unknown key still exits 78."""
    from cudawrap.policy.config import retired_notes

    for value in ("true", "false"):
        notes = retired_notes(parse_config(P, f"[service]\nenforce = {value}\n"))
        assert len(notes) == 1 and notes[0].startswith(f"{P}:2: [service] enforce no longer does anything"), notes
    assert retired_notes(parse_config(P, "[service]\nprivate_status = true\n")) == []
    assert "enforce" not in render_config()  # the default file no longer offers it
    err = refused("[service]\nenforce_harder = true\n")
    assert err.exit_code == 78 and "enforce_harder" in err.message
