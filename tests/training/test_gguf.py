"""GGUF import (tools/convert_hf.py import MODEL.gguf, tools/evaluate.py --load-hf MODEL.gguf):
a tiny Llama written by the gguf package's own writer, its matrices quantized to Q4_1 and Q8_0
and its query/key rows permuted as llama.cpp's converter permutes them, with a byte-level BPE
in its metadata. The reference is transformers' GGUF loading (its own dequantization and
un-permutation) in fp32; the damaged files are the ones a user can meet."""

import json
import os
import shutil

import numpy as np
import pytest
import torch

from megatron.evaluation.cli import main as evaluate_main
from megatron.training.hf_llama import main as convert_main

VOCAB, HIDDEN, FFN, LAYERS, HEADS, GROUPS = 320, 64, 128, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS
TEXT = ("The quick brown fox jumps over the lazy dog. Wikipedia is a free online encyclopedia "
        "written by volunteers; it has 6,912,345 articles in English. ") * 20


def _bpe():
    """A byte-level BPE of VOCAB entries (GPT-2 style, as SmolLM2's) with <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=1)
    tk.train_from_iterator([TEXT], trainer)
    assert tk.get_vocab_size() == VOCAB
    return tk


def _hf_model(seed=3, tied=True):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=GROUPS, max_position_embeddings=2048,
        rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=tied,
        initializer_range=0.1)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def _permute(w, heads):
    """llama.cpp's convert_hf_to_gguf permutation of the q/k rows (rotate-half -> pairs)."""
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_gguf(path, model, tokenizer, arch="llama", ffn_length=FFN, extra=(),
               quant=True, pre="default"):
    """The model as llama.cpp's converter writes it: matrices Q4_1 (the embedding Q8_0), norms
    F32, q/k permuted; the tokenizer's vocabulary and merges in the metadata."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(2048)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(ffn_length)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(GROUPS)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_vocab_size(VOCAB)
    vocab = tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) for m in json.loads(tokenizer.to_str())["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t == "<|endoftext|>" else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(vocab["<|endoftext|>"])
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}

    def put(name, array, kind):
        if kind in (Q.Q4_1, Q.Q8_0) and quant:
            writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))

    put("token_embd.weight", sd["model.embed_tokens.weight"], Q.Q8_0)
    put("output_norm.weight", sd["model.norm.weight"], Q.F32)
    if not model.config.tie_word_embeddings:
        put("output.weight", sd["lm_head.weight"], Q.Q4_1)
    for i in range(LAYERS):
        for hf, gg in NAMES.items():
            w = sd[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                w = _permute(w, HEADS)
            elif gg == "attn_k":
                w = _permute(w, GROUPS)
            put(f"blk.{i}.{gg}.weight", w, Q.F32 if w.ndim == 1 else Q.Q4_1)
    for name, array in extra:
        put(name, array, Q.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.fixture(scope="module")
def tokenizer():
    return _bpe()


@pytest.fixture(scope="module")
def files(tmp_path_factory, tokenizer):
    """{name: .gguf path}: tied and untied quantized models, in one directory each."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for name, tied in (("tied", True), ("untied", False)):
        os.makedirs(root / name)
        out[name] = write_gguf(root / name / "model.gguf", _hf_model(tied=tied), tokenizer)
    return out


@pytest.fixture(scope="module")
def imported(files, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for name, tp in (("tied", 1), ("untied", 1), ("tied", 2)):
        target = str(root / f"{name}-tp{tp}")
        assert convert_main(["import", files[name], target,
                             "--tensor-model-parallel-size", str(tp)]) == 0
        out[name, tp] = target
    return out


def _transformers_logits(gguf_path, tokens):
    """transformers' own GGUF loading (dequantization, q/k un-permutation) and fp32 forward."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
        dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.float().numpy()


def _evaluate(ckpt, out, *extra, schemes=("bf16", "linear_mxfp8")):
    """tools/evaluate.py --load CKPT with no model or tokenizer flags (the acceptance command
    of the issue, small)."""
    argv = ["--load", ckpt, "--schemes", *schemes, "--mock-data", "--seq-length", "128",
            "--micro-batch-size", "2", "--eval-iters", "2", "--output-dir", str(out),
            "--dump-logits", str(out / "l.npz"), *extra]
    assert evaluate_main(argv) == 0
    return np.load(out / "l.npz"), json.load(open(out / "evaluation.json"))


@pytest.mark.parametrize("name", ["tied", "untied"])
def test_logits_equal_transformers_gguf_forward(files, imported, tmp_path, name, capsys):
    dump, doc = _evaluate(imported[name, 1], tmp_path)
    out = capsys.readouterr().out
    assert "--tokenizer-type HuggingFaceTokenizer --tokenizer-model" in out
    assert dump["logits"].shape == (2, 128, VOCAB)      # the checkpoint's vocabulary
    expected = _transformers_logits(files[name], dump["tokens"])
    scale = np.abs(expected).max()
    assert np.abs(dump["logits"] - expected).max() <= 1e-4 * scale
    # Without the q/k un-permutation the logits are another model's: the check can fail.
    from megatron.training import gguf_llama

    assert gguf_llama._unpermute(torch.arange(8.0).reshape(8, 1), 2).flatten().tolist() == \
        [0, 2, 1, 3, 4, 6, 5, 7]
    assert doc["precision"] == "fp32" and doc["schemes"]["linear_mxfp8"]["loss"] > 0


def test_quantized_values_are_the_readers(files, imported):
    """The checkpoint holds exactly the gguf package's dequantized values (Q4_1 and Q8_0)."""
    import gguf

    from megatron.training.gguf_llama import GGUFModel

    reader = gguf.GGUFReader(files["tied"])
    by_name = {t.name: t for t in reader.tensors}
    t = by_name["blk.1.ffn_down.weight"]
    assert t.tensor_type.name == "Q4_1"
    model = GGUFModel(files["tied"])
    ours = model.read("model.layers.1.mlp.down_proj.weight")
    assert torch.equal(ours, torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)))
    assert model.tensor_types["model.embed_tokens.weight"] == "Q8_0"


