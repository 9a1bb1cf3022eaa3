"""The filter decision alone (cudawrap/filters.py), the per-run asks that narrow it
(policy.narrow), and `run --substitute`'s placeholders: pure functions, no processes."""
from typing import List

import pytest
from hypothesis import given, settings, strategies as st

from cudawrap.policy import effective as policy
from cudawrap.policy.config import DEFAULTS, POLICY_KEYS
from cudawrap.devices.model import Device, Gpu, Inventory
from cudawrap.errors import ConfigError, NoDeviceError, UsageError
from cudawrap.policy.effective import narrowed
from cudawrap.sched.filters import (FILTER_KEYS, Request, explain, model_matches, passes, product,
                                    split, static_reason, waiting_reason)
from cudawrap.sched.substitute import substitute
from cudawrap.ops.status import parse_watch

H0, H1, A, W0, W1 = "GPU-h100-0", "GPU-h100-1", "GPU-a100", "GPU-a6000-0", "GPU-a6000-1"


def mixed(utilization: int = 0, used: int = 0) -> Inventory:
    """Two H100s, an A100 in seven 1g.10gb slices, two RTX A6000s (as h100-a100mig-a6000.topo)."""
    gpus = [Gpu(H0, 0, "NVIDIA H100 80GB HBM3", False), Gpu(H1, 1, "NVIDIA H100 80GB HBM3", False),
            Gpu(A, 2, "NVIDIA A100-SXM4-80GB", True), Gpu(W0, 3, "NVIDIA RTX A6000", False),
            Gpu(W1, 4, "NVIDIA RTX A6000", False)]
    devices = [Device(H0, gpus[0].name, H0, 0, None, 81559, used, (), utilization),
               Device(H1, gpus[1].name, H1, 1, None, 81559, 0, (), 0)]
    devices += [Device(f"MIG-a100-{s}", "1g.10gb", A, 2, s, 9728, 0, ()) for s in range(7)]
    devices += [Device(W0, gpus[3].name, W0, 3, None, 49140, 0, (), 0),
                Device(W1, gpus[4].name, W1, 4, None, 49140, 0, (), None)]
    return Inventory("570.124.06", gpus, devices)


def uuids(devices: List[Device]) -> List[str]:
    return [d.uuid for d in devices]


@pytest.mark.parametrize("model, expected", [
    ("H100", [H0, H1]),
    ("h100 hbm3", [H0, H1]),
    ("A6000", [W0, W1]),
    ("a100", [f"MIG-a100-{s}" for s in range(7)]),  # a MIG instance matches its GPU's name...
    ("1g.10gb", [f"MIG-a100-{s}" for s in range(7)]),  # ...and its profile
    ("A100 MIG", [f"MIG-a100-{s}" for s in range(7)]),
    ("H100 1g.10gb", []),  # every word must match
    ("", None),
], ids=lambda v: repr(v))
def test_model_matches_words_of_the_product_name(model, expected):
    inv = mixed()
    kept, why = split(Request(model=model), inv.devices, inv)
    assert uuids(kept) == (inv.uuids() if expected is None else expected)
    for uuid, reason in why.items():
        assert reason.startswith(f"model {model!r} does not match NVIDIA")


def test_memory_floors_are_against_the_total_until_the_run_waits():
    inv = mixed(used=60000)
    kept, why = split(Request(min_memory_mib=40000), inv.devices, inv)
    assert uuids(kept) == [H0, H1, W0, W1]
    assert why["MIG-a100-0"] == "9728 MiB in all, below min_memory_mib = 40000"
    # 60000 MiB in use on H0 does not make it unfit for ever: only for now.
    request = Request(min_free_memory_mib=30000)
    h0, h1 = inv.devices[:2]
    assert static_reason(request, h0, inv) is None
    assert waiting_reason(request, h0, inv) == "21559 MiB free, below min_free_memory_mib = 30000"
    assert passes(request, h1, inv) is None
    assert static_reason(Request(min_free_memory_mib=90000), h1, inv) == (
        "81559 MiB in all can never leave min_free_memory_mib = 90000 free")


def test_max_utilization_never_excludes_what_nvml_does_not_report():
    inv = mixed(utilization=85)
    request = Request(max_utilization=10)
    by_uuid = {d.uuid: d for d in inv.devices}
    assert waiting_reason(request, by_uuid[H0], inv) == "85 % busy, above max_utilization = 10"
    assert passes(request, by_uuid[H1], inv) is None
    assert passes(request, by_uuid["MIG-a100-3"], inv) is None  # MIG: utilisation unknown
    assert passes(request, by_uuid[W1], inv) is None  # not reported by that board
    assert static_reason(request, by_uuid[H0], inv) is None  # it may calm down: a wait, not a refusal


