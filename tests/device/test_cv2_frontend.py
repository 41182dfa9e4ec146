"""CosyVoice2 text frontend (normalise, split, tokenise) against the official outputs in text_frontend.json."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cosyedge.device.cosyvoice2.frontend import TextFrontend
from cosyedge.device.errors import InputError
from cosyedge.quantize.cosyvoice2.tokenizer import write_tokenizer_json


@pytest.fixture(scope="module")
def frontend(cv2_tiny_dir: Path, tmp_path_factory) -> TextFrontend:
    path = write_tokenizer_json(cv2_tiny_dir / "CosyVoice-BlankEN", tmp_path_factory.mktemp("cv2tok") / "tokenizer.json")
    return TextFrontend(path)


@pytest.fixture(scope="module")
def cases(cv2_tiny_dir: Path) -> list[dict]:
    data = json.loads((cv2_tiny_dir / "vectors" / "text_frontend.json").read_text(encoding="utf-8"))
    return data["cases"]


def test_tokenizer_known_ids(frontend: TextFrontend):
    assert frontend.encode("Hello world") == [9707, 1879]
    assert frontend.encode("你好") == [108386]
    assert frontend.encode("<|endoftext|><|im_start|><|im_end|>") == [151643, 151644, 151645]
    assert frontend.encode("<|endofprompt|>") == [151646]
    assert frontend.encode("[mn]") == [151662]
    assert frontend._tokenizer.get_vocab_size() == 151663


def test_raw_text_token_ids(frontend: TextFrontend, cases: list[dict]):
    for case in cases:
        assert frontend.encode(case["text"]) == case["raw_text_token_ids"], case["text"]


def test_segments_and_ids(frontend: TextFrontend, cases: list[dict]):
    checked = 0
    for case in cases:
        if "segments" not in case:
            continue
        segments = frontend.normalize(case["text"], split=True)
        assert segments == case["segments"], case["text"]
        assert [frontend.encode(s) for s in segments] == case["segment_token_ids"], case["text"]
        checked += 1
    assert checked >= 30


def test_normalized_no_split(frontend: TextFrontend, cases: list[dict]):
    for case in cases:
        if "normalized_no_split" in case:
            assert frontend.normalize(case["text"], split=False) == [case["normalized_no_split"]], case["text"]


def test_official_errors_become_input_errors(frontend: TextFrontend, cases: list[dict]):
    failing = [case for case in cases if "error_split" in case or "error_no_split" in case]
    assert failing
    for case in failing:
        for split in (True, False):
            with pytest.raises(InputError):
                frontend.normalize(case["text"], split=split)


def test_other_official_failures_raise_input_error(frontend: TextFrontend):
    from cosyedge.device.cosyvoice2.frontend import _number_to_words

    with pytest.raises(InputError):  # strips to "": the official code fails on it
        frontend.normalize("   ")
    with pytest.raises(InputError):  # beyond decillions: inflect raises NumOutOfRangeError
        _number_to_words("9" * 37)
    assert _number_to_words("9" * 36).startswith("nine hundred and ninety-nine decillion")


def test_number_spelling_matches_inflect_style():
    from cosyedge.device.cosyvoice2.frontend import _number_to_words, _spell_out_numbers

    assert _number_to_words("0") == "zero"
    assert _number_to_words("007") == "seven"
    assert _number_to_words("1001") == "one thousand and one"
    assert _number_to_words("1100") == "one thousand, one hundred"
    assert _number_to_words("1234") == "one thousand, two hundred and thirty-four"
    assert _number_to_words("1000001") == "one million and one"
    assert _spell_out_numbers("room 21b") == "room twenty-oneb"


def test_words_are_the_texts_words_each_owning_a_run_of_its_token_ids(frontend: TextFrontend):
    """Every token belongs to one word, every word has a token: the ranges tile the ids in order; punctuation and
    a following space stay with their word; each CJK character is a word, except that characters read as one BPE
    token ("你好", "世界") are one word."""
    for text, expected in (("Hello, big world. 你好，世界！", ["Hello,", "big", "world.", "你好，", "世界！"]),
                           ("我们在这里等你好吗", ["我们", "在这里", "等", "你好", "吗"]),
                           ("  lead spaces  and trail  ", ["lead", "spaces", "and", "trail"])):
        words = frontend.words(text)
        assert [w for w, _, _ in words] == expected
        assert words[0][1] == 0 and words[-1][2] == len(frontend.encode(text))
        assert all(a[2] == b[1] and a[1] < a[2] for a, b in zip(words, words[1:]))
    assert frontend.words("") == () and frontend.words("   ") == ()
