"""The model arguments a checkpoint records, and `--load` taking them from it.

Every checkpoint's common state holds `model_args`: the values of MODEL_ARGS, the flags that
define the network (its parameter shapes and what its forward computes), and the vocabulary size
of the tokenizer it was made for. `parse_args` calls `recorded_model_args` and
`take_model_args` when --load is given: each model flag set neither on the command line nor by
--model-preset takes the checkpoint's value, so `pretrain_gpt.py --load DIR` needs no model
flags. Flags given that contradict the checkpoint's shapes still stop the load with
`checkpointing.check_model_shape`'s error.

A checkpoint made by an import (hf_llama.py: a HuggingFace directory or a .gguf file) also
records its tokenizer under TOKENIZER_KEY: `--tokenizer-type HuggingFaceTokenizer` with the
tokenizer.json written into the checkpoint directory (its path recorded relative to it), or
`--tokenizer-type NullTokenizer --vocab-size V-1` where the model came without a usable
tokenizer (V entries, enough for --mock-data). `take_model_args` takes it like a model flag
when no tokenizer flag is given, so `--load CKPT_DIR` needs no tokenizer flags either; a run
that loaded it records it again in its own checkpoints (with the file's absolute path).

The common state is read here with weights_only=True and before --load verifies the checkpoint;
a checkpoint that cannot be read here is left to those checks, which name the damage.
"""

from __future__ import annotations

import os
import pickle
from typing import Dict, Iterable, List, Optional

from megatron.training.checkpoint_files import COMMON_FILE, TRACKER_FILE, checkpoint_dir

# Args that determine parameter shapes; a checkpoint only loads into the same values.
MODEL_SHAPE_ARGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "padded_vocab_size", "normalization", "swiglu", "add_bias_linear",
    "untie_embeddings_and_output_weights", "position_embedding_type", "qk_layernorm",
    "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
    "v_head_dim", "num_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
    "moe_layer_freq",
)

# Every arg that defines the model a checkpoint holds: the shapes (the padded vocabulary
# follows from the tokenizer and make_vocab_size_divisible_by), and what the forward computes
# (positions, normalization, routing, dropout).
MODEL_ARGS = tuple(name for name in MODEL_SHAPE_ARGS if name != "padded_vocab_size") + (
    "group_query_attention", "max_position_embeddings", "rotary_base", "rotary_percent",
    "use_rope_scaling", "rope_scaling_factor", "layernorm_epsilon",
    "make_vocab_size_divisible_by", "attention_dropout", "hidden_dropout",
    "rotary_scaling_factor", "mscale", "mscale_all_dim", "moe_router_topk",
    "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_router_score_function",
    "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_router_dtype",
)

# Common-state keys.
MODEL_ARGS_KEY = "model_args"
TOKENIZER_VOCAB_KEY = "tokenizer_vocab_size"
# The config.json an imported checkpoint came from (its token ids and other fields the model
# arguments do not hold), kept by every later save of a run that loaded it.
HF_CONFIG_KEY = "hf_config"
# Within the recorded model args: the tokenizer of an imported checkpoint, and its file name.
TOKENIZER_KEY = "tokenizer"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_ARGS = ("tokenizer_type", "tokenizer_model", "vocab_size")


def model_shape(args) -> dict:
    return {name: getattr(args, name, None) for name in MODEL_SHAPE_ARGS}


def model_args(args) -> dict:
    """The MODEL_ARGS values of `args` (validated), as a checkpoint records them, with the
    tokenizer of a run whose tokenizer came from an imported checkpoint
    (args.checkpoint_tokenizer)."""
    recorded = {name: _copy(getattr(args, name, None)) for name in MODEL_ARGS}
    tokenizer = getattr(args, "checkpoint_tokenizer", None)
    if isinstance(tokenizer, dict):
        recorded[TOKENIZER_KEY] = dict(tokenizer)
    return recorded


def recorded_tokenizer(recorded: Dict[str, object], load_dir: str) -> Optional[dict]:
    """The tokenizer flags (dest -> value) an imported checkpoint records, its tokenizer.json
    made absolute against `load_dir`; None when it records none."""
    tokenizer = recorded.get(TOKENIZER_KEY)
    if not isinstance(tokenizer, dict) or tokenizer.get("tokenizer_type") is None:
        return None
    out = {k: v for k, v in tokenizer.items() if k in TOKENIZER_ARGS}
    model = out.get("tokenizer_model")
    if model is not None and not os.path.isabs(model):
        out["tokenizer_model"] = os.path.abspath(os.path.join(load_dir, model))
    return out


def _copy(value):
    return list(value) if isinstance(value, (list, tuple)) else value


def read_common_state(load_dir: str) -> Optional[dict]:
    """The common state of the checkpoint the tracker of `load_dir` names, or None when there
    is none or it cannot be read."""
    import torch

    try:
        with open(os.path.join(load_dir, TRACKER_FILE)) as f:
            iteration = int(f.read().strip())
        common = torch.load(os.path.join(checkpoint_dir(load_dir, iteration), COMMON_FILE),
                            map_location="cpu", weights_only=True)
    except (OSError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError):
        return None
    return common if isinstance(common, dict) else None


def recorded_model_args(load_dir: str) -> Optional[Dict[str, object]]:
    """The model args recorded by the checkpoint --load `load_dir` would read, or None (no
    checkpoint, unreadable, or saved before checkpoints recorded them)."""
    common = read_common_state(load_dir)
    recorded = None if common is None else common.get(MODEL_ARGS_KEY)
    return recorded if isinstance(recorded, dict) else None


def take_model_args(args, recorded: Dict[str, object], keep: Iterable[str]) -> List[str]:
    """Set every MODEL_ARGS value of `args` that is not in `keep` (the dests given on the
    command line or by --model-preset) to its recorded value; returns the dests whose value
    changed."""
    keep = set(keep)
    taken = []
    for name in MODEL_ARGS:
        if name in recorded and name not in keep and hasattr(args, name):
            value = _copy(recorded[name])
            if getattr(args, name) != value:
                setattr(args, name, value)
                taken.append(name)
    tokenizer = recorded_tokenizer(recorded, getattr(args, "load", None) or ".")
    if tokenizer is not None and not keep & set(TOKENIZER_ARGS):
        for name in TOKENIZER_ARGS:
            value = tokenizer.get(name)
            if hasattr(args, name) and getattr(args, name) != value:
                setattr(args, name, value)
                taken.append(name)
        args.checkpoint_tokenizer = tokenizer    # recorded again by this run's checkpoints
    return taken


def differing_model_args(args, recorded: Dict[str, object], names: Iterable[str]) -> List[str]:
    """The dests among `names` whose value in `args` differs from the recorded one."""
    return [name for name in names
            if name in MODEL_ARGS and name in recorded and hasattr(args, name)
            and _copy(getattr(args, name)) != _copy(recorded[name])]
