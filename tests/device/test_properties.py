"""Properties that hold for any input (hypothesis, fixed seeds, bounded examples).

(a) The text frontends (generic validate / normalize / split_sentences, the default voice's
    segments, the CosyVoice2 TextFrontend) take any Unicode string, lone surrogates included
    (JSON can carry them): they raise nothing but InputError and their output is bounded.
(b) The bundle loader, on a copy of a real bundle whose files get random byte flips and
    truncations: always a BundleError naming the damaged file, never another exception.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cosyedge.device import text as textmod
from cosyedge.device.bundle import MANIFEST, Bundle
from cosyedge.device.errors import BundleError, InputError

NFKC_GROWTH = 18  # the most characters NFKC makes of one (U+FDFA)
MAX_CHARS = 200

SETTINGS = settings(derandomize=True, database=None, deadline=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Pieces that reach the interesting paths: numbers (spelled out), sentence ends, CJK, blank runs, marks, emoji.
_PIECES = ["0", "7", "42", "1000000", "3.14", "-5", "²", "½", "１２", "$", "%", "€", "@", "#", ".", "!", "?",
           "…", "。", "！", "、", "，", ";", ":", "-", " - ", '"', "”", "(", ")", "[", "<|", "|>", "<|endoftext|>",
           " ", "  ", "\n", "\n\n", "\t", "\r", "\u3000", "\u200b", "\u00a0", "a", "Hello", "world", "Dr.", "e.g.",
           "你好", "中文", "é", "e\u0301", "ﷺ", "㍿", "😀", "👍🏽", "\x00", "\x7f", "\u202e"]
_SURROGATES = ["\ud800", "\udfff", "\udc00"]


def _texts(surrogates: bool) -> st.SearchStrategy[str]:
    """Any text (lone surrogates only if `surrogates`), plus texts assembled from the pieces above."""
    chars = st.characters(codec=None, exclude_categories=() if surrogates else ("Cs",))
    pieces = st.sampled_from(_PIECES + (_SURROGATES if surrogates else []))
    return st.one_of(st.text(chars, max_size=MAX_CHARS), st.lists(pieces, max_size=40).map("".join),
                     st.lists(st.one_of(pieces, st.text(chars, max_size=4)), max_size=30).map("".join))


texts = _texts(surrogates=True)


def _typed_only(call, *args):
    """The call's result, or None when it refused with InputError; any other exception fails the property."""
    try:
        return call(*args)
    except InputError:
        return None


# -- (a) text frontends ------------------------------------------------------------------------------

@SETTINGS
@given(texts)
def test_generic_text_functions_raise_only_input_error_and_stay_bounded(raw: str):
    clean = _typed_only(textmod.validate, raw, MAX_CHARS)
    if clean is None:
        return
    assert isinstance(clean, str) and clean == clean.strip() and clean
    assert len(clean) <= NFKC_GROWTH * MAX_CHARS
    assert textmod.normalize(raw) == clean
    sentences = textmod.split_sentences(clean)
    assert len(sentences) <= len(clean)
    assert sum(len(s) for s in sentences) <= len(clean)


@SETTINGS
@given(texts)
def test_normalize_and_split_never_raise(raw: str):
    clean = textmod.normalize(raw)
    assert len(clean) <= NFKC_GROWTH * len(raw)
    for sentence in textmod.split_sentences(raw):
        assert sentence and len(sentence) <= len(raw)


@settings(SETTINGS, max_examples=60)
@given(texts)
def test_default_voice_segments_raise_only_input_error_and_stay_bounded(default_engine, raw: str):
    segments = _typed_only(default_engine.segments, raw)
    if segments is None:
        return
    assert 1 <= len(segments) <= len(raw)
    for segment in segments:
        assert segment.ids and all(isinstance(i, int) for i in segment.ids)
        # phonemes of spelled-out numbers outgrow the text, but boundedly
        assert len(segment.ids) <= 200 * len(raw) + 200


@pytest.fixture(scope="module")
def cv2_frontend(cv2_tiny_bundle: Path):
    from cosyedge.device.cosyvoice2.frontend import TextFrontend
    return TextFrontend(Bundle.load(cv2_tiny_bundle, verify=False).asset("tokenizer"))


def _cosyvoice2_frontend_property(frontend, raw: str) -> None:
    segments = _typed_only(frontend.normalize, raw)
    if segments is None:
        return
    assert len(segments) <= max(1, len(raw))
    for segment in segments:
        assert isinstance(segment, str)
        assert len(segment) <= 200 * len(raw) + 200  # numbers are spelled out, boundedly
        assert len(_typed_only(frontend.encode, segment) or []) <= 4 * len(segment) + 4