def test_checkpoint_records_tokenizer_and_architecture(files, imported, tokenizer):
    from megatron.training.model_args import recorded_model_args
    from megatron.training.tokenizer import HuggingFaceTokenizer

    ckpt = imported["tied", 1]
    recorded = recorded_model_args(ckpt)
    assert recorded["num_layers"] == LAYERS and recorded["rotary_base"] == 100000
    assert not recorded["untie_embeddings_and_output_weights"]
    assert recorded["tokenizer"] == {"tokenizer_type": "HuggingFaceTokenizer",
                                     "tokenizer_model": "tokenizer.json"}
    ours = HuggingFaceTokenizer(os.path.join(ckpt, "tokenizer.json"))
    assert ours.vocab_size == VOCAB and ours.eod == tokenizer.token_to_id("<|endoftext|>")
    text = "Encyclopedia articles: 12,345 foxes jumped."
    assert ours.tokenize(text) == tokenizer.encode(text).ids


def test_tp2_import_evaluated_in_one_process_keeps_its_padding(imported, tmp_path, capsys):
    """A TP=2 import (vocabulary padded to 512) evaluated at TP=1 (which pads to 384) uses the
    checkpoint's padding and says so; before, '--padded-vocab-size 512 (checkpoint) vs 384'."""
    dump, _ = _evaluate(imported["tied", 2], tmp_path, schemes=("bf16",))
    assert "padded to 512" in capsys.readouterr().out
    reference, _ = _evaluate(imported["tied", 1], tmp_path / "tp1", schemes=("bf16",))
    assert np.array_equal(dump["logits"], reference["logits"])


