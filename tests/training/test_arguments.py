"""Argument parsing and validation, in the style of Megatron-LM's argument tests."""

import re

import pytest

from megatron.training.arguments import (
    ConfigError,
    build_parser,
    parse_args,
    parse_data_path,
    validate_args,
)

MINIMAL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
           "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "5", "--lr", "1e-3",
           "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]


def validated(argv, world_size=1, **overrides):
    args = parse_args(argv)
    args.world_size = world_size
    for key, value in overrides.items():
        setattr(args, key, value)
    return validate_args(args, check_paths=False)


class TestDefaults:
    def test_megatron_defaults(self):
        args = parse_args(MINIMAL)
        assert args.tensor_model_parallel_size == 1
        assert args.pipeline_model_parallel_size == 1
        assert args.num_query_groups == 1
        assert args.position_embedding_type == "learned_absolute"
        assert args.normalization == "LayerNorm"
        assert args.layernorm_epsilon == 1e-5
        assert args.add_bias_linear is True
        assert args.make_vocab_size_divisible_by == 128
        assert args.lr_decay_style == "linear"
        assert args.min_lr == 0.0
        assert args.weight_decay == 0.01
        assert args.clip_grad == 1.0
        assert (args.adam_beta1, args.adam_beta2, args.adam_eps) == (0.9, 0.999, 1e-8)
        assert args.init_method_std == 0.02
        assert args.seed == 1234
        assert args.rotary_base == 10000
        assert args.rope_scaling_factor == 8.0
        assert args.log_interval == 100
        assert (args.eval_interval, args.eval_iters) == (1000, 100)
        assert args.attention_dropout == 0.1 and args.hidden_dropout == 0.1
        assert args.kv_lora_rank == 32 and args.q_lora_rank is None

    def test_derived_values(self):
        args = validated(MINIMAL + ["--swiglu"])
        assert args.kv_channels == 16
        assert args.ffn_hidden_size == 128  # int(4*64*2/3 / 64) * 64
        assert args.max_position_embeddings == 32
        assert args.global_batch_size == 2 and args.num_micro_batches == 1
        assert args.lr_decay_iters == 5
        assert args.num_query_groups == 4  # no GQA: one group per head

    def test_ffn_default_without_swiglu(self):
        assert validated(MINIMAL).ffn_hidden_size == 256

    @pytest.mark.parametrize("split, problem", [
        ("nan,1,1", "is not a split"),       # megatron-core read it as 1,1,0
        ("abc", "is not a split"),           # ... as nan,nan,nan: a traceback
        ("1,1,1,1", "is not a split"),       # ... an AssertionError
        ("1e3,1,1", "is not a split"),
        ("0,1,0", "leaves no training data"),    # a TypeError in the loop
    ])
    def test_split_must_be_one_to_three_weights(self, split, problem):
        argv = [a for a in MINIMAL if a != "--mock-data"] + ["--data-path", "x"]
        with pytest.raises(ConfigError, match=rf"--split '{re.escape(split)}' {problem}; "
                                              "valid: one to three non-negative numbers"):
            validated(argv + ["--split", split])
        assert validated(argv + ["--split", "98, 2/0"]).split == "98, 2/0"

    def test_split_default_with_data_path(self):
        args = validated([a for a in MINIMAL if a != "--mock-data"] + ["--data-path", "x"])
        assert args.split == "969, 30, 1"
        assert args.data_prefixes == ["x"] and args.data_weights is None

    def test_every_flag_has_help(self):
        parser = build_parser()
        missing = [a.option_strings for a in parser._actions
                   if a.option_strings and a.dest != "help" and not a.help]
        assert missing == []
        # --help renders (a bare % in a help text breaks argparse's formatting).
        text = parser.format_help()
        assert "--quant-recipe" in text and "~15% of the layers" in text
        # ... and shows the defaults (Megatron's eval-iters 100 is the one that surprises).
        flat = " ".join(text.split())
        assert "(default: 100)" in flat and "(default: 1234)" in flat