@settings(SETTINGS, max_examples=60)
@given(_texts(surrogates=False))
def test_cosyvoice2_frontend_raises_only_input_error_and_stays_bounded(cv2_frontend, raw: str):
    _cosyvoice2_frontend_property(cv2_frontend, raw)


@settings(SETTINGS, max_examples=60, report_multiple_bugs=False)
@given(_texts(surrogates=True))
def test_cosyvoice2_frontend_with_lone_surrogates_raises_only_input_error(cv2_frontend, raw: str):
    _cosyvoice2_frontend_property(cv2_frontend, raw)


# -- (b) bundle loader -------------------------------------------------------------------------------

def _bundle_copy(src: Path, dst: Path) -> tuple[Path, dict[str, bytes]]:
    shutil.copytree(src, dst)
    Bundle.load(dst, verify=True)  # the copy itself is sound
    files = {p.relative_to(dst).as_posix(): p.read_bytes() for p in sorted(dst.rglob("*")) if p.is_file()}
    return dst, files


@pytest.fixture(scope="module")
def default_copy(default_bundle_path: Path, tmp_path_factory) -> tuple[Path, dict[str, bytes]]:
    return _bundle_copy(default_bundle_path, tmp_path_factory.mktemp("flip") / "default")


@pytest.fixture(scope="module")
def cv2_copy(cv2_tiny_bundle: Path, tmp_path_factory) -> tuple[Path, dict[str, bytes]]:
    return _bundle_copy(cv2_tiny_bundle, tmp_path_factory.mktemp("flip") / "cv2")


def _listed(root: Path) -> set[str]:
    manifest = Bundle.load(root, verify=False).manifest
    return {entry.file for entry in (*manifest.components, *manifest.assets)}


damage = st.one_of(
    st.tuples(st.just("flip"), st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)),
                                        min_size=1, max_size=8)),
    st.tuples(st.just("truncate"), st.floats(0, 1, exclude_max=True)),
)


def _damaged_load(root: Path, rel: str, original: bytes, how: tuple) -> Exception | None:
    """Load the bundle with `rel` damaged as `how` says; the file is restored afterwards."""
    path = root / rel
    kind, spec = how
    try:
        if kind == "flip":
            with open(path, "r+b") as handle:
                for where, mask in spec:
                    offset = int(where * len(original))
                    handle.seek(offset)
                    handle.write(bytes([original[offset] ^ mask]))
        else:
            os.truncate(path, int(spec * len(original)))
        Bundle.load(root, verify=True)
        return None
    except Exception as exc:  # noqa: BLE001 - the property is about which exceptions come out
        return exc
    finally:
        path.write_bytes(original)


def _check_damage(copy: tuple[Path, dict[str, bytes]], rel: str, how: tuple) -> None:
    root, files = copy
    error = _damaged_load(root, rel, files[rel], how)
    if rel == MANIFEST:
        # a flip can leave valid JSON that means something else (a name, a description): loading may succeed
        assert error is None or isinstance(error, BundleError), repr(error)
        if error is not None:
            assert MANIFEST in str(error), str(error)
    elif rel in _listed(root):
        assert isinstance(error, BundleError), f"{rel} damaged ({how[0]}): {error!r}"
        assert rel in str(error), str(error)
    else:  # not listed in the manifest: nobody reads it
        assert error is None or isinstance(error, BundleError), repr(error)
    assert str(root) not in str(error or ""), "messages never contain absolute paths"


@settings(SETTINGS, max_examples=24)
@given(data=st.data())
def test_default_bundle_damage_is_a_bundle_error_naming_the_file(default_copy, data):
    _, files = default_copy
    rel = data.draw(st.sampled_from(sorted(files)), label="file")
    _check_damage(default_copy, rel, data.draw(damage, label="damage"))


@settings(SETTINGS, max_examples=40)
@given(data=st.data())
def test_cosyvoice2_bundle_damage_is_a_bundle_error_naming_the_file(cv2_copy, data):
    _, files = cv2_copy
    rel = data.draw(st.sampled_from(sorted(files)), label="file")
    _check_damage(cv2_copy, rel, data.draw(damage, label="damage"))


def test_every_file_of_the_copies_is_covered(default_copy, cv2_copy):
    for root, files in (default_copy, cv2_copy):
        assert MANIFEST in files
        assert _listed(root) <= set(files)  # graphs and assets: each one can be drawn
        assert any(name.endswith(".onnx") for name in files)
        Bundle.load(root, verify=True)  # every damage was undone