def test_devices_by_uuid_prefix_and_nvml_index():
    inv = mixed()
    kept, why = split(Request(devices=(1, "GPU-a6000-1", A)), inv.devices, inv)
    assert uuids(kept) == [H1] + [f"MIG-a100-{s}" for s in range(7)] + [W1]
    assert why[H0] == "not among devices [1, GPU-a6000-1, GPU-a100]"


@pytest.mark.parametrize("request_, count, line", [
    (Request(model="A6000 Ada"), 1,
     "no device here can ever satisfy this request: model 'A6000 Ada' matches none of "
     "H100 80GB HBM3 ×2, A100-SXM4-80GB MIG 1g.10gb ×7, RTX A6000 ×2"),
    (Request(count=3, model="H100"), 3,
     "3 devices asked for, but only 2 can ever satisfy the filters: model 'H100' leaves out "
     "A100-SXM4-80GB MIG 1g.10gb ×7, RTX A6000 ×2"),
    (Request(model="rtx", min_memory_mib=50000), 1,
     "no device here can ever satisfy this request: model 'rtx' leaves out H100 80GB HBM3 ×2, "
     "A100-SXM4-80GB MIG 1g.10gb ×7; min_memory_mib = 50000 leaves out RTX A6000 ×2 (49140 MiB in all)"),
    (Request(count=3, min_memory_mib=9000, min_free_memory_mib=50000), 3,
     "3 devices asked for, but only 2 can ever satisfy the filters: min_free_memory_mib = 50000 leaves out "
     "A100-SXM4-80GB MIG 1g.10gb ×7, RTX A6000 ×2 (9728-49140 MiB in all)"),
    (Request(count=2, devices=(0,), min_free_memory_mib=1), 2,
     "2 devices asked for, but only 1 can ever satisfy the filters: devices [0] leave out "
     "H100 80GB HBM3, A100-SXM4-80GB MIG 1g.10gb ×7, RTX A6000 ×2"),
], ids=["unknown-model", "too-few", "two-filters", "free-floor", "devices"])
def test_explain_says_which_filter_excludes_what(request_, count, line):
    inv = mixed()
    assert request_.count == count
    assert explain(request_, inv.devices, inv) == line


@settings(max_examples=200, deadline=None)
@given(model=st.sampled_from(["", "H100", "A100", "A6000", "1g.10gb", "RTX", "nothing"]),
       min_memory=st.integers(0, 100000), min_free=st.integers(0, 100000),
       chosen=st.lists(st.sampled_from([0, 1, 2, 3, 4, 9, H0, "GPU-a6000", "MIG-a100-2"]), max_size=3),
       used=st.integers(0, 81559), utilization=st.integers(0, 100), ceiling=st.integers(0, 100))
def test_split_keeps_exactly_what_a_reference_model_keeps(model, min_memory, min_free, chosen, used,
                                                          utilization, ceiling):
    inv = mixed(utilization=utilization, used=used)
    request = Request(devices=chosen, model=model, min_memory_mib=min_memory,
                      min_free_memory_mib=min_free, max_utilization=ceiling)
    kept, why = split(request, inv.devices, inv)
    for device in inv.devices:
        name = product(device, inv).lower()
        in_chosen = not chosen or any(
            device.gpu_index == c if isinstance(c, int) else
            device.uuid.startswith(c) or device.parent_uuid.startswith(c) for c in chosen)
        ever = (in_chosen and all(w in name for w in model.lower().split())
                and device.memory_total_mib >= max(min_memory, min_free))
        assert (device in kept) == ever and (device.uuid in why) == (not ever)
        now = ever and device.memory_total_mib - device.memory_used_mib >= min_free and (
            device.utilization is None or device.utilization <= ceiling)
        assert (passes(request, device, inv) is None) == now
    if len(kept) < max(1, request.count):
        assert explain(request, inv.devices, inv).startswith("no device here can ever")


def test_a_request_is_a_value():
    request = Request.from_settings(dict(DEFAULTS, model="H100", gpus=2))
    assert request == Request(count=2, model="H100") and hash(request) == hash(Request(2, model="H100"))
    assert request.filtered and not Request.from_settings(DEFAULTS).filtered
    with pytest.raises(AttributeError):
        request.model = "A100"
    assert request.describe() == "model 'H100'"
    assert Request(devices=(0,), min_memory_mib=1, min_free_memory_mib=2, max_utilization=3).describe() == (
        "one of [0], 1 MiB in all, 2 MiB free, at most 3 % busy")
    assert set(FILTER_KEYS) <= set(POLICY_KEYS)


