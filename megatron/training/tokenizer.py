"""Tokenizers for pretraining: the real Llama 3 tokenizer (offline), local HF tokenizers, NullTokenizer.

Every tokenizer exposes what megatron.core's GPTDataset and the preprocessing tool need:
``vocab_size`` (real vocabulary incl. specials, not padded), ``eod``, ``pad``, ``bos``,
``tokenize(text) -> list[int]``, ``detokenize(ids) -> str``, ``name`` and ``unique_identifiers``
(used by megatron.core to name its dataset index cache).

Nothing is ever downloaded: the Llama 3 ``tokenizer.model`` comes from the ``llama-models`` PyPI
package (``llama_models/llama3/tokenizer.model``), located without importing ``llama_models``
(its import pulls in heavy dependencies).
"""

from __future__ import annotations

import argparse
import base64
import functools
import hashlib
import importlib.util
import os
from collections import OrderedDict
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

TOKENIZER_TYPES = ("Llama3Tokenizer", "HuggingFaceTokenizer", "NullTokenizer")

LLAMA3_SHA256 = "82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55"
LLAMA3_INSTALL_HINT = "pip install --no-deps llama-models==0.3.0"
LLAMA3_LICENSE_NOTICE = (
    "Built with Meta Llama 3. The Llama 3 tokenizer is licensed under the Meta Llama 3 Community "
    "License Agreement (https://llama.meta.com/llama3/license/); use is subject to its terms and "
    "the Llama 3 Acceptable Use Policy.")

# Meta's pre-tokenization regex for Llama 3 (llama_models/llama3/tokenizer.py).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_NUM_SPECIAL = 256
_LLAMA3_NAMED_SPECIALS = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
    "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
    "<|image|>",
)

# Special tokens looked up (in this order) in a HuggingFace tokenizer.json.
HF_EOD_CANDIDATES = ("<|end_of_text|>", "</s>", "<|endoftext|>")
HF_BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<|startoftext|>")
HF_PAD_CANDIDATES = ("<|finetune_right_pad_id|>", "<pad>", "[PAD]", "<|pad|>")

# megatron.core's "no pad token" id (megatron/core/datasets/megatron_dataset.py::_PAD_TOKEN_ID).
NO_PAD_ID = -1


class TokenizerError(ValueError):
    """A tokenizer could not be built or used; the message names the bad value and the fix."""


def llama3_special_tokens() -> List[str]:
    """The 256 Llama 3 special-token strings, in id order (id = 128000 + position)."""
    names = list(_LLAMA3_NAMED_SPECIALS)
    names += [f"<|reserved_special_token_{2 + i}|>"
              for i in range(LLAMA3_NUM_SPECIAL - len(names))]
    return names


# ---------------------------------------------------------------------------------------------
# Command-line flags
# ---------------------------------------------------------------------------------------------


def add_tokenizer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the Megatron-LM style "tokenizer" argument group to `parser` and return it."""
    group = parser.add_argument_group(title="tokenizer")
    group.add_argument("--tokenizer-type", type=str, default="Llama3Tokenizer",
                       choices=list(TOKENIZER_TYPES),
                       help="What type of tokenizer to use. Llama3Tokenizer: Meta's Llama 3 "
                            "tokenizer (128256 ids) read offline from the llama-models package; "
                            "HuggingFaceTokenizer: a local tokenizer.json (file or directory, "
                            "never downloaded); NullTokenizer: text is space-separated integer "
                            "ids (needs --vocab-size).")
    group.add_argument("--tokenizer-model", type=str, default=None,
                       help="Tokenizer file. Llama3Tokenizer: a Llama 3 tokenizer.model "
                            "(default: the one shipped in the llama-models package); "
                            "HuggingFaceTokenizer: a tokenizer.json or a directory holding one.")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="Size of the vocabulary without the end-of-document token; required "
                            "by NullTokenizer (whose eod id is this value).")
    return parser


# ---------------------------------------------------------------------------------------------
# Tokenizer classes
# ---------------------------------------------------------------------------------------------


class _TokenizerBase:
    """Shared helpers; subclasses set name, vocab_size, eod, pad, bos."""

    name: str = ""
    vocab_size: int = 0
    eod: int = 0
    pad: int = NO_PAD_ID
    bos: Optional[int] = None

    @property
    def eos(self) -> int:
        """Alias of eod (megatron.core checks `eos` and `eod` for pad collisions)."""
        return self.eod

    @property
    def unique_identifiers(self) -> "OrderedDict[str, object]":
        """What identifies this tokenizer in megatron.core's dataset cache hashes."""
        return OrderedDict(self._identity())

    def _identity(self) -> Dict[str, object]:
        return {"class": self.name, "vocab_size": self.vocab_size}

    def tokenize(self, text: str) -> List[int]:  # pragma: no cover - interface
        raise NotImplementedError

    def detokenize(self, ids: Sequence[int]) -> str:  # pragma: no cover - interface
        raise NotImplementedError

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod}, "
                f"pad={self.pad}, bos={self.bos})")


