"""`Engine.options` validates a request once, with typed errors (issue 10 defects: each of these used to escape as
a ValueError / OverflowError -> HTTP 500, or failed only inside the worker), and `Engine.load` keeps precisions
and build targets apart."""
from __future__ import annotations

import pytest

from cosyedge.device import (BatchLimits, EmptyTextError, Engine, FixedVoicesError, InputError, TextTooLongError,
                             UnknownVoiceError)
from cosyedge.device.options import SEED_MAX


@pytest.mark.parametrize("voice", ["²", "٣", "①", "¹²"])
def test_unicode_digits_are_names_not_speaker_ids(default_engine, voice):
    """str.isdigit() is True for these and int() refused some of them (ValueError -> 500); only ASCII 0-9 are ids."""
    with pytest.raises(UnknownVoiceError, match="unknown voice"):
        default_engine.options(voice=voice)


def test_ascii_digit_string_is_a_speaker_id(default_engine):
    voices = default_engine.voices()
    assert default_engine.options(voice="3").voice == voices[3 % len(voices)]


@pytest.mark.parametrize("speed", [pytest.param(10**400, id="10**400"), pytest.param(-10**400, id="-10**400"), "1e999",
                                   float("nan"), float("inf"), "fast", "2", True, [1.0]])
def test_speed_that_is_no_usable_number_is_an_input_error(default_engine, speed):
    """float(10**400) raises OverflowError, which used to escape as a 500; a string or a bool is no number (the
    request declaration's types, the same on every door). None is the default, as a JSON null is."""
    with pytest.raises(InputError, match="speed"):
        default_engine.options(speed=speed)


@pytest.mark.parametrize("seed", [-1, SEED_MAX + 1, pytest.param(10**40, id="10**40"), 1.5, "7", True])
def test_seed_out_of_range_is_refused_at_validation(default_engine, seed):
    """A negative or > 2**32-1 seed used to pass validation and fail inside the synthesis worker."""
    with pytest.raises(InputError, match="seed"):
        default_engine.options(seed=seed)


@pytest.mark.parametrize("seed", [0, SEED_MAX, None])
def test_seed_bounds_are_accepted(default_engine, seed):
    assert default_engine.options(seed=seed).seed == seed


def test_text_errors_carry_their_codes(default_engine):
    with pytest.raises(EmptyTextError) as empty:
        default_engine.segments("   ")
    with pytest.raises(TextTooLongError) as long:
        default_engine.segments("a" * 11, max_chars=10)
    assert (empty.value.code, long.value.code) == ("empty_text", "text_too_long")


def test_vits_has_no_modes_and_fixed_voices(default_engine):
    with pytest.raises(InputError, match="no modes"):
        default_engine.options(mode="sft")
    with pytest.raises(FixedVoicesError) as fixed:
        default_engine.remove_voice("someone")
    assert fixed.value.code == "fixed_voices" and default_engine.stats() == {}


def test_synthesize_batch_uses_the_given_limits(default_engine):
    with pytest.raises(TextTooLongError):
        default_engine.synthesize_batch(["Short.", "This one is too long."], BatchLimits(max_text_len=10))


@pytest.mark.parametrize("kwargs, message", [
    ({"precision": "cpu"}, "'cpu' is a build target; use target"),
    ({"precision": "trt-int8"}, "is a build target"),
    ({"precision": "fp64"}, "unknown precision"),
    ({"target": "fp32"}, "unknown target"),
    ({"precision": "fp32", "target": "cpu"}, "not both"),
])
def test_precision_and_target_are_kept_apart(default_bundle_path, kwargs, message):
    with pytest.raises(InputError, match=message):
        Engine.load(default_bundle_path, warmup=False, **kwargs)


def test_a_target_the_bundle_lacks_is_a_bundle_error(default_bundle_path):
    from cosyedge.device.errors import BundleError
    with pytest.raises(BundleError, match="has no 'cpu' graphs"):
        Engine.load(default_bundle_path, target="cpu", warmup=False)