def test_model_matching_ignores_case_and_spacing():
    assert model_matches("  h100   80gb ", "NVIDIA H100 80GB HBM3")
    assert not model_matches("H100 40GB", "NVIDIA H100 80GB HBM3")


# ---- what a user may ask for one run: narrower, never wider ------------------------------


def admin_settings(**values):
    merged = {k: (v, "default") for k, v in DEFAULTS.items()}
    merged.update({k: (v, "config.toml:3") for k, v in values.items()})
    return policy.Settings(merged)


def pair(settings, key):
    return settings.value(key), settings.source(key)


@pytest.mark.parametrize("key, admin, user, expected, source", [
    ("model", "H100", "80GB", "H100 80GB", "config.toml:3 and --model"),
    ("model", "", "A100", "A100", "--model"),
    ("min_free_memory_mib", 30000, "1000", 30000, "config.toml:3"),  # the user's is looser: no effect
    ("min_free_memory_mib", 30000, "40000", 40000, "--model"),
    ("min_memory_mib", 0, "20000", 20000, "--model"),
    ("max_utilization", 20, "50", 20, "config.toml:3"),
    ("max_utilization", 20, "5", 5, "--model"),
])
def test_a_user_may_narrow_the_admins_filters_never_widen_them(key, admin, user, expected, source):
    settings = admin_settings(**{key: admin})
    policy.narrow(settings, key, user, "--model")
    assert pair(settings, key) == (expected, source)
    assert narrowed(key, admin, POLICY_KEYS[key](user if key == "model" else int(user))) == expected


def test_count_within_max_gpus_or_refused_with_75():
    settings = admin_settings(max_gpus=2)
    policy.narrow(settings, "gpus", "2", "environment (CUDAWRAP_GPUS)")
    assert pair(settings, "gpus") == (2, "environment (CUDAWRAP_GPUS)")
    with pytest.raises(NoDeviceError) as refused:
        policy.narrow(settings, "gpus", "3", "environment (CUDAWRAP_GPUS)")
    assert refused.value.exit_code == 75
    assert str(refused.value) == "3 devices asked for, but a run of this program may have at most 2 " \
                                 "(max_gpus, config.toml:3)"


@pytest.mark.parametrize("name, raw, text", [
    ("CUDAWRAP_GPUS", "two", "CUDAWRAP_GPUS='two': 'two' is not a whole number"),
    ("CUDAWRAP_GPUS", "0", "CUDAWRAP_GPUS='0': 0 is not between 1 and 64"),
    ("CUDAWRAP_MIN_FREE_MEMORY_MIB", "-1", "CUDAWRAP_MIN_FREE_MEMORY_MIB='-1': -1 is not a whole number >= 0"),
    ("CUDAWRAP_MIN_MEMORY_MIB", "12.5", "CUDAWRAP_MIN_MEMORY_MIB='12.5': '12.5' is not a whole number"),
    ("CUDAWRAP_MIN_MEMORY_MIB", "--5", "CUDAWRAP_MIN_MEMORY_MIB='--5': '--5' is not a whole number"),
    ("CUDAWRAP_MAX_UTILIZATION", "101", "CUDAWRAP_MAX_UTILIZATION='101': 101 is not a whole percentage"),
    ("CUDAWRAP_MODEL", "H100\x1b[2J", "CUDAWRAP_MODEL='H100\\x1b[2J': 'H100\\x1b[2J' is not a model name"),
])
def test_bad_environment_values_are_usage_errors(tmp_path, name, raw, text):
    with pytest.raises(UsageError) as bad:
        policy.effective(str(tmp_path), None, {name: raw})
    assert bad.value.exit_code == 64 and str(bad.value).startswith(text)


def test_environment_asks_are_applied_and_an_empty_one_ignored(tmp_path):
    got = policy.effective(str(tmp_path), None, {"CUDAWRAP_MODEL": "a6000", "CUDAWRAP_GPUS": "",
                                                 "CUDAWRAP_MAX_UTILIZATION": "30"})
    assert pair(got, "model") == ("a6000", "environment (CUDAWRAP_MODEL)")
    assert pair(got, "max_utilization") == (30, "environment (CUDAWRAP_MAX_UTILIZATION)")
    assert pair(got, "gpus") == (1, "default")


