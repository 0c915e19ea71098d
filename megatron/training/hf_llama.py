"""HuggingFace Llama 3.x directories in and out of this project's checkpoints.

    python tools/convert_hf.py import HF_DIR CKPT_DIR [--tensor-model-parallel-size T]
        [--pipeline-model-parallel-size P]
    python tools/convert_hf.py export CKPT_DIR HF_DIR [--dtype {float32,bfloat16,float16}]

Import reads config.json (hf_llama_mapping.model_args_from_hf refuses what it cannot convert)
and the safetensors files (one file, or the shards model.safetensors.index.json lists; nothing
is ever downloaded), builds the whole model in this process (world size 1, gloo, parameters
left uninitialised), copies the tensors in one at a time and saves it with
checkpointing.save_checkpoint: the format, checksums and tracker of a training checkpoint, at
iteration 0, marked weights-only (no optimizer or RNG state), recording the model arguments,
the vocabulary size and config.json. dist_checkpointing stores whole tensors with their shard
layout in the metadata, so the checkpoint loads at any TP/PP. T and P are checked against the
shapes, and T sets the vocabulary padding (--make-vocab-size-divisible-by x T, what a run at
TP=T computes; a run whose padding differs stops at --load with check_model_shape's error).
The parameters keep the dtype of the HF files (float32 where the files mix dtypes).

Export loads a checkpoint of this project (any layout, the tracker's iteration, with or without
optimizer state) into one process and writes config.json and model.safetensors in the
checkpoint's parameter dtype (--dtype casts), without the vocabulary padding. A model that a
Llama config cannot describe (MLA, MoE, LayerNorm, biases, ...) is refused in one line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import warnings
from typing import Dict, List, Optional, Tuple

import torch

from megatron.training import run_lock
from megatron.training.checkpoint_files import (
    COMMON_FILE, METADATA_FILE, TRACKER_FILE, read_metadata)
from megatron.training.errors import ConfigError, TrainingError
from megatron.training.hf_llama_mapping import (
    DTYPE_NAMES, DTYPES, LlamaLayout, check_hf_tensors, hf_config_from_model_args, hf_tensors,
    megatron_tensors, model_args_from_hf)
from megatron.training.gguf_llama import GGUFModel, check_regular_file, is_gguf
from megatron.training.model_args import (
    HF_CONFIG_KEY, MODEL_ARGS_KEY, TOKENIZER_FILE, TOKENIZER_VOCAB_KEY)
from megatron.training.tokenizer import vocab_size_with_padding

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SAFETENSORS_PIN = "safetensors==0.8.0"
# safetensors' dtype names of the weights this converter reads.
_FILE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _safetensors():
    try:
        import safetensors
        import safetensors.torch
    except ImportError:
        raise ConfigError(f"the safetensors package is not installed: pip install "
                          f"{SAFETENSORS_PIN} (listed in requirements-cpu.txt)") from None
    return safetensors


def read_hf_config(hf_dir: str) -> dict:
    """config.json of a local HF directory."""
    path = os.path.join(hf_dir, CONFIG_FILE)
    if not os.path.isdir(hf_dir):
        raise ConfigError(f"{hf_dir}: no such directory; pass a local HuggingFace model "
                          "directory (config.json and *.safetensors; nothing is downloaded) "
                          "or a .gguf file")
    if not os.path.lexists(path):
        raise ConfigError(f"{path} is missing: pass a local HuggingFace model directory "
                          "(config.json and *.safetensors; nothing is downloaded)")
    check_regular_file(path, "a local HuggingFace model directory's config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: unreadable ({exc})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return config


class HFWeights:
    """The tensors of a HF directory's safetensors files, opened once and read by name."""

    def __init__(self, hf_dir: str):
        st = _safetensors()
        self._stack = contextlib.ExitStack()
        self._handles: Dict[str, object] = {}
        self.shapes: Dict[str, tuple] = {}
        self.dtypes: Dict[str, str] = {}
        try:
            for path in self._files(hf_dir):
                try:
                    handle = self._stack.enter_context(st.safe_open(path, framework="pt"))
                except (OSError, st.SafetensorError) as exc:
                    raise ConfigError(f"{path}: unreadable safetensors file ({exc})") from None
                for name in handle.keys():
                    if name in self._handles:
                        raise ConfigError(f"{path}: tensor {name} is in two files")
                    piece = handle.get_slice(name)
                    self._handles[name] = handle
                    self.shapes[name] = tuple(piece.get_shape())
                    self.dtypes[name] = piece.get_dtype()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _files(hf_dir: str) -> List[str]:
        index = os.path.join(hf_dir, INDEX_FILE)
        if os.path.lexists(index):
            check_regular_file(index, "the shards' index")
            try:
                with open(index) as f:
                    names = sorted(set(json.load(f)["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ConfigError(f"{index}: unreadable ({type(exc).__name__}: {exc})") from None
            for name in names:
                if os.path.basename(name) != name or \
                        not os.path.lexists(os.path.join(hf_dir, name)):
                    raise ConfigError(f"{index} lists {name!r}, which is not a file of {hf_dir}")
                check_regular_file(os.path.join(hf_dir, name), "safetensors weights")
            return [os.path.join(hf_dir, name) for name in names]
        names = sorted(n for n in os.listdir(hf_dir) if n.endswith(".safetensors"))
        if not names:
            other = [n for n in sorted(os.listdir(hf_dir)) if n.endswith((".bin", ".pt", ".pth"))]
            hint = (f" ({other[0]} is a pickle, which is not read: save the model with "
                    "transformers' save_pretrained, which writes safetensors)" if other else "")
            raise ConfigError(f"{hf_dir}: no *.safetensors weights{hint}")
        for name in names:     # a FIFO would block the reader forever
            check_regular_file(os.path.join(hf_dir, name), "safetensors weights")
        return [os.path.join(hf_dir, name) for name in names]

    def dtype(self, names) -> torch.dtype:
        """The dtype of the tensors `names`: theirs when they share one, else float32 (every
        one of the read dtypes converts to it exactly)."""
        found = {self.dtypes[n] for n in names}
        unknown = sorted(found - set(_FILE_DTYPES))
        if unknown:
            raise ConfigError(f"the weights hold {unknown[0]} tensors; this converter reads "
                              "float32, bfloat16 and float16 weights")
        return _FILE_DTYPES[found.pop()] if len(found) == 1 else torch.float32

    def read(self, name: str) -> torch.Tensor:
        return self._handles[name].get_tensor(name)

    def close(self) -> None:
        self._stack.close()


# ---------------------------------------------------------------------------------------------
# A model in this process
# ---------------------------------------------------------------------------------------------


def model_namespace(model_args: dict, dtype: torch.dtype, tensor_parallel: int = 1,
                    pipeline_parallel: int = 1) -> argparse.Namespace:
    """Validated pretrain_gpt.py arguments of the model `model_args` describes, in `dtype`
    (validate_args checks the shapes against the parallel sizes, naming the flags)."""
    from megatron.training.arguments import parse_args, validate_args

    precision = {torch.bfloat16: ["--bf16"], torch.float16: ["--fp16"]}.get(dtype, [])
    args = parse_args(["--micro-batch-size", "1", "--train-iters", "1", "--lr", "0",
                       "--mock-data", "--seq-length", "1",
                       "--tensor-model-parallel-size", str(tensor_parallel),
                       "--pipeline-model-parallel-size", str(pipeline_parallel), *precision])
    args.rank, args.world_size = 0, tensor_parallel * pipeline_parallel
    for name, value in model_args.items():
        setattr(args, name, list(value) if isinstance(value, list) else value)
    args.perform_initialization = False          # every weight is overwritten
    return validate_args(args, check_paths=False)


@contextlib.contextmanager
def one_process(args):
    """A world-size-1 gloo group and megatron parallel state for the conversion."""
    from megatron.training.initialize import (
        destroy_distributed, initialize_distributed, set_random_seeds)

    if int(os.environ.get("WORLD_SIZE", "1")) != 1 or torch.distributed.is_initialized():
        raise ConfigError("the conversion runs as one process of its own (not under torchrun, "
                          "not inside a process that initialised torch.distributed)")
    args.distributed_backend = "gloo"
    initialize_distributed(args)
    try:
        set_random_seeds(args.seed)
        yield
    finally:
        destroy_distributed()


def build_model(args):
    """The whole GPTModel (one stage, no TP) on the CPU, weights uninitialised."""
    from megatron.training.model import build_gpt_model, core_transformer_config_from_args

    config = core_transformer_config_from_args(args)
    config.use_cpu_initialization = True
    return build_gpt_model(args, config, args.quant_config)


def _copy_into(model, tensors) -> None:
    """Copy (name, tensor) pairs into the model's weights; every weight must get one."""
    state = model.state_dict()
    expected = {n for n in state if not n.endswith("_extra_state")}
    done = set()
    with torch.no_grad():
        for name, tensor in tensors:
            target = state[name]
            if tuple(target.shape) != tuple(tensor.shape):
                raise RuntimeError(f"{name}: mapped shape {list(tensor.shape)}, the model has "
                                   f"{list(target.shape)}")
            target.copy_(tensor)
            done.add(name)
    if done != expected:
        raise RuntimeError(f"weights left unset: {sorted(expected - done)}")


# ---------------------------------------------------------------------------------------------
# Import and export
# ---------------------------------------------------------------------------------------------


# A record of what an import was made from, in the checkpoint directory (tools/evaluate.py
# --load-hf compares it before reusing an import).
SOURCE_FILE = "imported_from.json"


def source_record(source: str) -> dict:
    """The real path of an HF directory or .gguf file and the name, size and modification
    time of each file an import reads."""
    real = os.path.realpath(source)
    if os.path.isdir(real):
        names = sorted(n for n in os.listdir(real)
                       if n in (CONFIG_FILE, INDEX_FILE, TOKENIZER_FILE)
                       or n.endswith(".safetensors"))
        paths = [os.path.join(real, n) for n in names]
    else:
        paths = [real]
    files = []
    for path in paths:
        st = os.stat(path)
        files.append([os.path.basename(path), st.st_size, st.st_mtime_ns])
    return {"source": real, "files": files}


def read_source_record(ckpt_dir: str) -> Optional[dict]:
    try:
        with open(os.path.join(ckpt_dir, SOURCE_FILE)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


class _Source:
    """An HF directory or a .gguf file: config, weights (shapes, dtype, read) and tokenizer."""

    def __init__(self, source: str):
        self.path = source
        if is_gguf(source):
            self.weights = GGUFModel(source)
            self.config = self.weights.config
            self.kind = f"GGUF ({_type_summary(self.weights.tensor_types)})"
            self.tokenizer_text, self.tokenizer_what = self.weights.tokenizer_json()
            return
        if os.path.lexists(source) and not os.path.isdir(source):
            check_regular_file(source, "a .gguf file or a HuggingFace model directory")
            raise ConfigError(f"{source}: neither a directory nor a .gguf file; pass a local "
                              "HuggingFace model directory (config.json and *.safetensors) "
                              "or a llama.cpp .gguf file")
        self.config = read_hf_config(source)
        self.kind = "HuggingFace safetensors"
        self.weights = None
        tokenizer = os.path.join(source, TOKENIZER_FILE)
        self.tokenizer_text, self.tokenizer_what = None, f"no {TOKENIZER_FILE} in {source}"
        if os.path.lexists(tokenizer):
            check_regular_file(tokenizer, f"the directory's {TOKENIZER_FILE}")
            with open(tokenizer, encoding="utf-8") as f:
                self.tokenizer_text = f.read()
            self.tokenizer_what = f"{source}/{TOKENIZER_FILE}"

    def open_weights(self):
        if self.weights is None:
            self.weights = HFWeights(self.path)
        return self.weights

    def close(self) -> None:
        if self.weights is not None:
            self.weights.close()


def _type_summary(types: Dict[str, str]) -> str:
    counts: Dict[str, int] = {}
    for name in types.values():
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{n} x{c}" for n, c in sorted(counts.items(), key=lambda kv: -kv[1]))


def _finite(read, where: str):
    """`read` that refuses a tensor holding NaN or Inf (every loss would be nan)."""
    def checked(name: str) -> torch.Tensor:
        tensor = read(name)
        bad = int((~torch.isfinite(tensor)).sum()) if tensor.is_floating_point() else 0
        if bad:
            raise ConfigError(f"{where}: tensor {name} holds {bad:,} NaN/Inf value(s) of "
                              f"{tensor.numel():,}: not imported (every loss would be nan)")
        return tensor
    return checked


def _tokenizer_record(source: _Source, vocab_size: int, log) -> Tuple[Optional[str], dict]:
    """(tokenizer.json text to write or None, the tokenizer the checkpoint records)."""
    from megatron.training.tokenizer import HuggingFaceTokenizer, TokenizerError

    null = {"tokenizer_type": "NullTokenizer", "vocab_size": vocab_size - 1}
    why = source.tokenizer_what
    if source.tokenizer_text is not None:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, TOKENIZER_FILE)
            with open(path, "w", encoding="utf-8") as f:
                f.write(source.tokenizer_text)
            try:
                size = HuggingFaceTokenizer(path).vocab_size
            except TokenizerError as exc:
                size, why = None, f"{source.tokenizer_what} unusable ({exc})"
        if size == vocab_size:
            return source.tokenizer_text, {"tokenizer_type": "HuggingFaceTokenizer",
                                           "tokenizer_model": TOKENIZER_FILE}
        if size is not None:
            why = (f"{source.tokenizer_what} has {size:,} entries, the embedding "
                   f"{vocab_size:,}")
    log(f"note: {why}: the checkpoint records --tokenizer-type NullTokenizer --vocab-size "
        f"{vocab_size - 1} ({vocab_size} entries with its end of document), enough for "
        "--mock-data; data tokenized elsewhere needs its tokenizer flags")
    return None, null


def import_checkpoint(hf_dir: str, ckpt_dir: str, tensor_model_parallel_size: int = 1,
                      pipeline_model_parallel_size: int = 1,
                      make_vocab_size_divisible_by: int = 128, log=print) -> str:
    """Import `hf_dir` (a local HF directory or a .gguf file) into a new checkpoint directory
    `ckpt_dir`; returns the iter_* path. ConfigError (one line) for a model or directory this
    converter cannot read. The checkpoint records the model arguments, the tokenizer (its
    tokenizer.json written beside the tracker, or NullTokenizer of the vocabulary's size) and
    where it was imported from (SOURCE_FILE)."""
    from megatron.training import checkpointing

    if os.path.exists(os.path.join(ckpt_dir, TRACKER_FILE)):
        raise ConfigError(f"{ckpt_dir} already holds a checkpoint ({TRACKER_FILE}); import "
                          "into a new or empty directory")
    source = _Source(hf_dir)
    try:
        try:
            model_args, vocab_size = model_args_from_hf(source.config)
        except ConfigError as exc:
            if not is_gguf(hf_dir):
                raise
            raise ConfigError(str(exc).replace("config.json:", f"{hf_dir}: its metadata as "
                                               "config.json:", 1)) from None
        model_args["make_vocab_size_divisible_by"] = make_vocab_size_divisible_by
        weights = source.open_weights()
        padded = vocab_size_with_padding(vocab_size, make_vocab_size_divisible_by,
                                         tensor_model_parallel_size)
        layout = LlamaLayout.from_model_args(model_args, vocab_size, padded)
        check_hf_tensors(weights.shapes, layout, hf_dir)
        dtype = weights.dtype(layout.hf_shapes())
        model_namespace(model_args, dtype, tensor_model_parallel_size,
                        pipeline_model_parallel_size)           # the layout fits the shapes
        tokenizer_text, tokenizer = _tokenizer_record(source, vocab_size, log)
        args = model_namespace(model_args, dtype)
        args.padded_vocab_size, args.tokenizer_vocab_size = padded, vocab_size
        args.hf_config = source.config
        args.checkpoint_tokenizer = tokenizer
        created = not os.path.exists(ckpt_dir)
        lock = run_lock.acquire(ckpt_dir, "CKPT_DIR")
        try:
            with one_process(args):
                model = build_model(args)
                read = _finite(lambda n: weights.read(n).to(dtype), hf_dir)
                try:
                    _copy_into(model, megatron_tensors(read, layout))
                except ConfigError:
                    if created:
                        lock.release()
                        import shutil

                        shutil.rmtree(ckpt_dir, ignore_errors=True)
                    raise
                if tokenizer_text is not None:
                    _write_text(os.path.join(ckpt_dir, TOKENIZER_FILE), tokenizer_text)
                path = checkpointing.save_checkpoint(ckpt_dir, 0, model, None, None, args, 0,
                                                     log=log, weights_only=True)
                _write_text(os.path.join(ckpt_dir, SOURCE_FILE),
                            json.dumps(source_record(hf_dir), indent=1) + "\n")
        finally:
            lock.release()
    finally:
        source.close()
    what = (f"tokenizer {source.tokenizer_what} -> {TOKENIZER_FILE}" if tokenizer_text
            else f"NullTokenizer of {vocab_size} entries")
    log(f"[convert] {hf_dir}: Llama ({source.kind}), {layout.num_layers} layers, hidden "
        f"{layout.hidden_size}, {layout.num_heads} heads / {layout.num_groups} KV groups, "
        f"vocabulary {vocab_size} (padded to {padded} for TP={tensor_model_parallel_size}), "
        f"{DTYPE_NAMES[dtype]}, {what} -> {path}")
    return path


def _write_text(path: str, text: str) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _stored_dtype(ckpt: str, name: str) -> torch.dtype:
    """The dtype a checkpoint stores tensor `name` in (from its metadata, read safely)."""
    entry = read_metadata(os.path.join(ckpt, METADATA_FILE)).state_dict_metadata.get(name)
    dtype = getattr(getattr(entry, "properties", None), "dtype", None)
    if dtype not in DTYPE_NAMES:
        raise ConfigError(f"{ckpt}: no float32, bfloat16 or float16 tensor {name}")
    return dtype


def _existing_model(hf_dir: str) -> Optional[str]:
    if not os.path.isdir(hf_dir):
        return None
    return next((n for n in sorted(os.listdir(hf_dir))
                 if n == CONFIG_FILE or n.endswith(".safetensors")), None)


def _cast(name: str, tensor: torch.Tensor, dtype: torch.dtype, log) -> torch.Tensor:
    """`tensor` in `dtype`; ConfigError where finite values would overflow to inf, one note
    line where nonzero values flush to zero."""
    out = tensor.to(dtype).contiguous()
    if out.dtype == tensor.dtype or not tensor.is_floating_point():
        return out
    wide = tensor.float()
    overflow = int((torch.isinf(out) & torch.isfinite(wide)).sum())
    if overflow:
        limit = torch.finfo(dtype).max
        raise ConfigError(f"--dtype {DTYPE_NAMES[dtype]}: tensor {name} holds {overflow:,} "
                          f"value(s) beyond its range (largest |value| "
                          f"{float(wide.abs().max()):.4g} > {limit:.6g}): they would be "
                          "written as inf; export in bfloat16 or float32")
    flushed = int(((out == 0) & (wide != 0)).sum())
    if flushed:
        log(f"note: --dtype {DTYPE_NAMES[dtype]}: tensor {name}: {flushed:,} nonzero value(s) "
            f"of {tensor.numel():,} below its smallest subnormal "
            f"({torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps:.3g}) are "
            "written as 0")
    return out


def export_checkpoint(ckpt_dir: str, hf_dir: str, dtype: Optional[torch.dtype] = None,
                      log=print) -> str:
    """Export the checkpoint `ckpt_dir`'s tracker names (verified as --load does) to `hf_dir`
    (config.json, model.safetensors); returns hf_dir. `dtype`: default the stored one."""
    from megatron.training import checkpointing

    st = _safetensors()
    if os.path.lexists(hf_dir) and not os.path.isdir(hf_dir):
        raise ConfigError(f"{hf_dir} exists and is not a directory; export into a new or "
                          "empty directory")
    clash = _existing_model(hf_dir)
    if clash is not None:
        raise ConfigError(f"{hf_dir} already holds a model ({clash}); export into a new or "
                          "empty directory")
    found = checkpointing.checkpoint_to_load(ckpt_dir, log=log)
    if found is None:
        raise ConfigError(f"{ckpt_dir}: no checkpoint ({TRACKER_FILE} missing)")
    iteration, ckpt = found
    common = torch.load(os.path.join(ckpt, COMMON_FILE), map_location="cpu", weights_only=True)
    model_args = common.get(MODEL_ARGS_KEY)
    if not isinstance(model_args, dict):
        raise ConfigError(f"{ckpt} records no model arguments (saved before checkpoints "
                          "recorded them): load it with its model flags in pretrain_gpt.py "
                          "and save it again to export it")
    padded = common["model_shape"]["padded_vocab_size"]
    vocab_size = common.get(TOKENIZER_VOCAB_KEY)
    if vocab_size is None:
        vocab_size = padded
        log(f"note: {ckpt} records no tokenizer vocabulary size: the padded vocabulary "
            f"({padded}) is exported")
    stored = _stored_dtype(ckpt, "embedding.word_embeddings.weight")
    dtype = dtype or stored
    config = hf_config_from_model_args(model_args, vocab_size, dtype, common.get(HF_CONFIG_KEY))
    layout = LlamaLayout.from_model_args(model_args, vocab_size, padded)
    args = model_namespace(model_args, stored)
    args.padded_vocab_size, args.tokenizer_vocab_size = padded, common.get(TOKENIZER_VOCAB_KEY)
    args.no_load_rng = args.no_load_optim = True
    with one_process(args):
        model = build_model(args)
        checkpointing.load_checkpoint(ckpt_dir, found, model, None, None, args, log=log)
        state = model.state_dict()
        tensors = {name: _cast(name, tensor, dtype, log)
                   for name, tensor in hf_tensors(state.__getitem__, layout)}
    os.makedirs(hf_dir, exist_ok=True)
    weights_path = os.path.join(hf_dir, WEIGHTS_FILE)
    st.torch.save_file(tensors, weights_path + ".tmp", metadata={"format": "pt"})
    os.replace(weights_path + ".tmp", weights_path)
    with open(os.path.join(hf_dir, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    how = "as stored" if dtype == stored else f"cast from {DTYPE_NAMES[stored]}"
    log(f"[convert] {ckpt} (iteration {iteration}) -> {hf_dir}: {CONFIG_FILE}, {WEIGHTS_FILE} "
        f"({len(tensors)} tensors, {DTYPE_NAMES[dtype]}, {how}; vocabulary {vocab_size})")
    return hf_dir


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="convert_hf.py", allow_abbrev=False,
        description="Convert HuggingFace Llama 3.x models (a local directory: config.json and "
                    "safetensors) to checkpoints of this project and back.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{import,export}")
    imp = commands.add_parser(
        "import", help="HF directory -> checkpoint directory (weights only, iteration 0), "
                       "loadable by pretrain_gpt.py --load without model flags.",
        description="HF directory -> checkpoint directory (weights only, iteration 0).")
    imp.add_argument("hf_dir", metavar="HF_DIR", help="Local HuggingFace model directory.")
    imp.add_argument("ckpt_dir", metavar="CKPT_DIR",
                     help="New checkpoint directory (pass it to pretrain_gpt.py --load).")
    imp.add_argument("--tensor-model-parallel-size", type=int, default=1, metavar="T",
                     help="Tensor-parallel size of the runs that will load the checkpoint: the "
                          "vocabulary is padded as such a run pads it, and the shapes are "
                          "checked against it (default: %(default)s). The weights load into "
                          "any TP/PP layout whose vocabulary padding is the same.")
    imp.add_argument("--pipeline-model-parallel-size", type=int, default=1, metavar="P",
                     help="Pipeline-parallel size the number of layers is checked against "
                          "(default: %(default)s).")
    imp.add_argument("--make-vocab-size-divisible-by", type=int, default=128, metavar="N",
                     help="Pad the vocabulary to a multiple of this value x the tensor-parallel "
                          "size, as pretrain_gpt.py's flag of the same name (default: "
                          "%(default)s; recorded in the checkpoint).")
    exp = commands.add_parser(
        "export", help="Checkpoint directory (any layout, the tracker's iteration) -> HF "
                       "directory with config.json and model.safetensors.",
        description="Checkpoint directory -> HF directory (config.json, model.safetensors).")
    exp.add_argument("ckpt_dir", metavar="CKPT_DIR", help="Checkpoint directory (--save of a run).")
    exp.add_argument("hf_dir", metavar="HF_DIR", help="New output directory.")
    exp.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                     help="dtype of the written weights (default: the checkpoint's parameter "
                          "dtype, bfloat16 for a --bf16 run).")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    from megatron.training.cli import FALLBACK_WARNINGS

    warnings.filterwarnings("ignore", message=FALLBACK_WARNINGS)
    try:
        if args.command == "import":
            import_checkpoint(args.hf_dir, args.ckpt_dir, args.tensor_model_parallel_size,
                              args.pipeline_model_parallel_size,
                              args.make_vocab_size_divisible_by)
        else:
            export_checkpoint(args.ckpt_dir, args.hf_dir,
                              DTYPES[args.dtype] if args.dtype else None)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except TrainingError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"[convert] done in {time.perf_counter() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