class TestExplicitLists:
    def test_parallel_and_training_flags(self):
        args = parse_args(MINIMAL + [
            "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--sequence-parallel", "--use-distributed-optimizer", "--global-batch-size", "8",
            "--bf16", "--lr-decay-style", "cosine", "--lr-warmup-iters", "3", "--min-lr", "1e-5",
            "--clip-grad", "0.5", "--adam-beta2", "0.95", "--weight-decay", "0.1",
            "--exit-interval", "7", "--exit-duration-in-mins", "1.5", "--save", "/tmp/s",
            "--save-interval", "4", "--load", "/tmp/l", "--tensorboard-dir", "/tmp/tb",
            "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--swiglu",
            "--normalization", "RMSNorm", "--position-embedding-type", "rope",
            "--use-rope-scaling", "--rope-scaling-factor", "32", "--rotary-base", "500000",
            "--group-query-attention", "--num-query-groups", "2"])
        assert args.tensor_model_parallel_size == 2 and args.pipeline_model_parallel_size == 2
        assert args.sequence_parallel and args.use_distributed_optimizer and args.bf16
        assert args.global_batch_size == 8 and args.lr_decay_style == "cosine"
        assert args.lr_warmup_iters == 3 and args.min_lr == 1e-5 and args.clip_grad == 0.5
        assert args.adam_beta2 == 0.95 and args.weight_decay == 0.1
        assert args.exit_interval == 7 and args.exit_duration_in_mins == 1.5
        assert (args.save, args.save_interval, args.load) == ("/tmp/s", 4, "/tmp/l")
        assert args.tensorboard_dir == "/tmp/tb"
        assert args.untie_embeddings_and_output_weights and args.add_bias_linear is False
        assert args.swiglu and args.normalization == "RMSNorm"
        assert args.use_rope_scaling and args.rope_scaling_factor == 32.0
        assert args.rotary_base == 500000 and args.num_query_groups == 2

    def test_moe_and_mla_flags(self):
        args = parse_args(MINIMAL + [
            "--multi-latent-attention", "--kv-lora-rank", "512", "--qk-head-dim", "128",
            "--qk-pos-emb-head-dim", "64", "--v-head-dim", "128", "--num-experts", "64",
            "--moe-router-topk", "6", "--moe-ffn-hidden-size", "1408",
            "--moe-shared-expert-intermediate-size", "2816", "--moe-layer-freq", "([0]+[1]*26)",
            "--moe-router-pre-softmax", "--moe-aux-loss-coeff", "1e-3",
            "--moe-router-load-balancing-type", "seq_aux_loss", "--expert-model-parallel-size", "8"])
        assert args.multi_latent_attention and args.kv_lora_rank == 512
        assert args.num_experts == 64 and args.moe_router_topk == 6
        assert args.moe_layer_freq == [0] + [1] * 26
        assert args.moe_router_pre_softmax and args.moe_aux_loss_coeff == 1e-3
        assert args.expert_model_parallel_size == 8

    def test_moe_layer_freq_int(self):
        assert parse_args(MINIMAL + ["--moe-layer-freq", "2"]).moe_layer_freq == 2

    @pytest.mark.parametrize("value", ["[0,2]", "__import__('os')", "[0]+"])
    def test_moe_layer_freq_rejects(self, value):
        with pytest.raises(SystemExit):
            parse_args(MINIMAL + ["--moe-layer-freq", value])

    def test_data_path_blend(self):
        assert parse_data_path(["0.7", "a", "0.3", "b"]) == (["a", "b"], [0.7, 0.3])
        with pytest.raises(ConfigError, match="weight/path pairs"):
            parse_data_path(["0.7", "a", "b"])
        with pytest.raises(ConfigError, match="not a number"):
            parse_data_path(["a", "b"])
        for weight in ("inf", "nan", "0", "-1"):      # inf made every blend weight nan
            with pytest.raises(ConfigError, match=f"blend weight {weight} for a must be a "
                                                  "finite number > 0"):
                parse_data_path([weight, "a", "1", "b"])


class TestPresets:
    def test_preset_fills_defaults(self):
        args = parse_args(["--model-preset", "llama32-1b"])
        assert (args.num_layers, args.hidden_size, args.ffn_hidden_size) == (16, 2048, 8192)
        assert args.rope_scaling_factor == 32.0 and args.rotary_base == 500000
        assert args.untie_embeddings_and_output_weights is False

    def test_explicit_flags_win(self):
        args = parse_args(["--model-preset", "llama31-8b", "--num-layers", "2",
                           "--rope-scaling-factor", "4"])
        assert args.num_layers == 2 and args.rope_scaling_factor == 4.0
        assert args.hidden_size == 4096 and args.rotary_base == 500000

    def test_unknown_preset(self, capsys):
        with pytest.raises(SystemExit):
            parse_args(["--model-preset", "llama-huge"])
        assert "invalid choice: 'llama-huge'" in capsys.readouterr().err