def test_load_hf_gguf_and_another_model_in_the_same_output_dir(files, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--schemes", "bf16", "--mock-data", "--seq-length", "32", "--micro-batch-size", "1",
            "--eval-iters", "1", "--output-dir", str(out)]
    assert evaluate_main(["--load-hf", files["tied"], *argv]) == 0
    assert "importing" in capsys.readouterr().out
    assert evaluate_main(["--load-hf", files["tied"], *argv]) == 0
    assert "reusing" in capsys.readouterr().out
    # Another model into the same --output-dir: refused, naming both (it evaluated A before).
    assert evaluate_main(["--load-hf", files["untied"], *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --output-dir") and "\n" not in err
    assert os.path.realpath(files["tied"]) in err and files["untied"] in err


def _one_error_line(capsys, code, *needles):
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("error: ") and "\n" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def test_not_llama_is_one_line(tmp_path, tokenizer, capsys):
    path = write_gguf(tmp_path / "m.gguf", _hf_model(), tokenizer, arch="gpt2")
    _one_error_line(capsys, convert_main(["import", path, str(tmp_path / "c")]),
                    "general.architecture 'gpt2'", "Llama models only")
    assert not os.path.exists(tmp_path / "c")


def test_llama_variants_are_one_line(tmp_path, tokenizer, capsys):
    bias = [("blk.0.attn_q.bias", np.zeros(HIDDEN, np.float32))]
    path = write_gguf(tmp_path / "b.gguf", _hf_model(), tokenizer, extra=bias)
    _one_error_line(capsys, convert_main(["import", path, str(tmp_path / "c")]),
                    "blk.0.attn_q.bias", "biases are not supported")
    freqs = [("rope_freqs.weight", np.ones(HEAD_DIM // 2, np.float32))]
    path = write_gguf(tmp_path / "r.gguf", _hf_model(), tokenizer, extra=freqs)
    _one_error_line(capsys, convert_main(["import", path, str(tmp_path / "c")]),
                    "rope_freqs.weight")


def test_truncated_and_lying_files_are_one_line(files, tmp_path, tokenizer, capsys):
    data = open(files["tied"], "rb").read()
    for cut in (len(data) - 1000, len(data) // 2, 200):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        _one_error_line(capsys, convert_main(["import", str(path), str(tmp_path / "c")]),
                        str(path))
    # Metadata that lies about a shape: the FFN length says 256, the tensors have 128 rows.
    path = write_gguf(tmp_path / "lie.gguf", _hf_model(), tokenizer, ffn_length=256)
    _one_error_line(capsys, convert_main(["import", path, str(tmp_path / "c")]),
                    "has shape [128, 64]", "implies [256, 64]")
    assert not os.path.exists(tmp_path / "c")


def test_a_fifo_is_refused_without_reading(tmp_path, capsys):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    _one_error_line(capsys, convert_main(["import", str(fifo), str(tmp_path / "c")]),
                    "is a FIFO, not a regular file")


def test_nonfinite_weights_are_refused(tmp_path, tokenizer, capsys):
    model = _hf_model()
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 5] = float("nan")
    path = write_gguf(tmp_path / "nan.gguf", model, tokenizer, quant=False)
    _one_error_line(capsys, convert_main(["import", path, str(tmp_path / "c")]),
                    "model.layers.1.mlp.up_proj.weight holds 1 NaN/Inf value(s)")
    assert not os.path.exists(tmp_path / "c")


def test_build_corpus_with_the_checkpoints_tokenizer(imported, tmp_path, capsys, tokenizer):
    """build_corpus.py --tokenizer-model CKPT tokenizes the dataset's documents with the
    checkpoint's tokenizer (cached) and prints the run's flags as its last line."""
    from megatron.training import build_corpus
    from megatron.training.corpora import embedded_data_prefix

    root = tmp_path / "data"
    base = root / "wikipedia"
    os.makedirs(base)
    docs = [{"text": TEXT[i * 40:(i + 3) * 40], "source": "wiki_leads", "title": str(i)}
            for i in range(30)]
    with open(base / "wikipedia.jsonl", "w") as f:
        f.writelines(json.dumps(d) + "\n" for d in docs)
    (base / "sources.json").write_text(json.dumps({"dataset": "wikipedia", "documents": 30,
                                                  "characters": len(TEXT)}))
    prefix = embedded_data_prefix("wikipedia", root)
    for ext in (".bin", ".idx"):
        open(prefix + ext, "wb").close()     # only its jsonl is read
    argv = ["--dataset", "wikipedia", "--tokenizer-model", imported["tied", 1],
            "--data-root", str(root)]
    assert build_corpus.main(argv) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    flags = last.split()
    assert flags[0] == "--data-path" and flags[2:4] == ["--tokenizer-type",
                                                        "HuggingFaceTokenizer"]
    assert flags[4] == "--tokenizer-model" and len(flags) == 6
    assert os.path.isfile(flags[1] + ".bin") and os.path.isfile(flags[5])
    expected = tokenizer.encode(docs[0]["text"]).ids + [tokenizer.token_to_id("<|endoftext|>")]
    tokens = np.fromfile(flags[1] + ".bin", dtype=np.uint16)      # vocabulary of 320: uint16
    assert tokens[:len(expected)].tolist() == expected
    # Cached: the second call builds nothing and prints the same flags.
    assert build_corpus.main(argv) == 0
    out = capsys.readouterr().out
    assert "already built" in out and out.strip().splitlines()[-1] == last
    # A directory without a tokenizer is one line.
    empty = tmp_path / "empty"
    os.makedirs(empty)
    code = build_corpus.main(["--dataset", "wikipedia", "--tokenizer-model", str(empty),
                              "--data-root", str(root)])
    _one_error_line(capsys, code, "no tokenizer.json there")


def test_directory_import_with_tokenizer_json(tmp_path, tokenizer, capsys):
    """An HF directory with a tokenizer.json of the model's size: the checkpoint records it
    like a GGUF import does, so --load needs no tokenizer flags."""
    model = _hf_model(seed=4, tied=False)
    model.save_pretrained(str(tmp_path / "hf"))
    tokenizer.save(str(tmp_path / "hf" / "tokenizer.json"))
    assert convert_main(["import", str(tmp_path / "hf"), str(tmp_path / "c")]) == 0
    assert os.path.isfile(tmp_path / "c" / "tokenizer.json")
    shutil.rmtree(tmp_path / "hf")           # the checkpoint stands alone
    dump, _ = _evaluate(str(tmp_path / "c"), tmp_path, schemes=("bf16",))
    assert dump["logits"].shape[-1] == VOCAB
