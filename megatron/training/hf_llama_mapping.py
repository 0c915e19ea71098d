"""HuggingFace Llama 3.x <-> this project's GPT model: the config and tensor mappings.

Pure functions, no megatron-core: `model_args_from_hf` turns a config.json dict into the model
arguments (the argument dests of model_args.MODEL_ARGS) of the same network and refuses, in one
line naming the field, whatever megatron-core's GPT layers cannot represent;
`hf_config_from_model_args` is its inverse. `megatron_tensors` and `hf_tensors` map the weights
both ways, one tensor at a time (a reader function supplies the inputs, so a caller can read
them lazily from safetensors files or a model).

Megatron names are those of `GPTModel.state_dict()` with one pipeline stage and no tensor
parallelism; megatron-core's sharded state dict splits these tensors for any TP/PP layout when
a checkpoint is saved or loaded (for linear_fc1, each tensor-parallel rank's [gate; up] slice).

    HF                                   megatron                            transform
    model.embed_tokens [V, h]            embedding.word_embeddings [Vp, h]    zero rows to Vp
    layers.i.input_layernorm             decoder.layers.i.input_layernorm     copy
    self_attn.q_proj [np*d, h],          self_attention.linear_qkv            per query group:
      k_proj, v_proj [ng*d, h]                                                its np/ng query
                                                                              heads, its k, its v
    self_attn.o_proj                     self_attention.linear_proj           copy
    post_attention_layernorm             pre_mlp_layernorm                    copy
    mlp.gate_proj, mlp.up_proj [F, h]    mlp.linear_fc1 [2F, h]               [gate; up]
    mlp.down_proj                        mlp.linear_fc2                       copy
    model.norm                           decoder.final_layernorm              copy
    lm_head (untied only) [V, h]         output_layer [Vp, h]                 zero rows to Vp

(every name ends in .weight; Vp is the padded vocabulary, SiLU applies to fc1's first half).

RoPE: HF's rotate-half is megatron-core's non-interleaved rotary embedding, so q and k need no
permutation. Llama 3 scaling: megatron-core 0.16's RotaryEmbedding takes only the factor and
hard-codes the rest (LLAMA3_ROPE_FIXED), so a config with other values is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Mapping, Optional, Tuple

import torch

from megatron.training.errors import ConfigError

SUPPORTED = ("Llama 3.x checkpoints (model_type 'llama', LlamaForCausalLM: RMSNorm, SwiGLU, "
             "grouped-query attention, rotary embedding with optional Llama 3 scaling, no "
             "biases)")

# What megatron-core 0.16.1's RotaryEmbedding._apply_scaling fixes (only `factor` is passed).
LLAMA3_ROPE_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

# HF tensors that hold no weights (older exports saved the rotary table).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _refuse(field: str, value, problem: str) -> ConfigError:
    return ConfigError(f"config.json: {field} {value!r}: {problem}; this converter supports "
                       f"{SUPPORTED}")


def _rope_settings(config: Mapping) -> Tuple[float, Optional[float]]:
    """(rope theta, Llama 3 scaling factor or None) from either spelling of the config: the
    `rope_scaling` + `rope_theta` of transformers 4, or the `rope_parameters` of transformers 5."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    field = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type")) or "default"
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise _refuse("partial_rotary_factor", partial,
                      "rotary embedding on part of each head is not converted")
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise _refuse(f"{field}.rope_type", rope_type,
                      "megatron-core's GPT model has the Llama 3 scaling only ('llama3' or "
                      "'default')")
    for name, fixed in LLAMA3_ROPE_FIXED.items():
        if name not in params or float(params[name]) != fixed:
            raise _refuse(f"{field}.{name}", params.get(name),
                          f"megatron-core 0.16's Llama 3 rope scaling fixes {name} = "
                          f"{fixed:g} (only the factor is configurable)")
    return theta, float(params["factor"])


