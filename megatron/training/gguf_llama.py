"""GGUF files (llama.cpp's format) of Llama models, read as a HuggingFace Llama directory is.

`tools/convert_hf.py import MODEL.gguf CKPT_DIR` and `tools/evaluate.py --load-hf MODEL.gguf`
read a .gguf file through `GGUFModel`: its metadata become the config.json of the same network
(`hf_config`, then hf_llama_mapping.model_args_from_hf checks it like any config), its tensors
are renamed to HF's names, dequantized to float32 with the `gguf` package's own reader (every
type that reader can dequantize: F32, F16, BF16, Q4_0 ... Q8_0, the K-quants, IQ types), and
the query and key projections get back HF's row order: llama.cpp's converter permutes their
rows per head from the rotate-half layout into interleaved pairs (`_unpermute` inverts it),
and megatron-core's non-interleaved rotary embedding is HF's. The vocabulary of a byte-level
BPE ('gpt2' tokenizer model) becomes a HuggingFace tokenizer.json (`tokenizer_json`).

What is refused, in one line naming the key or tensor: an architecture other than 'llama',
Llama variants megatron-core's layers do not compute (biases, experts, rotary scaling, rotary
on part of a head), tensor data beyond the end of the file (truncated), data regions that
overlap or shapes that contradict the metadata (a lying header), a file that is not a regular
file (a FIFO would block the reader).
"""

from __future__ import annotations

import os
import stat
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from megatron.training.errors import ConfigError

GGUF_PIN = "gguf==0.19.0"
GGUF_SUFFIX = ".gguf"

# GGUF tensor name (blk.N. stripped) -> HF name (model.layers.N. added).
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}

# llama.cpp pre-tokenizers of byte-level BPE vocabularies, by the regex they split with.
_LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3")
_DIGITS_THEN_GPT2_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                         "minerva")
_GPT2_PRE = ("gpt2", "default", "gpt-2")
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


def is_gguf(path: str) -> bool:
    return str(path).lower().endswith(GGUF_SUFFIX)


