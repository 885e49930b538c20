"""Tokenizers: byte round trips, a real tokenizer.json, and TokenizerConfig."""

from __future__ import annotations

import json
import os

import pytest
from titan.train.data import ByteTokenizer, HFTokenizer, TokenizerConfig
from titan.train.data.tokenizer import BYTE_TOKENIZER_FOLDER, write_byte_tokenizer_files


def test_byte_round_trip_and_specials():
    tok = ByteTokenizer()
    ids = tok.encode("héllo ✓", bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert all(0 <= i < 256 for i in ids[1:-1])
    assert tok.decode(ids + [tok.pad_id]) == "héllo ✓"
    assert tok.vocab_size == 259 and len(tok.special_ids) == 3


def test_byte_decode_invalid_utf8_is_replaced():
    assert ByteTokenizer().decode([0xFF, ord("a")]) == "\ufffda"


def test_hf_discovers_specials_and_round_trips(hf_tokenizer_file):
    tok = HFTokenizer(hf_tokenizer_file)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    ids = tok.encode("the lazy fox", bos=True, eos=True)
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) > 3
    assert tok.decode(ids) == "the lazy fox"
    assert tok.vocab_size <= 300


def test_hf_directory_path_and_config_build(hf_tokenizer_file):
    tok = TokenizerConfig(kind="hf", path=str(hf_tokenizer_file.parent)).build()
    assert isinstance(tok, HFTokenizer) and tok.eos_id == 2


def test_hf_tokenizer_config_json_names_specials(hf_tokenizer_file):
    # A tokenizer_config.json beside the file overrides the built-in spellings.
    cfg = {"bos_token": {"content": "</s>"}, "eos_token": "<s>"}
    (hf_tokenizer_file.parent / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = HFTokenizer(hf_tokenizer_file)
    assert (tok.bos_id, tok.eos_id) == (2, 1)


def test_hf_explicit_tokens(hf_tokenizer_file):
    tok = HFTokenizer(hf_tokenizer_file, bos_token="<pad>", eos_token="<s>", pad_token="</s>")
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    with pytest.raises(ValueError, match="--tokenizer.eos_token"):
        HFTokenizer(hf_tokenizer_file, eos_token="<nope>")


def test_hf_missing_file_names_path(tmp_path):
    missing = tmp_path / "nowhere" / "tokenizer.json"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        HFTokenizer(missing)


def test_hf_malformed_file_names_path(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a valid tokenizer.json") as info:
        HFTokenizer(bad)
    assert str(bad) in str(info.value)


@pytest.mark.parametrize("content, kind", [
    # tiktoken's ranks file (Llama 3's original/tokenizer.model, named by torchtitan's earlier job files)
    (b"IQ== 0\nIg== 1\nIw== 2\n", "a tiktoken BPE ranks file"),
    # a SentencePiece ModelProto: field 1 (a piece) first
    (b"\x0a\x09\x0a\x05<unk>\x15\x00\x00\x00\x00", "a SentencePiece model"),
])
def test_another_librarys_tokenizer_file_is_named_with_the_fix(tmp_path, content, kind):
    path = tmp_path / "tokenizer.model"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=f"{kind}.*point --tokenizer.path at the tokenizer.json"):
        HFTokenizer(path)


def test_hf_without_eos_asks_for_flag(tmp_path):
    from tokenizers import Tokenizer, models

    path = tmp_path / "tokenizer.json"
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(path))
    with pytest.raises(ValueError, match="--tokenizer.eos_token"):
        HFTokenizer(path)


def test_tokenizer_config_validation():
    assert isinstance(TokenizerConfig().build(), ByteTokenizer)
    with pytest.raises(ValueError, match="--tokenizer.path"):
        TokenizerConfig(kind="hf")
    with pytest.raises(ValueError, match="--tokenizer.kind hf"):
        TokenizerConfig(kind="byte", path="x/tokenizer.json")
    with pytest.raises(ValueError, match="--tokenizer.kind"):
        TokenizerConfig(kind="sentencepiece")


def test_hub_files_are_the_tokenizer_and_the_side_files_beside_it(hf_tokenizer_file):
    folder = hf_tokenizer_file.parent
    assert TokenizerConfig(kind="hf", path=str(folder)).hub_files() == [str(hf_tokenizer_file)]
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    (folder / "unrelated.txt").write_text("")
    assert TokenizerConfig(kind="hf", path=str(hf_tokenizer_file)).hub_files() == [
        str(hf_tokenizer_file), str(folder / "tokenizer_config.json"), str(folder / "chat_template.jinja")]
    assert [os.path.basename(p) for p in TokenizerConfig().hub_files()] == ["tokenizer.json", "tokenizer_config.json"]


def test_the_byte_tokenizers_hub_form_gives_its_ids(tmp_path):
    """The shipped Hub form is what write_byte_tokenizer_files writes today, and transformers'
    AutoTokenizer and titan's HFTokenizer read it as ByteTokenizer: the bytes, the specials at
    256..258, a text spelling a special token read as bytes (its split_special_tokens)."""
    transformers = pytest.importorskip("transformers")
    written = write_byte_tokenizer_files(tmp_path)
    for path in written:
        shipped = os.path.join(BYTE_TOKENIZER_FOLDER, os.path.basename(path))
        assert json.loads(open(path).read()) == json.loads(open(shipped).read()), "regenerate the shipped files"
    byte = ByteTokenizer()
    hub = transformers.AutoTokenizer.from_pretrained(BYTE_TOKENIZER_FOLDER)
    titan_hf = HFTokenizer(BYTE_TOKENIZER_FOLDER)
    assert (hub.bos_token_id, hub.eos_token_id, hub.pad_token_id, len(hub)) == (256, 257, 258, 259)
    assert (titan_hf.bos_id, titan_hf.eos_id, titan_hf.pad_id, titan_hf.vocab_size) == (256, 257, 258, 259)
    texts = ["sort: cab\nabc", " leading and  double spaces\t", "h\u00e9llo w\u00f6rld \U0001f600", "<|titan_eos|> as text",
             "".join(chr(c) for c in range(1, 256))]
    for text in texts:
        want = byte.encode(text)
        assert hub(text, add_special_tokens=False)["input_ids"] == want, text
        assert hub(text)["input_ids"] == want, text  # no BOS added by default, as ByteTokenizer
        assert hub.decode(want) == text
        assert titan_hf.encode(text) == want, text  # split_special_tokens read by titan too


def test_byte_offsets_point_at_their_characters():
    tok = ByteTokenizer()
    ids, offsets = tok.encode_with_offsets("aé🤖")
    assert ids == tok.encode("aé🤖")
    assert offsets == [(0, 1), (1, 2), (1, 2), (2, 3), (2, 3), (2, 3), (2, 3)]