def _positive_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(float(value)) and float(value) > 0


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def model_args_from_hf(config: Mapping) -> Tuple[Dict[str, object], int]:
    """(model arguments by argument dest, vocabulary size) of the network a config.json
    describes; ConfigError (one line naming the field) for anything not representable."""
    model_type = config.get("model_type")
    if model_type != "llama":
        raise _refuse("model_type", model_type, "not a Llama model")
    architectures = config.get("architectures") or ["LlamaForCausalLM"]
    if "LlamaForCausalLM" not in architectures:
        raise _refuse("architectures", architectures, "only LlamaForCausalLM has the output "
                      "layer a language model needs")
    for field in ("attention_bias", "mlp_bias"):
        if config.get(field, False):
            raise _refuse(field, config[field], "biases are not supported (megatron-core's "
                          "Llama layers have none: --disable-bias-linear)")
    if config.get("hidden_act", "silu") != "silu":
        raise _refuse("hidden_act", config["hidden_act"], "the MLP must be SwiGLU (silu)")
    if config.get("quantization_config"):
        raise _refuse("quantization_config", config["quantization_config"].get("quant_method"),
                      "quantized checkpoints are not read (export them in bf16 or fp32)")
    theta, factor = _rope_settings(config)
    if not _positive_number(theta):
        raise _refuse("rope_theta", theta, "must be a finite number > 0")
    if float(theta) != int(theta):
        raise _refuse("rope_theta", theta, "--rotary-base is an integer")
    if factor is not None and not _positive_number(factor):
        raise _refuse("rope_scaling.factor", factor, "must be a finite number > 0")
    eps = config.get("rms_norm_eps", 1e-6)
    if not _positive_number(eps) or float(eps) >= 1:
        raise _refuse("rms_norm_eps", eps, "must be a finite number in (0, 1)")
    for field in ("num_attention_heads", "hidden_size", "num_hidden_layers",
                  "intermediate_size", "vocab_size"):
        if field not in config:
            raise _refuse(field, None, "missing")
        if not _positive_int(config[field]):
            raise _refuse(field, config[field], "must be a positive integer")
    for field in ("num_key_value_heads", "head_dim", "max_position_embeddings"):
        if config.get(field) is not None and not _positive_int(config[field]):
            raise _refuse(field, config[field], "must be a positive integer")
    dropout = config.get("attention_dropout", 0.0)
    if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) \
            or not 0 <= float(dropout) < 1:
        raise _refuse("attention_dropout", dropout, "must be a number in [0, 1)")
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    groups = int(config.get("num_key_value_heads") or heads)
    if heads % groups:
        raise _refuse("num_key_value_heads", groups,
                      f"must divide num_attention_heads {heads}")
    args = {
        "num_layers": int(config["num_hidden_layers"]),
        "hidden_size": hidden,
        "ffn_hidden_size": int(config["intermediate_size"]),
        "num_attention_heads": heads,
        "group_query_attention": True,
        "num_query_groups": groups,
        "kv_channels": int(config.get("head_dim") or hidden // heads),
        "max_position_embeddings": int(config.get("max_position_embeddings", 2048)),
        "position_embedding_type": "rope",
        "rotary_base": int(theta),
        "rotary_percent": 1.0,
        "use_rope_scaling": factor is not None,
        "normalization": "RMSNorm",
        "layernorm_epsilon": float(config.get("rms_norm_eps", 1e-6)),
        "swiglu": True,
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", False),
        "add_bias_linear": False,
        "qk_layernorm": False,
        "attention_dropout": float(config.get("attention_dropout", 0.0)),
        "hidden_dropout": 0.0,
    }
    if factor is not None:
        args["rope_scaling_factor"] = factor
    return args, int(config["vocab_size"])


# Model arguments a Llama config.json can express, with the value it needs.
_LLAMA_ONLY = (
    ("multi_latent_attention", False, "--multi-latent-attention"),
    ("num_experts", None, "--num-experts"),
    ("normalization", "RMSNorm", "--normalization"),
    ("swiglu", True, "--swiglu"),
    ("add_bias_linear", False, "--disable-bias-linear"),
    ("position_embedding_type", "rope", "--position-embedding-type"),
    ("rotary_percent", 1.0, "--rotary-percent"),
    ("qk_layernorm", False, "--qk-layernorm"),
)


def hf_config_from_model_args(model_args: Mapping, vocab_size: int, dtype: torch.dtype,
                              base: Optional[Mapping] = None) -> Dict[str, object]:
    """The config.json of a checkpoint's network (transformers 4 and 5 read this spelling).
    `base` (the imported config.json, when the checkpoint has one) keeps the fields the model
    arguments do not hold, such as the token ids; the architecture comes from `model_args`."""
    for name, needed, flag in _LLAMA_ONLY:
        if model_args.get(name, needed) != needed:
            raise ConfigError(f"the checkpoint's model has {flag} {model_args[name]!r} "
                              f"(Llama needs {needed!r}): export writes {SUPPORTED}")
    config = {k: v for k, v in (base or {}).items()
              if k not in ("rope_parameters", "rope_scaling", "rope_theta", "torch_dtype",
                           "dtype", "transformers_version")}
    heads = model_args["num_attention_heads"]
    scaling = None
    if model_args.get("use_rope_scaling"):
        scaling = {"rope_type": "llama3", "factor": float(model_args["rope_scaling_factor"]),
                   **LLAMA3_ROPE_FIXED}
    config.update({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab_size),
        "hidden_size": model_args["hidden_size"],
        "intermediate_size": model_args["ffn_hidden_size"],
        "num_hidden_layers": model_args["num_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": (model_args["num_query_groups"]
                                if model_args.get("group_query_attention") else heads),
        "head_dim": model_args["kv_channels"],
        "hidden_act": "silu",
        "max_position_embeddings": model_args["max_position_embeddings"],
        "rms_norm_eps": model_args["layernorm_epsilon"],
        "rope_theta": float(model_args["rotary_base"]),
        "rope_scaling": scaling,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": model_args.get("attention_dropout", 0.0),
        "tie_word_embeddings": not model_args["untie_embeddings_and_output_weights"],
        "torch_dtype": DTYPE_NAMES[dtype],
    })
    return config


@dataclass(frozen=True)
class LlamaLayout:
    """The tensor shapes of one network, from its model arguments."""
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_groups: int
    head_dim: int
    vocab_size: int             # the tokenizer's (HF's vocab_size)
    padded_vocab_size: int      # megatron's embedding rows
    tied: bool

    @classmethod
    def from_model_args(cls, model_args: Mapping, vocab_size: int,
                        padded_vocab_size: int) -> "LlamaLayout":
        heads = model_args["num_attention_heads"]
        return cls(
            num_layers=model_args["num_layers"], hidden_size=model_args["hidden_size"],
            ffn_hidden_size=model_args["ffn_hidden_size"], num_heads=heads,
            num_groups=(model_args["num_query_groups"]
                        if model_args.get("group_query_attention") else heads),
            head_dim=model_args["kv_channels"], vocab_size=vocab_size,
            padded_vocab_size=padded_vocab_size,
            tied=not model_args["untie_embeddings_and_output_weights"])

    def hf_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """Every HF tensor of the network and its shape."""
        h, d, f = self.hidden_size, self.head_dim, self.ffn_hidden_size
        shapes = {"model.embed_tokens.weight": (self.vocab_size, h), "model.norm.weight": (h,)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes.update({
                p + "input_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (self.num_heads * d, h),
                p + "self_attn.k_proj.weight": (self.num_groups * d, h),
                p + "self_attn.v_proj.weight": (self.num_groups * d, h),
                p + "self_attn.o_proj.weight": (h, self.num_heads * d),
                p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate_proj.weight": (f, h),
                p + "mlp.up_proj.weight": (f, h),
                p + "mlp.down_proj.weight": (h, f),
            })
        if not self.tied:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes


def check_hf_tensors(found: Mapping[str, Tuple[int, ...]], layout: LlamaLayout,
                     where: str) -> None:
    """ConfigError (one line) unless `found` (name -> shape of the HF files in `where`) holds
    exactly the tensors config.json implies: none missing, none of another shape, none left
    unconverted (a bias the config does not declare, for instance)."""
    expected = layout.hf_shapes()
    for name, shape in expected.items():
        if name not in found:
            raise ConfigError(f"{where}: tensor {name} is missing (config.json implies it)")
        if tuple(found[name]) != shape:
            raise ConfigError(f"{where}: tensor {name} has shape {list(found[name])}, "
                              f"config.json implies {list(shape)}")
    extra = sorted(n for n in found if n not in expected and not n.endswith(_IGNORED_SUFFIXES)
                   and not (layout.tied and n == "lm_head.weight"))
    if extra:
        raise ConfigError(f"{where}: {len(extra)} tensor(s) this converter does not map, e.g. "
                          f"{extra[0]}; it converts {SUPPORTED}")


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             layout: LlamaLayout) -> torch.Tensor:
    """megatron's linear_qkv: for each query group, its query heads, its key, its value."""
    g, d, h = layout.num_groups, layout.head_dim, q.shape[1]
    per_group = layout.num_heads // g
    return torch.cat([q.reshape(g, per_group * d, h), k.reshape(g, d, h), v.reshape(g, d, h)],
                     dim=1).reshape(-1, h)


def split_qkv(qkv: torch.Tensor, layout: LlamaLayout):
    """(q, k, v) from megatron's linear_qkv (new tensors, sharing no memory)."""
    g, d, h = layout.num_groups, layout.head_dim, qkv.shape[1]
    per_group = layout.num_heads // g
    q, k, v = torch.split(qkv.reshape(g, (per_group + 2) * d, h), [per_group * d, d, d], dim=1)
    return q.reshape(-1, h).clone(), k.reshape(-1, h).clone(), v.reshape(-1, h).clone()


def pad_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """`weight` with zero rows appended up to `rows` (the padded vocabulary)."""
    if weight.shape[0] == rows:
        return weight
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], *weight.shape[1:])])