def check_regular_file(path: str, what: str) -> None:
    """ConfigError unless `path` is a regular file (a FIFO or device would block or never end
    a read)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file; pass {what}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(mode):
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
        raise ConfigError(f"{path} is {kind}, not a regular file; pass {what}")


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ConfigError(f"the gguf package (llama.cpp's reader) is not installed: pip install "
                          f"{GGUF_PIN} (listed in requirements-cpu.txt)") from None
    return gguf


def _value(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        return field.contents()
    except Exception:          # noqa: BLE001 - a damaged field: the caller names the key
        raise ConfigError(f"GGUF metadata {key}: unreadable value") from None


class GGUFModel:
    """A .gguf file's Llama network: `config` (config.json fields), `shapes` and `dtypes` by HF
    tensor name, `read(name)` (float32, HF layout), and the tokenizer (`tokenizer_json`)."""

    def __init__(self, path: str):
        self.path = path
        check_regular_file(path, "a .gguf model file")
        gguf = _gguf()
        try:
            self._reader = gguf.GGUFReader(path)
        except (ValueError, IndexError, KeyError, OSError, TypeError) as exc:
            raise ConfigError(f"{path}: not a complete GGUF file ({exc}); the file is truncated "
                              "or its header is damaged") from None
        reader = self._reader
        self.architecture = _value(reader, "general.architecture")
        if self.architecture != "llama":
            raise ConfigError(f"{path}: general.architecture {self.architecture!r}: this "
                              "converter reads Llama models only (architecture 'llama')")
        self._tensors = {}
        size = os.path.getsize(path)
        regions = []
        for tensor in reader.tensors:
            end = tensor.data_offset + tensor.n_bytes
            if end > size:
                raise ConfigError(f"{path}: tensor {tensor.name}'s data ends at byte {end:,}, "
                                  f"the file has {size:,} bytes: truncated")
            regions.append((tensor.data_offset, end, tensor.name))
            self._tensors[self._hf_name(tensor.name)] = tensor
        regions.sort()
        for (_, end, name), (start, _, other) in zip(regions, regions[1:]):
            if start < end:
                raise ConfigError(f"{path}: the data of tensors {name} and {other} overlap: the "
                                  "header's shapes do not match the data")
        self.config = self._config()
        self.shapes = {name: tuple(int(d) for d in reversed(t.shape.tolist()))
                       for name, t in self._tensors.items()}
        self.dtypes = {name: "F32" for name in self._tensors}   # read() dequantizes to float32
        self.tensor_types = {name: t.tensor_type.name for name, t in self._tensors.items()}

    def _hf_name(self, name: str) -> str:
        if name in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[name]
        parts = name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
            if parts[2] in _LAYER_NAMES:
                return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
            if parts[2].endswith(".bias"):
                raise ConfigError(f"{self.path}: tensor {name}: biases are not supported "
                                  "(megatron-core's Llama layers have none)")
            if "_exps" in parts[2] or "ffn_gate_inp" in parts[2]:
                raise ConfigError(f"{self.path}: tensor {name}: mixture-of-experts Llama "
                                  "variants are not converted")
        if name == "rope_freqs.weight":
            raise ConfigError(f"{self.path}: tensor rope_freqs.weight (per-frequency rotary "
                              "scaling factors, as Llama 3.1 GGUFs store their rope scaling): "
                              "not converted; import the HuggingFace directory instead")
        raise ConfigError(f"{self.path}: tensor {name}: not a tensor of a Llama model this "
                          "converter maps")

    def _config(self) -> dict:
        r, path = self._reader, self.path

        def need(key):
            value = _value(r, key)
            if value is None:
                raise ConfigError(f"{path}: GGUF metadata {key} is missing")
            return value

        experts = _value(r, "llama.expert_count", 0) or 0
        if experts:
            raise ConfigError(f"{path}: llama.expert_count {experts}: mixture-of-experts Llama "
                              "variants are not converted")
        scaling = _value(r, "llama.rope.scaling.type", "none")
        if scaling not in ("none", None):
            raise ConfigError(f"{path}: llama.rope.scaling.type {scaling!r}: rotary scaling "
                              "other than none is not converted")
        hidden, heads = int(need("llama.embedding_length")), int(need("llama.attention.head_count"))
        groups = int(_value(r, "llama.attention.head_count_kv", heads))
        if heads <= 0 or hidden <= 0 or groups <= 0:
            raise ConfigError(f"{path}: llama.embedding_length {hidden}, head_count {heads}, "
                              f"head_count_kv {groups}: must be positive")
        head_dim = int(_value(r, "llama.attention.key_length", hidden // heads))
        value_dim = int(_value(r, "llama.attention.value_length", head_dim))
        if value_dim != head_dim:
            raise ConfigError(f"{path}: llama.attention.value_length {value_dim} differs from "
                              f"key_length {head_dim}: not converted")
        rope_dims = int(_value(r, "llama.rope.dimension_count", head_dim))
        if rope_dims != head_dim:
            raise ConfigError(f"{path}: llama.rope.dimension_count {rope_dims}: rotary "
                              f"embedding on part of each head ({head_dim} channels) is not "
                              "converted")
        tokens = _value(r, "tokenizer.ggml.tokens")
        vocab = int(_value(r, "llama.vocab_size", len(tokens) if tokens else 0) or 0)
        if vocab <= 0 and "model.embed_tokens.weight" in self._tensors:
            vocab = int(self._tensors["model.embed_tokens.weight"].shape[-1])
        config = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": hidden, "intermediate_size": int(need("llama.feed_forward_length")),
            "num_hidden_layers": int(need("llama.block_count")),
            "num_attention_heads": heads, "num_key_value_heads": groups, "head_dim": head_dim,
            "max_position_embeddings": int(_value(r, "llama.context_length", 2048)),
            "rms_norm_eps": float(need("llama.attention.layer_norm_rms_epsilon")),
            "rope_theta": float(_value(r, "llama.rope.freq_base", 10000.0)),
            "vocab_size": vocab, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
        }
        for key, name in (("tokenizer.ggml.bos_token_id", "bos_token_id"),
                          ("tokenizer.ggml.eos_token_id", "eos_token_id")):
            value = _value(r, key)
            if value is not None:
                config[name] = int(value)
        label = _value(r, "general.name")
        if label:
            config["_name_or_path"] = str(label)
        return config

    # -- tensors ---------------------------------------------------------------------------

    def dtype(self, names) -> torch.dtype:
        return torch.float32

    def read(self, name: str) -> torch.Tensor:
        """The tensor `name` (HF name) in float32 and HF's layout."""
        gguf = _gguf()
        tensor = self._tensors[name]
        try:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise ConfigError(f"{self.path}: tensor {tensor.name} is of type "
                              f"{tensor.tensor_type.name}, which the gguf package cannot "
                              "dequantize") from None
        except ValueError as exc:
            raise ConfigError(f"{self.path}: tensor {tensor.name}: data do not match its "
                              f"shape ({exc})") from None
        array = np.asarray(array, dtype=np.float32).reshape(self.shapes[name])
        out = torch.from_numpy(array.copy())
        if name.endswith("self_attn.q_proj.weight"):
            out = _unpermute(out, self.config["num_attention_heads"])
        elif name.endswith("self_attn.k_proj.weight"):
            out = _unpermute(out, self.config["num_key_value_heads"])
        return out

    def close(self) -> None:
        self._reader = None

    # -- tokenizer -------------------------------------------------------------------------

    def tokenizer_json(self) -> Tuple[Optional[str], str]:
        """(tokenizer.json text or None, what it is or why there is none)."""
        r = self._reader
        kind = _value(r, "tokenizer.ggml.model")
        if kind is None:
            return None, "the file has no tokenizer"
        if kind != "gpt2":
            return None, (f"tokenizer.ggml.model {kind!r} (only byte-level BPE vocabularies, "
                          "'gpt2', are converted to tokenizer.json)")
        pre = _value(r, "tokenizer.ggml.pre", "default")
        if pre not in _LLAMA3_PRE + _DIGITS_THEN_GPT2_PRE + _GPT2_PRE:
            return None, f"tokenizer.ggml.pre {pre!r} (a pre-tokenizer not converted)"
        tokens = _value(r, "tokenizer.ggml.tokens") or []
        merges = _value(r, "tokenizer.ggml.merges") or []
        types = _value(r, "tokenizer.ggml.token_type") or [1] * len(tokens)
        return _byte_level_bpe_json(tokens, merges, types, pre), (
            f"byte-level BPE of {len(tokens):,} entries (pre-tokenizer {pre!r})")


def _unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's row order of a query or key projection from llama.cpp's: per head, llama.cpp
    interleaves the two rotary halves (rows r and r + d/2 become rows 2r and 2r + 1)."""
    rows, cols = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _byte_level_bpe_json(tokens: List[str], merges: List[str], types: List[int],
                         pre: str) -> str:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre in _LLAMA3_PRE))
    if pre in _LLAMA3_PRE:
        from megatron.training.tokenizer import LLAMA3_PATTERN

        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre in _DIGITS_THEN_GPT2_PRE:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken

    specials = [AddedToken(tokens[i], special=True, normalized=False)
                for i, t in enumerate(types) if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)]
    if specials:
        tk.add_special_tokens(specials)
    return tk.to_str()
