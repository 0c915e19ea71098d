"""HuggingFace Llama 3.x import and export (tools/convert_hf.py): small random transformers
models, compared with transformers' own forward in fp32."""

import contextlib
import json
import os
import shutil
import socket
import sys

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

import pretrain_gpt
from megatron.training import checkpointing
from megatron.training.arguments import ConfigError, parse_args, validate_args
from megatron.training.hf_llama import export_checkpoint, import_checkpoint, main
from megatron.training.training import pretrain

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
VOCAB = 200                 # padded to 256 (128 x TP for TP 1 and 2)
SEQ = 320                   # long enough for the Llama 3 scaling to change the logits
# NullTokenizer with --vocab-size V has V + 1 entries (the last one is its end of document).
TOKENIZER = ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1)]


def _hf_config(tied, rope_scaling=LLAMA3_ROPE):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
        rope_theta=500000.0, rope_scaling=dict(rope_scaling) if rope_scaling else None,
        rms_norm_eps=1e-5, tie_word_embeddings=tied, initializer_range=0.1)


def _hf_model(config, seed):
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():       # norms away from 1, so that a misplaced norm weight shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits.float()


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """{name: (directory, model)}: untied and tied fp32 models and an untied bf16 one."""
    root = tmp_path_factory.mktemp("hf")
    models = {"untied": _hf_model(_hf_config(tied=False), 1),
              "tied": _hf_model(_hf_config(tied=True), 2)}
    models["bf16"] = _hf_model(_hf_config(tied=False), 3).to(torch.bfloat16)
    found = {}
    for name, model in models.items():
        # The tied one in shards with model.safetensors.index.json.
        shard = "40KB" if name == "tied" else "50GB"
        model.save_pretrained(str(root / name), max_shard_size=shard)
        found[name] = (str(root / name), model)
    assert os.path.isfile(root / "tied" / "model.safetensors.index.json")
    return found


@pytest.fixture(scope="module")
def imported(hf, tmp_path_factory):
    """{(name, TP): checkpoint directory}."""
    root = tmp_path_factory.mktemp("ckpt")
    found = {}
    for name, tp in (("untied", 1), ("tied", 1), ("bf16", 1), ("untied", 2), ("tied", 2)):
        target = str(root / f"{name}-tp{tp}")
        import_checkpoint(hf[name][0], target, tensor_model_parallel_size=tp)
        found[name, tp] = target
    return found


@pytest.fixture(scope="module")
def tokens():
    torch.manual_seed(7)
    return torch.randint(0, VOCAB, (2, SEQ))


