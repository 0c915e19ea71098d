"""Tokenizers: real Llama 3 ids, special tokens, NullTokenizer, local HF files, padding, errors."""

import argparse
import importlib.util
import time

import pytest

from megatron.training import tokenizer as tok_mod
from megatron.training.tokenizer import (
    HuggingFaceTokenizer, Llama3Tokenizer, NullTokenizer, TokenizerError, add_tokenizer_args,
    build_tokenizer, vocab_size_with_padding)


def _args(argv=()):
    return add_tokenizer_args(argparse.ArgumentParser()).parse_args(list(argv))


@pytest.fixture(scope="module")
def llama3():
    return build_tokenizer(_args())


def test_flags_defaults_and_help():
    parser = add_tokenizer_args(argparse.ArgumentParser())
    group = next(g for g in parser._action_groups if g.title == "tokenizer")
    flags = {a.option_strings[0]: a for a in group._group_actions}
    assert set(flags) == {"--tokenizer-type", "--tokenizer-model", "--vocab-size"}
    assert all(a.help for a in flags.values())
    assert flags["--tokenizer-type"].choices == [
        "Llama3Tokenizer", "HuggingFaceTokenizer", "NullTokenizer"]
    args = parser.parse_args([])
    assert (args.tokenizer_type, args.tokenizer_model, args.vocab_size) == (
        "Llama3Tokenizer", None, None)
    with pytest.raises(SystemExit):
        parser.parse_args(["--tokenizer-type", "GPT2BPETokenizer"])


def test_llama3_known_ids(llama3):
    assert llama3.tokenize("The capital of France is Paris.") == [
        791, 6864, 315, 9822, 374, 12366, 13]
    assert llama3.tokenize(" Paris") == [12366]
    assert llama3.tokenize("") == []


def test_llama3_special_ids(llama3):
    assert isinstance(llama3, Llama3Tokenizer) and llama3.name == "Llama3Tokenizer"
    assert llama3.vocab_size == 128256
    assert (llama3.bos, llama3.eod, llama3.pad) == (128000, 128001, 128004)
    assert llama3.eot == 128009
    assert llama3.detokenize([128000]) == "<|begin_of_text|>"
    # Meta: 12 named specials, then reserved_special_token_2 .. _245 up to id 128255.
    assert llama3.detokenize([128255]) == "<|reserved_special_token_245|>"
    assert llama3.unique_identifiers["sha256"] == tok_mod.LLAMA3_SHA256


@pytest.mark.parametrize("text", [
    "Hello, world!",
    "  leading and trailing spaces   ",
    "tabs\tand\nnew\n\nlines\r\nCRLF",
    "digits 1234567890 3.14159 -42 1e10",
    "unicode: naïve café Straße Ελληνικά русский 日本語 中文 한국어 emoji 🎉👍🏽",
    "code: def f(x):\n    return x ** 2  # comment\n",
    "<|begin_of_text|> looks special but is text",
])
def test_llama3_round_trip(llama3, text):
    ids = llama3.tokenize(text)
    assert all(0 <= i < 128000 for i in ids)
    assert llama3.detokenize(ids) == text


def test_special_token_text_is_not_parsed(llama3):
    ids = llama3.tokenize("<|end_of_text|>")
    assert 128001 not in ids and len(ids) > 1
    assert llama3.detokenize(ids) == "<|end_of_text|>"


def test_llama3_loads_fast_and_is_cached():
    tok_mod._load_llama3_encoding.cache_clear()
    start = time.perf_counter()
    Llama3Tokenizer()
    first = time.perf_counter() - start
    start = time.perf_counter()
    Llama3Tokenizer()
    second = time.perf_counter() - start
    assert first < 3.0
    assert second < 0.1


def test_llama3_explicit_path_and_directory(llama3):
    path = llama3.model_path
    by_file = build_tokenizer(_args(["--tokenizer-model", path]))
    by_dir = Llama3Tokenizer(str(tok_mod.Path(path).parent))
    assert by_file.tokenize("abc def") == by_dir.tokenize("abc def") == llama3.tokenize("abc def")


def test_llama3_wrong_path(tmp_path):
    missing = tmp_path / "nope.model"
    with pytest.raises(TokenizerError, match="nope.model: file not found"):
        build_tokenizer(_args(["--tokenizer-model", str(missing)]))