# (HF name, megatron name) of the tensors copied as they are, within a layer.
_LAYER_COPIES = (
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
    ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),
    ("mlp.down_proj.weight", "mlp.linear_fc2.weight"),
)

Reader = Callable[[str], torch.Tensor]


def megatron_tensors(read: Reader, layout: LlamaLayout) -> Iterator[Tuple[str, torch.Tensor]]:
    """(megatron name, tensor) for every weight, computed from `read(hf_name)`."""
    yield "embedding.word_embeddings.weight", pad_rows(read("model.embed_tokens.weight"),
                                                       layout.padded_vocab_size)
    for i in range(layout.num_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_name, mg_name in _LAYER_COPIES:
            yield mg + mg_name, read(hf + hf_name)
        yield mg + "self_attention.linear_qkv.weight", fuse_qkv(
            read(hf + "self_attn.q_proj.weight"), read(hf + "self_attn.k_proj.weight"),
            read(hf + "self_attn.v_proj.weight"), layout)
        yield mg + "mlp.linear_fc1.weight", torch.cat(
            [read(hf + "mlp.gate_proj.weight"), read(hf + "mlp.up_proj.weight")])
    yield "decoder.final_layernorm.weight", read("model.norm.weight")
    if not layout.tied:
        yield "output_layer.weight", pad_rows(read("lm_head.weight"), layout.padded_vocab_size)


def hf_tensors(read: Reader, layout: LlamaLayout) -> Iterator[Tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every weight, computed from `read(megatron_name)`; the vocabulary
    padding is dropped. Tensors cut out of a fused one are copies (safetensors stores no two
    tensors sharing memory)."""
    yield "model.embed_tokens.weight", read("embedding.word_embeddings.weight")[:layout.vocab_size]
    for i in range(layout.num_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_name, mg_name in _LAYER_COPIES:
            yield hf + hf_name, read(mg + mg_name)
        q, k, v = split_qkv(read(mg + "self_attention.linear_qkv.weight"), layout)
        yield hf + "self_attn.q_proj.weight", q
        yield hf + "self_attn.k_proj.weight", k
        yield hf + "self_attn.v_proj.weight", v
        gate, up = read(mg + "mlp.linear_fc1.weight").chunk(2)
        yield hf + "mlp.gate_proj.weight", gate.clone()
        yield hf + "mlp.up_proj.weight", up.clone()
    yield "model.norm.weight", read("decoder.final_layernorm.weight")
    if not layout.tied:
        yield "lm_head.weight", read("output_layer.weight")[:layout.vocab_size]