def default_llama3_model_path() -> Path:
    """llama_models/llama3/tokenizer.model of the installed llama-models (not imported)."""
    spec = importlib.util.find_spec("llama_models")
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError(
            "Llama3Tokenizer: the llama-models package is not installed; "
            f"{LLAMA3_INSTALL_HINT} or pass --tokenizer-model PATH to a Llama 3 tokenizer.model")
    path = Path(list(spec.submodule_search_locations)[0]) / "llama3" / "tokenizer.model"
    if not path.is_file():
        raise TokenizerError(
            f"Llama3Tokenizer: {path} is missing from the installed llama-models; reinstall with "
            f"{LLAMA3_INSTALL_HINT} or pass --tokenizer-model PATH")
    return path


def file_sha256(path: os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@functools.lru_cache(maxsize=4)
def _load_llama3_encoding(path: str):
    """A tiktoken.Encoding for the verified Llama 3 tokenizer.model at `path` (cached)."""
    import tiktoken

    data = Path(path).read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != LLAMA3_SHA256:
        raise TokenizerError(
            f"Llama3Tokenizer: {path} has sha256 {digest}, not the Llama 3 tokenizer.model "
            f"({LLAMA3_SHA256}); pass the original file or {LLAMA3_INSTALL_HINT}")
    ranks = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    specials = {tok: len(ranks) + i for i, tok in enumerate(llama3_special_tokens())}
    return tiktoken.Encoding(name="llama3", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                             special_tokens=specials)


class Llama3Tokenizer(_TokenizerBase):
    """Meta's Llama 3 tokenizer via tiktoken; ids identical to llama_models' Tokenizer.

    `tokenize` encodes ordinary text: special-token strings inside the text stay plain text.
    """

    name = "Llama3Tokenizer"

    def __init__(self, model_path: Optional[os.PathLike] = None):
        if model_path is None:
            path = default_llama3_model_path()
        else:
            path = Path(model_path)
            if path.is_dir():  # a checkpoint's original/ directory
                path = path / "tokenizer.model"
            if not path.is_file():
                raise TokenizerError(
                    f"--tokenizer-model {model_path}: file not found; pass the path of a Llama 3 "
                    f"tokenizer.model, or omit it to use the llama-models package's copy "
                    f"({LLAMA3_INSTALL_HINT})")
        self.model_path = str(path.resolve())
        try:
            self._enc = _load_llama3_encoding(self.model_path)
        except (ValueError, OSError) as exc:
            if isinstance(exc, TokenizerError):
                raise
            raise TokenizerError(f"Llama3Tokenizer: cannot read {self.model_path} as a tiktoken "
                                 f"tokenizer.model ({exc}); pass the original Llama 3 file") from None
        self.vocab_size = self._enc.n_vocab  # 128000 ranks + 256 specials
        specials = self._enc._special_tokens
        self.bos = specials["<|begin_of_text|>"]
        self.eod = specials["<|end_of_text|>"]
        self.pad = specials["<|finetune_right_pad_id|>"]
        self.eot = specials["<|eot_id|>"]
        self.sha256 = LLAMA3_SHA256
        self.license_notice = LLAMA3_LICENSE_NOTICE

    def _identity(self):
        return {"class": self.name, "vocab_size": self.vocab_size, "sha256": self.sha256}

    def tokenize(self, text: str) -> List[int]:
        return self._enc.encode_ordinary(text)

    def tokenize_batch(self, texts: Iterable[str]) -> List[List[int]]:
        return [self._enc.encode_ordinary(t) for t in texts]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._enc.decode([int(i) for i in ids])

    def special_token_id(self, token: str) -> int:
        try:
            return self._enc._special_tokens[token]
        except KeyError:
            raise TokenizerError(f"{token!r} is not a Llama 3 special token; valid: "
                                 f"{', '.join(_LLAMA3_NAMED_SPECIALS)}, ...") from None


class HuggingFaceTokenizer(_TokenizerBase):
    """A local HF `tokenizers` tokenizer.json (file or directory); offline only.

    eod is the first of <|end_of_text|>, </s>, <|endoftext|> present in the vocabulary
    (or `eod_token` if given). pad/bos are looked up the same way; a missing pad is -1
    (megatron.core's "no pad token" value). Special-token strings inside text are encoded as
    plain text, matching Llama3Tokenizer.
    """

    name = "HuggingFaceTokenizer"

    def __init__(self, model_path: Optional[os.PathLike], eod_token: Optional[str] = None):
        if model_path is None:
            raise TokenizerError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model "
                                 "PATH (a local tokenizer.json or a directory containing one)")
        path = Path(model_path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(
                f"--tokenizer-model {model_path}: no tokenizer.json found; pass a local "
                "tokenizer.json file or a directory containing one (nothing is downloaded)")
        from tokenizers import Tokenizer

        try:
            self._tk = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on parse errors
            raise TokenizerError(f"--tokenizer-model {path}: not a valid tokenizer.json "
                                 f"({exc})") from None
        self._tk.encode_special_tokens = True
        self.model_path = str(path.resolve())
        self.vocab_size = self._tk.get_vocab_size(with_added_tokens=True)
        vocab = self._tk.get_vocab(with_added_tokens=True)
        candidates = (eod_token,) if eod_token is not None else HF_EOD_CANDIDATES
        eod = next((vocab[t] for t in candidates if t in vocab), None)
        if eod is None:
            raise TokenizerError(
                f"--tokenizer-model {path}: no end-of-document token; the vocabulary has none of "
                f"{', '.join(candidates)}")
        self.eod = eod
        self.bos = next((vocab[t] for t in HF_BOS_CANDIDATES if t in vocab), None)
        self.pad = next((vocab[t] for t in HF_PAD_CANDIDATES if t in vocab), NO_PAD_ID)
        self.sha256 = file_sha256(path)

    def _identity(self):
        return {"class": self.name, "vocab_size": self.vocab_size, "sha256": self.sha256}

    def tokenize(self, text: str) -> List[int]:
        return self._tk.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tk.decode([int(i) for i in ids], skip_special_tokens=False)


class NullTokenizer(_TokenizerBase):
    """megatron.core's NullTokenizer semantics: text is space-separated integer ids.

    Built with vocab size V: eod = V and the reported vocab_size is V + 1. Like Megatron's
    null tokenizer it has no pad token, so pad is -1 (megatron.core's _PAD_TOKEN_ID) and bos
    is None.
    """

    name = "NullTokenizer"

    def __init__(self, vocab_size: Optional[int]):
        if vocab_size is None:
            raise TokenizerError("--tokenizer-type NullTokenizer needs --vocab-size N "
                                 "(the number of ids before the end-of-document id)")
        if int(vocab_size) < 1:
            raise TokenizerError(f"--vocab-size {vocab_size}: must be a positive integer")
        self._vocab_size_without_eod = int(vocab_size)
        self.eod = self._vocab_size_without_eod
        self.vocab_size = self._vocab_size_without_eod + 1
        self.pad = NO_PAD_ID
        self.bos = None

    def tokenize(self, text: str) -> List[int]:
        ids = []
        for word in text.split():
            try:
                ids.append(int(word))
            except ValueError:
                raise TokenizerError(f"NullTokenizer: {word!r} is not an integer id; its text "
                                     "must be space-separated integers") from None
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


# ---------------------------------------------------------------------------------------------
# Factory and padding
# ---------------------------------------------------------------------------------------------


def build_tokenizer(args) -> _TokenizerBase:
    """The tokenizer named by args.tokenizer_type (with args.tokenizer_model, args.vocab_size)."""
    kind = getattr(args, "tokenizer_type", None) or "Llama3Tokenizer"
    model = getattr(args, "tokenizer_model", None)
    if kind == "Llama3Tokenizer":
        return Llama3Tokenizer(model)
    if kind == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(model)
    if kind == "NullTokenizer":
        return NullTokenizer(getattr(args, "vocab_size", None))
    raise TokenizerError(f"--tokenizer-type {kind}: unknown tokenizer type; choose one of "
                         f"{', '.join(TOKENIZER_TYPES)}")


def vocab_size_with_padding(orig_vocab_size: int, make_vocab_size_divisible_by: int,
                            tensor_model_parallel_size: int) -> int:
    """Megatron's rule: round V up to a multiple of make_vocab_size_divisible_by x TP."""
    for label, value in (("vocab size", orig_vocab_size),
                         ("--make-vocab-size-divisible-by", make_vocab_size_divisible_by),
                         ("--tensor-model-parallel-size", tensor_model_parallel_size)):
        if int(value) < 1:
            raise TokenizerError(f"{label} {value}: must be a positive integer")
    multiple = int(make_vocab_size_divisible_by) * int(tensor_model_parallel_size)
    return -(-int(orig_vocab_size) // multiple) * multiple