@contextlib.contextmanager
def _loaded(ckpt, seq_length, tp=1, pp=1):
    """(args, model) of the checkpoint loaded as pretrain_gpt.py --load loads it (no model
    flags), on this process's rank of a TP=tp, PP=pp group."""
    from megatron.core import parallel_state
    from megatron.training.initialize import destroy_distributed, initialize_distributed
    from megatron.training.model import build_gpt_model, core_transformer_config_from_args
    from megatron.training.tokenizer import build_tokenizer, vocab_size_with_padding

    args = validate_args(parse_args(
        ["--load", ckpt, "--mock-data", *TOKENIZER, "--seq-length", str(seq_length),
         "--micro-batch-size", "1", "--train-iters", "1", "--lr", "0",
         "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]),
        check_paths=False)
    initialize_distributed(args)
    try:
        args.tokenizer_vocab_size = build_tokenizer(args).vocab_size
        args.padded_vocab_size = vocab_size_with_padding(args.tokenizer_vocab_size, 128, tp)
        model = build_gpt_model(args, core_transformer_config_from_args(args), args.quant_config,
                                pre_process=parallel_state.is_pipeline_first_stage(),
                                post_process=parallel_state.is_pipeline_last_stage())
        found = checkpointing.checkpoint_to_load(ckpt, log=lambda _: None)
        checkpointing.load_checkpoint(ckpt, found, model, None, None, args, log=lambda _: None)
        yield args, model.eval()
    finally:
        destroy_distributed()


def _logits(model, tokens):
    """Logits [b, s, VOCAB] of a loaded model (gathered over its tensor-parallel group)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        logits = gather_from_tensor_model_parallel_region(model(tokens, positions, None))
    return logits[..., :VOCAB].float()


def _megatron_logits(ckpt, tokens):
    with _loaded(ckpt, tokens.shape[1]) as (_, model):
        return _logits(model, tokens)


def _assert_close(ours, reference):
    tolerance = 1e-4 * reference.abs().max().item()
    assert (ours - reference).abs().max().item() <= tolerance
    return tolerance


@pytest.mark.parametrize("name", ["untied", "tied"])
def test_tp1_logits_match_transformers(hf, imported, tokens, name):
    reference = _hf_logits(hf[name][1], tokens)
    ours = _megatron_logits(imported[name, 1], tokens)
    tolerance = _assert_close(ours, reference)
    # Without the Llama 3 scaling the same weights give other logits: the check can fail.
    import transformers

    unscaled = transformers.LlamaForCausalLM(_hf_config(tied=name == "tied", rope_scaling=None))
    unscaled.load_state_dict(hf[name][1].state_dict())
    assert (ours - _hf_logits(unscaled.eval(), tokens)).abs().max().item() > 100 * tolerance


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# (import, TP, PP, compute logits, save again) for _two_rank_worker.
TWO_RANK_JOBS = [("untied", 2, 1, True, True), ("tied", 2, 1, True, False),
                 ("tied", 1, 2, False, True)]


def _two_rank_worker(rank, ports, imported, tokens, out_dir):
    """TP=2 logits of the TP=2 imports; the untied one saved again at TP=2 and the tied one
    at PP=2 (checkpoints written by two ranks, for the export)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    torch.set_num_threads(1)
    for port, (name, tp, pp, logits, save) in zip(ports, TWO_RANK_JOBS):
        os.environ["MASTER_PORT"] = str(port)
        with _loaded(imported[name], tokens.shape[1], tp, pp) as (args, model):
            if logits:
                found = _logits(model, tokens)
                if rank == 0:
                    torch.save(found, os.path.join(out_dir, f"{name}.pt"))
            if save:
                checkpointing.save_checkpoint(os.path.join(out_dir, f"{name}-tp{tp}-pp{pp}"), 5,
                                              model, None, None, args, 0, log=lambda _: None)


@pytest.fixture(scope="module")
def two_ranks(imported, tokens, tmp_path_factory):
    """The directory where _two_rank_worker left its logits and checkpoints."""
    out = tmp_path_factory.mktemp("two-ranks")
    checkpoints = {"untied": imported["untied", 2], "tied": imported["tied", 2]}
    ports = [_free_port() for _ in TWO_RANK_JOBS]
    mp.spawn(_two_rank_worker, args=(ports, checkpoints, tokens, str(out)), nprocs=2)
    return out


@pytest.mark.parametrize("name", ["untied", "tied"])
def test_tp2_logits_match_transformers(hf, tokens, two_ranks, name):
    _assert_close(torch.load(two_ranks / f"{name}.pt"), _hf_logits(hf[name][1], tokens))


def _hf_files(directory):
    """Every tensor of a HF directory's safetensors files (sharded or not)."""
    tensors = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(directory, name)))
    return tensors


def _assert_same_tensors(exported_dir, original_dir):
    original = _hf_files(original_dir)
    exported = load_file(os.path.join(exported_dir, "model.safetensors"))
    assert sorted(exported) == sorted(original)
    for key, tensor in original.items():
        assert exported[key].dtype == tensor.dtype, key
        assert torch.equal(exported[key], tensor), key


@pytest.mark.parametrize("name", ["untied", "tied", "bf16"])
def test_export_gives_back_the_imported_tensors(hf, imported, tmp_path, name):
    out = str(tmp_path / "out")
    export_checkpoint(imported[name, 1], out)
    _assert_same_tensors(out, hf[name][0])
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(out)
    assert model.config.tie_word_embeddings == (name == "tied")
    assert model.config.rope_parameters["rope_type"] == "llama3"
    assert model.config.rope_parameters["factor"] == 8.0


@pytest.mark.parametrize("saved", ["untied-tp2-pp1", "tied-tp1-pp2"])
def test_export_of_checkpoints_saved_by_two_ranks(hf, two_ranks, tmp_path, saved):
    out = str(tmp_path / "out")
    export_checkpoint(str(two_ranks / saved), out)
    _assert_same_tensors(out, hf[saved.split("-")[0]][0])


def test_export_casts_with_dtype(imported, hf, tmp_path):
    out = str(tmp_path / "out")
    export_checkpoint(imported["tied", 2], out, dtype=torch.bfloat16)
    exported = load_file(os.path.join(out, "model.safetensors"))
    original = _hf_files(hf["tied"][0])
    assert all(torch.equal(exported[k], original[k].to(torch.bfloat16)) for k in original)
    assert json.load(open(os.path.join(out, "config.json")))["torch_dtype"] == "bfloat16"