class TestValidation:
    @pytest.mark.parametrize("extra, world_size, pattern", [
        (["--tensor-model-parallel-size", "3"], 3, "--num-attention-heads 4 is not divisible by "
                                                   "--tensor-model-parallel-size 3"),
        (["--tensor-model-parallel-size", "2"], 3, "world size 3 is not divisible by"),
        (["--pipeline-model-parallel-size", "4"], 4, "--num-layers 2 is not divisible by "
                                                     "--pipeline-model-parallel-size 4"),
        (["--global-batch-size", "3"], 1, "--global-batch-size 3 is not divisible by "
                                          "--micro-batch-size 2"),
        (["--global-batch-size", "6"], 2, "data-parallel size 2"),
        (["--fp16", "--bf16"], 1, "mutually exclusive"),
        (["--min-lr", "1"], 1, "--min-lr 1.0 exceeds --lr"),
        (["--group-query-attention", "--num-query-groups", "3"], 1,
         "--num-attention-heads 4 is not divisible by --num-query-groups 3"),
        (["--num-experts", "4", "--moe-layer-freq", "[0,1,1]"], 1, "lists 3 layers"),
        (["--num-experts", "3", "--expert-model-parallel-size", "2"], 2,
         "--num-experts 3 is not divisible by --expert-model-parallel-size 2"),
        (["--num-experts", "4", "--tensor-model-parallel-size", "2"], 2,
         "needs --sequence-parallel"),
        (["--save-interval", "5"], 1, "--save-interval needs --save"),
        (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"], 1, "mutually exclusive"),
        (["--lr-warmup-iters", "5"], 1, "--lr-warmup-iters 5 must be smaller than "
                                        "--lr-decay-iters 5"),
        (["--lr-decay-style", "WSD"], 1, "needs --lr-wsd-decay-iters"),
    ])
    def test_rejects(self, extra, world_size, pattern):
        with pytest.raises(ConfigError, match=pattern.replace("(", r"\(")):
            validated(MINIMAL + extra, world_size=world_size)

    def test_requires_lr_and_iters(self):
        without_lr = [a for a in MINIMAL if a not in ("--lr", "1e-3")]
        with pytest.raises(ConfigError, match="--lr is required"):
            validated(without_lr)
        without_iters = [a for a in MINIMAL if a not in ("--train-iters", "5")]
        with pytest.raises(ConfigError, match="--train-iters is required"):
            validated(without_iters)

    def test_requires_data(self):
        with pytest.raises(ConfigError, match="--data-path PREFIX"):
            validated([a for a in MINIMAL if a != "--mock-data"])

    def test_null_tokenizer_needs_vocab_size(self):
        argv = [a for a in MINIMAL if a not in ("--vocab-size", "100")]
        with pytest.raises(ConfigError, match="NullTokenizer needs --vocab-size"):
            validated(argv)

    def test_missing_data_files_named(self, tmp_path):
        argv = [a for a in MINIMAL if a != "--mock-data"] + ["--data-path", str(tmp_path / "wiki")]
        args = parse_args(argv)
        with pytest.raises(ConfigError, match=r"wiki\.bin, .*wiki\.idx not found"):
            validate_args(args)

    def test_unwritable_save_dir(self, tmp_path):
        blocker = tmp_path / "file"
        blocker.write_text("x")
        args = parse_args(MINIMAL + ["--save", str(blocker / "ckpt")])
        with pytest.raises(ConfigError, match="--save .* not writable"):
            validate_args(args)

    def test_missing_load_dir(self, tmp_path):
        args = parse_args(MINIMAL + ["--load", str(tmp_path / "nope")])
        with pytest.raises(ConfigError, match="--load .*directory not found"):
            validate_args(args)

    def test_sequence_parallel_dropped_without_tp(self):
        assert validated(MINIMAL + ["--sequence-parallel"]).sequence_parallel is False

    def test_data_parallel_size_and_micro_batches(self):
        args = validated(MINIMAL + ["--tensor-model-parallel-size", "2",
                                    "--global-batch-size", "16"], world_size=8)
        assert args.data_parallel_size == 4 and args.num_micro_batches == 2

    def test_bad_choice_exits(self):
        with pytest.raises(SystemExit):
            parse_args(MINIMAL + ["--normalization", "BatchNorm"])

    def test_no_abbreviations(self):
        with pytest.raises(SystemExit):
            parse_args(MINIMAL + ["--tensor-model", "2"])