def test_llama3_hash_mismatch_names_path(tmp_path):
    fake = tmp_path / "tokenizer.model"
    fake.write_text("SGVsbG8= 0\n")
    with pytest.raises(TokenizerError, match=r"tokenizer\.model has sha256 .* not the Llama 3"):
        Llama3Tokenizer(str(fake))


def test_llama3_package_missing(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(tok_mod.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llama_models" else real(name, *a))
    with pytest.raises(TokenizerError) as info:
        Llama3Tokenizer()
    message = str(info.value)
    assert "llama-models package is not installed" in message
    assert "pip install --no-deps llama-models==0.3.0" in message
    assert "--tokenizer-model PATH" in message and "\n" not in message


def test_unknown_type():
    with pytest.raises(TokenizerError, match="--tokenizer-type Foo: unknown.*Llama3Tokenizer, "
                                             "HuggingFaceTokenizer, NullTokenizer"):
        build_tokenizer(argparse.Namespace(tokenizer_type="Foo", tokenizer_model=None,
                                           vocab_size=None))


def test_null_tokenizer():
    tok = build_tokenizer(_args(["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]))
    assert isinstance(tok, NullTokenizer)
    assert (tok.vocab_size, tok.eod, tok.pad, tok.bos) == (101, 100, -1, None)
    assert tok.tokenize("5 17 99") == [5, 17, 99]
    assert tok.detokenize([5, 17, 100]) == "5 17 100"
    with pytest.raises(TokenizerError, match="'x' is not an integer"):
        tok.tokenize("1 x 2")
    # Megatron-LM: NullTokenizer --vocab-size 128256 -> 128257 ids, padded to 128384.
    big = NullTokenizer(128256)
    assert vocab_size_with_padding(big.vocab_size, 128, 1) == 128384


def test_null_tokenizer_needs_vocab_size():
    with pytest.raises(TokenizerError, match="NullTokenizer needs --vocab-size"):
        build_tokenizer(_args(["--tokenizer-type", "NullTokenizer"]))
    with pytest.raises(TokenizerError, match="--vocab-size 0"):
        NullTokenizer(0)


@pytest.mark.parametrize("vocab, divisor, tp, expected", [
    (128256, 128, 1, 128256),
    (128257, 128, 1, 128384),
    (50257, 128, 2, 50432),
    (50257, 128, 1, 50304),
    (102400, 3200, 1, 102400),
    (1, 1, 1, 1),
])
def test_vocab_size_with_padding(vocab, divisor, tp, expected):
    assert vocab_size_with_padding(vocab, divisor, tp) == expected


def test_vocab_size_with_padding_rejects_nonpositive():
    with pytest.raises(TokenizerError, match="make-vocab-size-divisible-by 0"):
        vocab_size_with_padding(100, 0, 1)


def _train_hf_tokenizer(path, specials):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["the quick brown fox jumps over the lazy dog"] * 20 + ["pack my box with jugs"] * 5
    tk.train_from_iterator(corpus, trainer)
    tk.save(str(path))
    return tk


def test_huggingface_tokenizer_from_directory(tmp_path):
    _train_hf_tokenizer(tmp_path / "tokenizer.json", ["<pad>", "</s>", "<s>"])
    tok = build_tokenizer(_args(["--tokenizer-type", "HuggingFaceTokenizer",
                                 "--tokenizer-model", str(tmp_path)]))
    assert isinstance(tok, HuggingFaceTokenizer)
    assert (tok.pad, tok.eod, tok.bos) == (0, 1, 2)
    text = "the lazy fox packs a box"
    ids = tok.tokenize(text)
    assert ids and tok.detokenize(ids) == text
    assert 1 not in tok.tokenize("x</s>y")  # special-token text stays text
    assert tok.vocab_size >= 256 + 3


def test_huggingface_tokenizer_errors(tmp_path):
    with pytest.raises(TokenizerError, match="needs --tokenizer-model"):
        build_tokenizer(_args(["--tokenizer-type", "HuggingFaceTokenizer"]))
    with pytest.raises(TokenizerError, match="no tokenizer.json found"):
        HuggingFaceTokenizer(str(tmp_path))
    _train_hf_tokenizer(tmp_path / "tokenizer.json", ["<unk>"])
    with pytest.raises(TokenizerError, match="none of <\\|end_of_text\\|>, </s>, <\\|endoftext\\|>"):
        HuggingFaceTokenizer(str(tmp_path / "tokenizer.json"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not a valid tokenizer.json"):
        HuggingFaceTokenizer(str(tmp_path / "bad"))