def _recording_forward_step(batches):
    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        batches.append({k: v.clone() for k, v in batch.items() if torch.is_tensor(v)})
        return pretrain_gpt.forward_step(iter([batch]), model)
    return forward_step


def test_pretrain_loads_an_import_without_model_flags(hf, imported, tmp_path, capsys):
    save = str(tmp_path / "trained")
    batches = []
    result = pretrain(_recording_forward_step(batches), [
        "--load", imported["untied", 1], "--save", save, "--mock-data", *TOKENIZER,
        "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "2",
        "--train-iters", "2", "--lr", "1e-3", "--log-interval", "1", "--eval-interval", "1000",
        "--eval-iters", "1", "--num-workers", "0"])
    out = capsys.readouterr().out
    assert "model flags from its checkpoint: --num-layers 2 --hidden-size 64" in out
    assert "--use-rope-scaling" in out and "--rotary-base 500000" in out
    assert "holds the model weights only" in out
    assert sorted(result.losses) == [1, 2]
    # The first loss is that of the imported weights: the HF model's cross entropy on the same
    # batch, over megatron's padded vocabulary (its padding rows are zeros: logits 0).
    batch = batches[0]
    logits = _hf_logits(hf["untied"][1], batch["tokens"])
    logits = torch.cat([logits, logits.new_zeros(*logits.shape[:2], 256 - VOCAB)], dim=-1)
    losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                                               reduction="none")
    mask = batch["loss_mask"].flatten().float()
    expected = (losses * mask).sum().item() / mask.sum().item()
    assert result.losses[1] == pytest.approx(expected, rel=1e-5)

    # The trained checkpoint (with optimizer state) exports too, with its new weights and the
    # imported config's other fields.
    exported = str(tmp_path / "exported")
    export_checkpoint(save, exported)
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(exported)
    trained = load_file(os.path.join(exported, "model.safetensors"))
    original = _hf_files(hf["untied"][0])
    assert sorted(trained) == sorted(original)
    assert not torch.equal(trained["lm_head.weight"], original["lm_head.weight"])
    assert model.config.bos_token_id == hf["untied"][1].config.bos_token_id


def test_model_flags_given_still_win_and_contradictions_stop_the_load(imported, capsys):
    ckpt = imported["untied", 1]
    common = ["--load", ckpt, "--mock-data", "--seq-length", "32", "--micro-batch-size", "1",
              "--train-iters", "1", "--lr", "1e-3", "--num-workers", "0"]
    args = parse_args(common + TOKENIZER + ["--num-layers", "3", "--rotary-base", "10000"])
    assert (args.num_layers, args.hidden_size, args.num_query_groups) == (3, 64, 2)
    assert "--rotary-base 10000 (checkpoint: --rotary-base 500000)" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"--num-layers 2 \(checkpoint\) vs 3"):
        pretrain(pretrain_gpt.forward_step, common + TOKENIZER + ["--num-layers", "3"])
    with pytest.raises(ConfigError, match="tokenizer of 200 entries"):
        pretrain(pretrain_gpt.forward_step,
                 common + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "299"])


def _write_config(directory, config):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return str(directory)


DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "hidden_size": 2048, "num_hidden_layers": 27, "num_attention_heads": 16,
    "kv_lora_rank": 512, "q_lora_rank": None, "n_routed_experts": 64, "vocab_size": 102400,
}