def test_a_program_count_above_its_max_gpus_is_a_config_error(tmp_path):
    config = tmp_path / "etc" / "cudawrap" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text('[policy]\nmax_gpus = 2\n\n[programs."train"]\ngpus = 4\n')
    assert policy.effective(str(tmp_path), "/opt/other").value("max_gpus") == 2
    with pytest.raises(ConfigError) as bad:
        policy.effective(str(tmp_path), "/opt/train")
    assert str(bad.value) == f"{config}:5: gpus = 4 is above max_gpus = 2 ({config}:2)"


@pytest.mark.parametrize("value, message", [
    ("H100\n", "is not a model name"),
    (["GPU-1", "nonsense"], "'nonsense' is not a GPU-… or MIG-… UUID (or prefix) or an index"),
    ([-1], "-1 is not a GPU-…"),
    (150, "150 is not a whole percentage"),
])
def test_config_parsers_refuse_bad_filter_values(value, message):
    key = {str: "model", list: "devices", int: "max_utilization"}[type(value)]
    with pytest.raises(ValueError) as bad:
        POLICY_KEYS[key](value)
    assert message in str(bad.value)


# ---- run --substitute ------------------------------------------------------------------


def nvml_index(uuid: str):
    return None if uuid.startswith("MIG-") else int(uuid.rsplit("-", 1)[1])


@pytest.mark.parametrize("args, leased, expected", [
    (["-p", "0:{index}"], ["GPU-x-3"], ["-p", "0:0"]),
    (["--gpu={nvml_index}", "{uuid}"], ["GPU-x-3"], ["--gpu=3", "GPU-x-3"]),
    (["{indices}", "{uuids}", "{nvml_indices}"], ["GPU-x-3", "GPU-x-1"], ["0,1", "GPU-x-3,GPU-x-1", "3,1"]),
    (["{index}{index}", "{\"json\": 1}", "{}"], ["MIG-y"], ["00", "{\"json\": 1}", "{}"]),
], ids=["cuda-index", "nvml-index", "lists", "literal-braces"])
def test_substitute_fills_the_leased_devices(args, leased, expected):
    assert substitute(args, leased, nvml_index) == (expected, [])


@pytest.mark.parametrize("args, leased, message", [
    (["-p", "0:{index}"], ["GPU-x-3", "GPU-x-1"], "--substitute: {index} names one device, but 2 are leased"),
    (["{uuid}"], ["GPU-x-3", "GPU-x-1"], "--substitute: {uuid} names one device, but 2 are leased"),
    (["{nvml_index}"], ["MIG-y"], "--substitute: MIG-y is a MIG instance, which has no NVML index"),
])
def test_substitute_refuses_what_it_cannot_fill(args, leased, message):
    with pytest.raises(UsageError) as bad:
        substitute(args, leased, nvml_index)
    assert str(bad.value) == message and bad.value.exit_code == 64


def test_substitute_warns_of_an_unknown_placeholder_and_leaves_it():
    out, warnings = substitute(["{idx}", "{index}"], ["GPU-x-0"], nvml_index)
    assert out == ["{idx}", "0"]
    assert warnings == ["{idx} is not a placeholder and is passed as it is (known: {index}, {indices}, "
                        "{uuid}, {uuids}, {nvml_index}, {nvml_indices})"]


def test_substitute_asks_nvml_only_when_needed():
    def refuse(uuid):
        raise AssertionError("NVML asked without an NVML placeholder")

    assert substitute(["{index}"], ["GPU-x-0"], refuse) == (["0"], [])


@pytest.mark.parametrize("seconds, count, expected", [
    ((), None, (2.0, None)), (("0.5",), "3", (0.5, 3)), (("60",), None, (60.0, None)),
])
def test_watch_arguments(seconds, count, expected):
    assert parse_watch(seconds, count) == expected


@pytest.mark.parametrize("seconds, count, message", [
    (("0",), None, "choose between 0.1 and 3600 seconds"),
    (("nan",), None, "choose between"),
    (("soon",), None, "'soon' is not a number of seconds"),
    (("1", "2"), None, "one refresh period, not 2 values"),
    ((), "0", "--count '0' is not a number of refreshes"),
    ((), "²", "--count '²' is not a number of refreshes"),
])
def test_bad_watch_arguments(seconds, count, message):
    with pytest.raises(ValueError) as bad:
        parse_watch(seconds, count)
    assert message in str(bad.value)
