"""`kvconnect router --tier-weights`: TIER=WEIGHT pairs over the defaults, a tier being a medium
with its locality in vLLM 0.33's words; the older DISK and EXTERNAL name the STORAGE tiers."""

import pytest

from kvconnect.commands.router import parse_tier_weights
from kvconnect.router.index import DEFAULT_TIER_WEIGHTS

DEFAULTS = {
    "GPU": 1.0,
    "CPU": 0.8,
    "STORAGE/LOCAL": 0.5,
    "STORAGE/REMOTE": 0.3,
    "STORAGE": 0.3,
}


def test_the_defaults_are_the_documented_ones() -> None:
    assert DEFAULT_TIER_WEIGHTS == DEFAULTS
    assert parse_tier_weights("") == DEFAULTS
    assert parse_tier_weights("GPU=1.0,CPU=0.8,STORAGE/LOCAL=0.5,STORAGE/REMOTE=0.3") == DEFAULTS


def test_pairs_override_the_defaults_and_keep_the_rest() -> None:
    assert parse_tier_weights("GPU=1,CPU=0.8,STORAGE/LOCAL=0.6,STORAGE/REMOTE=0.2") == {
        **DEFAULTS,
        "STORAGE/LOCAL": 0.6,
        "STORAGE/REMOTE": 0.2,
    }
    assert parse_tier_weights("CPU=0.7") == {**DEFAULTS, "CPU": 0.7}
    assert parse_tier_weights("STORAGE=0.4") == {**DEFAULTS, "STORAGE": 0.4}
    # Spaces, case and a trailing comma are forgiven; a weight may be 0.
    assert parse_tier_weights(" cpu = 0.5 , storage/remote=0 ,") == {
        **DEFAULTS,
        "CPU": 0.5,
        "STORAGE/REMOTE": 0.0,
    }
    # A tier the defaults do not name is added (events naming it are weighted so).
    assert parse_tier_weights("NVME/LOCAL=0.6") == {**DEFAULTS, "NVME/LOCAL": 0.6}
    assert parse_tier_weights("CPU=0.1,CPU=0.2")["CPU"] == 0.2  # the last one wins


def test_the_older_names_set_the_storage_tiers() -> None:
    assert parse_tier_weights("DISK=0.6,EXTERNAL=0.2") == {
        **DEFAULTS,
        "STORAGE/LOCAL": 0.6,
        "STORAGE/REMOTE": 0.2,
    }
    weights = parse_tier_weights("GPU=1.0,CPU=0.8,DISK=0.5,EXTERNAL=0.3")  # the old default
    assert weights == DEFAULTS and "DISK" not in weights and "EXTERNAL" not in weights


@pytest.mark.parametrize(
    "part",
    ["GPU", "GPU=", "=0.5", "/LOCAL=0.5", "CPU=x", "CPU=-0.1", "CPU=inf", "CPU=nan", "CPU:0.8"],
)
def test_a_bad_part_is_a_value_error_naming_it(part: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_tier_weights(f"CPU=0.7,{part},STORAGE/REMOTE=0.2")
    message = str(info.value)
    assert repr(part) in message and "--tier-weights" in message
    assert "0.7" not in message and "0.2" not in message  # that part, not the whole text