@pytest.mark.parametrize("change, named", [
    ({"attention_bias": True}, "attention_bias True"),
    ({"mlp_bias": True}, "mlp_bias True"),
    ({"rope_scaling": dict(LLAMA3_ROPE, low_freq_factor=2.0)},
     "rope_scaling.low_freq_factor 2.0"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type 'yarn'"),
], ids=["attention-bias", "mlp-bias", "rope-low-freq", "rope-yarn"])
def test_unsupported_configs_are_one_error_line(hf, tmp_path, capsys, change, named):
    config = json.load(open(os.path.join(hf["untied"][0], "config.json")))
    config.pop("rope_parameters", None)
    config.update(rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE))
    config.update(change)
    source = _write_config(tmp_path / "hf", config)
    code = main(["import", source, str(tmp_path / "ckpt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: config.json: ")
    assert named in err[0] and "this converter supports Llama 3.x" in err[0]
    assert not os.path.exists(tmp_path / "ckpt")


def test_deepseek_v2_lite_config_is_refused(tmp_path, capsys):
    code = main(["import", _write_config(tmp_path / "ds", DEEPSEEK_V2_LITE),
                 str(tmp_path / "ckpt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "model_type 'deepseek_v2'" in err[0]


def test_layout_and_weights_errors_are_one_line(hf, tmp_path, capsys):
    code = main(["import", hf["untied"][0], str(tmp_path / "a"),
                 "--tensor-model-parallel-size", "3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["error: --num-attention-heads 4 is not divisible by "
                                 "--tensor-model-parallel-size 3"]
    # A weight file that lacks a tensor config.json implies.
    from safetensors.torch import save_file

    broken = tmp_path / "broken"
    shutil.copytree(hf["untied"][0], broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    code = main(["import", str(broken), str(tmp_path / "b")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "model.layers.1.mlp.up_proj.weight is missing" in err[0]


def test_existing_targets_and_a_missing_safetensors_are_one_line(hf, imported, tmp_path,
                                                                   capsys, monkeypatch):
    code = main(["import", hf["untied"][0], imported["untied", 1]])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "already holds a checkpoint" in err[0]
    code = main(["export", imported["untied", 1], hf["untied"][0]])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "already holds a model (config.json)" in err[0]
    monkeypatch.setitem(sys.modules, "safetensors", None)
    code = main(["import", hf["untied"][0], str(tmp_path / "c")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["error: the safetensors package is not installed: pip install "
                                 "safetensors==0.8.0 (listed in requirements-cpu.txt)"]


# meta-llama/Llama-3.2-1B's config.json (transformers 4 spelling).
LLAMA32_1B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 128256,
}


def test_llama32_1b_config_maps_to_its_preset_and_back():
    from megatron.training.hf_llama_mapping import (
        LlamaLayout, hf_config_from_model_args, model_args_from_hf)
    from megatron.training.presets import MODEL_PRESETS, PUBLISHED_PARAMETER_COUNTS

    model_args, vocab = model_args_from_hf(LLAMA32_1B_CONFIG)
    preset = MODEL_PRESETS["llama32-1b"]
    assert vocab == 128256
    assert {k: v for k, v in model_args.items() if k in preset and preset[k] != v} == {}
    layout = LlamaLayout.from_model_args(model_args, vocab, vocab)
    assert sum(torch.Size(s).numel() for s in layout.hf_shapes().values()) == \
        PUBLISHED_PARAMETER_COUNTS["llama32-1b"]
    config = hf_config_from_model_args(model_args, vocab, torch.bfloat16, LLAMA32_1B_CONFIG)
    assert config == LLAMA32_1B_CONFIG


@pytest.mark.parametrize("change, flag", [
    ({"normalization": "LayerNorm"}, "--normalization 'LayerNorm'"),
    ({"num_experts": 8}, "--num-experts 8"),
    ({"multi_latent_attention": True}, "--multi-latent-attention True"),
    ({"add_bias_linear": True}, "--disable-bias-linear True"),
])
def test_export_refuses_models_llama_cannot_describe(change, flag):
    from megatron.training.hf_llama_mapping import hf_config_from_model_args, model_args_from_hf

    model_args, vocab = model_args_from_hf(LLAMA32_1B_CONFIG)
    with pytest.raises(ConfigError, match=f"the checkpoint's model has {flag} "):
        hf_config_from_model_args(dict(model_args, **change), vocab, torch.bfloat16)


@pytest.mark.parametrize("change, named", [
    ({"rms_norm_eps": -1.0}, "rms_norm_eps -1.0: must be a finite number in (0, 1)"),
    ({"rms_norm_eps": 0}, "rms_norm_eps 0: must be a finite number in (0, 1)"),
    ({"rope_theta": -5.0}, "rope_theta -5.0: must be a finite number > 0"),
    ({"num_hidden_layers": 0}, "num_hidden_layers 0: must be a positive integer"),
], ids=["eps-negative", "eps-zero", "theta-negative", "no-layers"])
def test_nonsense_config_values_are_one_error_line(hf, tmp_path, capsys, change, named):
    config = json.load(open(os.path.join(hf["untied"][0], "config.json")))
    config.pop("rope_parameters", None)
    config.update(rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE))
    config.update(change)
    source = _write_config(tmp_path / "hf", config)
    code = main(["import", source, str(tmp_path / "ckpt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and named in err[0], err
    assert not os.path.exists(tmp_path / "ckpt")


def _edited_copy(source, target, name, edit):
    """A copy of the HF directory `source` whose tensor `name` is edited in place."""
    from safetensors.torch import save_file

    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    edit(tensors[name])
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return str(target)


def test_nonfinite_weights_are_refused(hf, tmp_path, capsys):
    def poison(t):
        t[0, 0], t[1, 1] = float("nan"), float("inf")
    source = _edited_copy(hf["untied"][0], tmp_path / "nan", "model.layers.0.mlp.gate_proj.weight",
                          poison)
    code = main(["import", source, str(tmp_path / "ckpt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "model.layers.0.mlp.gate_proj.weight holds 2 NaN/Inf value(s)" in err[0]
    assert not os.path.exists(tmp_path / "ckpt")


def test_a_fifo_as_weights_is_refused_not_read(hf, tmp_path):
    """A FIFO named model.safetensors blocked the import forever; it is one line now."""
    import subprocess

    from conftest import REPO_ROOT, child_env

    source = tmp_path / "fifo"
    os.makedirs(source)
    shutil.copy(os.path.join(hf["untied"][0], "config.json"), source)
    os.mkfifo(source / "model.safetensors")
    proc = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "convert_hf.py"),
                           "import", str(source), str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=300, env=child_env())
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr
    assert "model.safetensors is a FIFO, not a regular file" in err[0]


def test_export_to_float16_refuses_overflow_and_says_what_flushes(hf, tmp_path, capsys):
    def big(t):
        t[0, 0] = 1e6
    source = _edited_copy(hf["untied"][0], tmp_path / "big", "model.layers.0.mlp.up_proj.weight",
                          big)
    assert main(["import", source, str(tmp_path / "big-ckpt")]) == 0
    capsys.readouterr()
    code = main(["export", str(tmp_path / "big-ckpt"), str(tmp_path / "big-out"),
                 "--dtype", "float16"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "--dtype float16: tensor model.layers.0.mlp.up_proj.weight holds 1 value(s) beyond " \
           "its range" in err[0] and "1e+06" in err[0]
    assert not os.path.exists(tmp_path / "big-out" / "model.safetensors")

    def tiny(t):
        t[0, 0] = 1e-9
    source = _edited_copy(hf["untied"][0], tmp_path / "tiny", "model.layers.0.mlp.up_proj.weight",
                          tiny)
    assert main(["import", source, str(tmp_path / "tiny-ckpt")]) == 0
    capsys.readouterr()
    assert main(["export", str(tmp_path / "tiny-ckpt"), str(tmp_path / "tiny-out"),
                 "--dtype", "float16"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "model.layers.0.mlp.up_proj.weight: 1 nonzero value(s)" in notes[0]
    assert "written as 0" in notes[0]
    exported = load_file(str(tmp_path / "tiny-out" / "model.safetensors"))
    assert exported["model.layers.0.mlp.up_proj.weight"][0, 0].item() == 0.0


def test_export_to_a_regular_file_is_one_line(imported, tmp_path, capsys):
    target = tmp_path / "a-file"
    target.write_text("keep me")
    code = main(["export", imported["untied", 1], str(target)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"error: {target} exists and is not a directory; export into "
                                 "a new or empty directory"]
    assert target.read_text() == "keep me"


def test_an_import_without_tokenizer_files_evaluates_on_mock_data(imported, tmp_path, capsys):
    """An HF directory without tokenizer files: the checkpoint records NullTokenizer of the
    model's vocabulary, so --mock-data needs no tokenizer flags (before: 'checkpoint has
    another model shape: --padded-vocab-size 256 (checkpoint) vs 128256 (this run)'), and a
    NullTokenizer --vocab-size that gives another size is one line naming the right value."""
    import numpy as np

    from megatron.evaluation.cli import main as evaluate_main

    common = ["--load", imported["tied", 1], "--schemes", "bf16", "--mock-data",
              "--seq-length", "32", "--micro-batch-size", "1", "--eval-iters", "1"]
    out = tmp_path / "out"
    assert evaluate_main(common + ["--output-dir", str(out),
                                   "--dump-logits", str(out / "l.npz")]) == 0
    assert "--tokenizer-type NullTokenizer --vocab-size 199" in capsys.readouterr().out
    assert np.load(out / "l.npz")["logits"].shape == (1, 32, VOCAB)
    code = evaluate_main(common + ["--output-dir", str(tmp_path / "o2"), "--tokenizer-type",
                                   "NullTokenizer", "--vocab-size", str(VOCAB)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "NullTokenizer adds its end of document" in err
    assert f"pass --vocab-size {VOCAB - 1}" in err
