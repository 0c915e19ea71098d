"""The pretraining loop: set-up, train steps, logging, evaluation, checkpoints and exits.

`pretrain(forward_step_func, argv)` follows Megatron-LM's pretrain(): parse and validate args,
initialise distributed state, build the model/optimizer/scheduler, resume from --load, build
the data iterators, train, save. It returns a `TrainResult` (and an exit code for the CLI).

Exit conditions, checked after every iteration: --train-iters, --exit-interval,
--exit-duration-in-mins (max over ranks), SIGTERM (any rank), and stop requests from
callbacks (e.g. tensor capture's --control-iter). Each saves first when --save is given,
then ends with exit code 0.
"""

from __future__ import annotations

import math
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Dict, Optional, Sequence

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module

from megatron.quantization import schedule
from megatron.quantization.describe import describe_config, describe_sites
from megatron.quantization.runtime import runtime_of
from megatron.tensor_capture.callback import TensorCaptureCallback
from megatron.training import checkpointing
from megatron.training.arguments import format_args, parse_args, validate_args
from megatron.training.budget import describe_budget
from megatron.training.capture_arguments import run_args
from megatron.training.data import build_data_iterator, build_datasets
from megatron.training.data_files import check_dataset_files, unscanned_sidecars
from megatron.training.errors import TrainingError
from megatron.training.precision import describe_precision
from megatron.training.quant_stats import QuantStatsCallback, stats_interval_warnings
from megatron.training.wandb_writer import (
    open_wandb, wandb_failure, wandb_problem, wandb_write_errors)
from megatron.training.initialize import (
    destroy_distributed,
    initialize_distributed,
    set_random_seeds,
)
from megatron.training.model import (
    build_gpt_model,
    check_recipe_file_matchers,
    core_transformer_config_from_args,
    count_parameters,
)
from megatron.training.tokenizer import build_tokenizer, vocab_size_with_padding


# ---------------------------------------------------------------------------------------------
# Logging helpers
# ---------------------------------------------------------------------------------------------


def _timestamp() -> str:
    return datetime.now().strftime("%Y-%m-%d %H:%M:%S")


def is_rank_0() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def is_last_rank() -> bool:
    return (not torch.distributed.is_initialized()
            or torch.distributed.get_rank() == torch.distributed.get_world_size() - 1)


def print_rank_0(message: str) -> None:
    if is_rank_0():
        print(message, flush=True)


def print_rank_last(message: str) -> None:
    if is_last_rank():
        print(message, flush=True)


# ---------------------------------------------------------------------------------------------
# Callbacks (tensor capture and other observers plug in here)
# ---------------------------------------------------------------------------------------------


class TrainingCallback:
    """Hooks into the loop. `on_iteration_end` may return a reason to stop the run cleanly.

    Tensor capture's TensorCaptureCallback implements these methods (it is configured by a
    CaptureConfig, so it does not derive from this class)."""

    def on_train_start(self, model_chunks, iteration: int) -> None: ...

    def on_iteration_start(self, iteration: int) -> None: ...

    def on_micro_batch_start(self, iteration: int, micro_batch: int) -> None: ...

    def on_iteration_end(self, iteration: int) -> Optional[str]:
        return None

    def on_train_end(self, exit_reason: str) -> None: ...


def capture_callback(args) -> Optional[TensorCaptureCallback]:
    """The tensor-capture callback when --save-tensors (or $TENSOR_SAVE_ENABLED) is on."""
    if args.capture_config is None:
        return None
    return TensorCaptureCallback(args.capture_config, run_info={
        "args": run_args(args), "quant_config": describe_config(
            args.quant_config, args.num_layers, args.params_dtype_name)})


@dataclass
class TrainResult:
    iteration: int = 0
    exit_reason: str = ""
    exit_code: int = 0
    losses: Dict[int, float] = field(default_factory=dict)
    grad_norms: Dict[int, float] = field(default_factory=dict)
    val_losses: Dict[int, float] = field(default_factory=dict)
    checkpoint: Optional[str] = None


# ---------------------------------------------------------------------------------------------
# Set-up
# ---------------------------------------------------------------------------------------------


def setup_model_and_optimizer(args):
    """(ddp_model, raw GPTModel, optimizer, scheduler, transformer config)."""
    config = core_transformer_config_from_args(args)
    model = build_gpt_model(
        args, config, args.quant_config,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage())
    check_recipe_file_matchers(model, args.quant_config)
    raw_model = model
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    if args.bf16 or args.fp16:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=not args.grad_reduce_in_bf16,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        check_for_nan_in_grad=True,
    )
    ddp_model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    ddp_model.broadcast_params()

    optimizer_config = OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr,
        weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad,
        bf16=args.bf16, fp16=args.fp16, params_dtype=config.params_dtype,
        loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(optimizer_config, [ddp_model])
    # Schedules count samples, as Megatron-LM's iteration-based training does.
    gbs = args.global_batch_size
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs,
        lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=max(1, args.train_iters) * gbs, wd_incr_style="constant",
        wsd_decay_steps=(args.lr_wsd_decay_iters * gbs if args.lr_wsd_decay_iters else None),
        lr_wsd_decay_style=args.lr_wsd_decay_style,
    )
    config.no_sync_func = ddp_model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return ddp_model, raw_model, optimizer, scheduler, config


def sync_params(ddp_model, args) -> None:
    """With --overlap-param-gather the updated parameters arrive during the next forward:
    gather them now (before evaluation or a checkpoint)."""
    if args.overlap_param_gather:
        ddp_model.disable_forward_pre_hook(param_sync=True)
        ddp_model.enable_forward_pre_hook()


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------------------------


def _reduce_losses(losses_reduced: Sequence[dict]) -> Optional[float]:
    """Per-token 'lm loss' over micro-batches and data-parallel ranks (last PP stage only)."""
    if not parallel_state.is_pipeline_last_stage():
        return None
    total = torch.zeros(2, dtype=torch.float64, device=_device())
    for entry in losses_reduced:
        total += entry["lm loss"].to(total)
    torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group())
    return (total[0] / total[1].clamp(min=1)).item()


def train_step(forward_step_func, data_iterator, ddp_model, optimizer, scheduler, args):
    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()
    losses_reduced = get_forward_backward_func()(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=[ddp_model],
        num_microbatches=args.num_micro_batches, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, forward_only=False)
    update_successful, grad_norm, _ = optimizer.step()
    if update_successful:
        scheduler.step(increment=args.global_batch_size)
    return _reduce_losses(losses_reduced), grad_norm, not update_successful


EVAL_PROGRESS_SECONDS = 10.0    # a validation that takes longer reports its progress


def evaluate(forward_step_func, data_iterator, ddp_model, args,
             progress_every: Optional[float] = None) -> Optional[float]:
    """Mean per-token validation loss over --eval-iters batches (None if no data). A long
    validation prints its progress every `progress_every` seconds (Megatron's default of 100
    batches can take minutes on a CPU)."""
    if data_iterator is None or args.eval_iters == 0:
        return None
    progress_every = EVAL_PROGRESS_SECONDS if progress_every is None else progress_every
    ddp_model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=_device())
    start = last = time.time()
    with torch.no_grad():
        for done in range(1, args.eval_iters + 1):
            losses = get_forward_backward_func()(
                forward_step_func=forward_step_func, data_iterator=data_iterator,
                model=[ddp_model], num_microbatches=args.num_micro_batches,
                seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                forward_only=True)
            if parallel_state.is_pipeline_last_stage():
                for entry in losses:
                    total += entry["lm loss"].to(total)
            now = time.time()
            if now - last >= progress_every and done < args.eval_iters:
                last = now
                eta = (now - start) / done * (args.eval_iters - done)
                print_rank_0(f"[{_timestamp()}] validation: {done}/{args.eval_iters} batches "
                             f"(--eval-iters) in {now - start:.0f} s, about {eta:.0f} s left")
    ddp_model.train()
    if not parallel_state.is_pipeline_last_stage():
        return None
    torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group())
    return (total[0] / total[1].clamp(min=1)).item()


# ---------------------------------------------------------------------------------------------
# Exit signals
# ---------------------------------------------------------------------------------------------


class _SignalHandler:
    """Remembers a SIGTERM/SIGINT so the loop can save and exit at the end of an iteration."""

    def __init__(self, signals=(signal.SIGTERM,)):
        self.received = False
        self._previous = {}
        for sig in signals:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass

    def _handle(self, signum, _frame):
        self.received = True
        print_rank_0(f"[{_timestamp()}] received signal {signal.Signals(signum).name}: "
                     "stopping after this iteration")

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _max_over_ranks(*values: float) -> list:
    """Element-wise max over all ranks: one all-reduce (one host sync) for several values."""
    tensor = torch.tensor(values, dtype=torch.float64, device=_device())
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return tensor.tolist()


# ---------------------------------------------------------------------------------------------
# Logging
# ---------------------------------------------------------------------------------------------


class _TrainingLogger:
    """The log line, TensorBoard and W&B. A writer that fails (a full disk, a lost
    connection) costs one warning and that writer's scalars from then on, never the run."""

    def __init__(self, args):
        self.args = args
        self.writer = None
        self.wandb = None
        self.iteration = None          # the last iteration scalars were written for
        if is_last_rank():
            if args.tensorboard_dir:
                from torch.utils.tensorboard import SummaryWriter

                try:
                    self.writer = SummaryWriter(log_dir=args.tensorboard_dir)
                except tensorboard_write_errors() as exc:
                    self._writer_failed("tensorboard", exc)
                else:
                    self._quiet_writer_thread()
            try:
                self.wandb = open_wandb(args)
            except wandb_write_errors() as exc:
                self._writer_failed("wandb", exc)
        self.interval_start = time.perf_counter()
        self.interval_iters = 0
        self.skipped = 0
        self.nan_iters = 0
        self.quant_summary = None

    def _quiet_writer_thread(self) -> None:
        """TensorBoard writes from a thread that re-raises its write error as it ends; the
        error reaches this logger at the next add_scalar/flush (one warning), so the thread's
        own traceback is not printed. Restored by close()."""
        previous = threading.excepthook

        def hook(hook_args):
            if not (type(hook_args.thread).__name__ == "_AsyncWriterThread"
                    and isinstance(hook_args.exc_value, tensorboard_write_errors())):
                previous(hook_args)

        threading.excepthook = hook
        self._thread_hook = (hook, previous)

    def _writer_failed(self, which: str, exc: BaseException) -> None:
        """One warning; that writer is closed as far as it still can be and not used again."""
        when = "at start-up" if self.iteration is None else f"at iteration {self.iteration}"
        if which == "tensorboard":
            writer, self.writer = self.writer, None
            print_rank_last(f"warning: writing TensorBoard scalars to {self.args.tensorboard_dir} "
                            f"failed {when} ({_write_error_reason(exc)}): training goes on "
                            "without them")
            if writer is not None:
                try:    # keeps what was queued before the failure, where the disk still takes it
                    writer.close()
                except tensorboard_write_errors():
                    pass
        else:
            run, self.wandb = self.wandb, None
            print_rank_last(f"warning: {wandb_failure(self.args, when, _write_error_reason(exc))}")
            if run is not None:
                try:
                    run.finish()
                except wandb_write_errors():
                    pass

    def scalars(self, values: Dict[str, float], iteration: int) -> None:
        """Write scalars to TensorBoard and W&B (whichever are open and working)."""
        self.iteration = iteration
        if self.writer is not None:
            try:
                for tag, value in values.items():
                    self.writer.add_scalar(tag, value, iteration)
            except tensorboard_write_errors() as exc:
                self._writer_failed("tensorboard", exc)
        if self.wandb is not None:
            try:
                self.wandb.log(dict(values), step=iteration)
            except wandb_write_errors() as exc:
                self._writer_failed("wandb", exc)

    def log_quant_stats(self, iteration: int, tags: Dict[str, float], summary: str) -> None:
        """--quant-stats-interval results: scalars now, the summary in the next log line."""
        self.scalars(tags, iteration)
        self.quant_summary = summary

    def log_iteration(self, iteration, loss, lr, grad_norm, skipped, consumed_samples):
        args = self.args
        self.interval_iters += 1
        self.skipped += int(skipped)
        if loss is not None and not math.isfinite(loss):
            self.nan_iters += 1
        if iteration % args.tensorboard_log_interval == 0:
            values = {"learning-rate": lr}
            if loss is not None:
                values["lm loss"] = loss
            if grad_norm is not None:
                values["grad-norm"] = grad_norm
            self.scalars(values, iteration)
        if iteration % args.log_interval != 0:
            return
        elapsed = time.perf_counter() - self.interval_start
        ms_per_iter = 1000.0 * elapsed / max(1, self.interval_iters)
        tokens_per_s = args.global_batch_size * args.seq_length / (ms_per_iter / 1000.0)
        parts = [
            f" [{_timestamp()}] iteration {iteration:8d}/{args.train_iters:8d}",
            f"consumed samples: {consumed_samples:12d}",
            f"elapsed time per iteration (ms): {ms_per_iter:.1f}",
            f"throughput (tokens/s): {tokens_per_s:.1f}",
            f"learning rate: {lr:.6E}",
            f"global batch size: {args.global_batch_size:5d}",
        ]
        if loss is not None:
            parts.append(f"lm loss: {loss:.6E}")
        if grad_norm is not None:
            parts.append(f"grad norm: {grad_norm:.3f}")
        parts.append(f"number of skipped iterations: {self.skipped:3d}")
        parts.append(f"number of nan iterations: {self.nan_iters:3d}")
        if self.quant_summary:
            parts.append(self.quant_summary)
            self.quant_summary = None
        self.scalars({"throughput-tokens-per-s": tokens_per_s, "iteration-time-ms": ms_per_iter},
                     iteration)
        # The loss lives on the last pipeline stage.
        print_rank_last(" | ".join(parts) + " |")
        self.interval_start = time.perf_counter()
        self.interval_iters = 0
        self.skipped = 0
        self.nan_iters = 0

    def log_validation(self, iteration, loss):
        if loss is None:
            return
        ppl = math.exp(min(20.0, loss))
        line = (f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} | "
                f"lm loss PPL: {ppl:.6E} |")
        print_rank_last("-" * len(line) + "\n" + line + "\n" + "-" * len(line))
        self.scalars({"lm loss validation": loss}, iteration)
        if self.writer is not None:
            try:
                self.writer.flush()
            except tensorboard_write_errors() as exc:
                self._writer_failed("tensorboard", exc)

    def close(self):
        if self.writer is not None:
            try:
                self.writer.flush()
                self.writer.close()
            except tensorboard_write_errors() as exc:
                self._writer_failed("tensorboard", exc)
            self.writer = None
        if self.wandb is not None:
            try:
                self.wandb.finish()
            except wandb_write_errors() as exc:
                self._writer_failed("wandb", exc)
            self.wandb = None
        hook, previous = getattr(self, "_thread_hook", None) or (None, None)
        if hook is not None and threading.excepthook is hook:
            threading.excepthook = previous
        self._thread_hook = None


def tensorboard_write_errors() -> tuple:
    """What a SummaryWriter raises when its event file cannot be written: OSError (local
    files), or TensorFlow's OpError where TensorFlow's file system layer is used."""
    errors = [OSError]
    try:
        from tensorboard.compat import tf as _tf
        errors.append(_tf.errors.OpError)
    except Exception:   # noqa: BLE001 - no TensorBoard error classes to add
        pass
    return tuple(errors)


def _write_error_reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


# ---------------------------------------------------------------------------------------------
# pretrain
# ---------------------------------------------------------------------------------------------


def pretrain(forward_step_func, argv: Optional[Sequence[str]] = None,
             extra_args_provider=None, callbacks: Sequence[TrainingCallback] = (),
             keep_distributed: bool = False) -> TrainResult:
    """Run a whole training job; see the module docstring. Raises ConfigError on bad input."""
    start_time = time.time()
    args = parse_args(argv, extra_args_provider)
    validate_args(args)
    return pretrain_with_args(forward_step_func, args, callbacks, keep_distributed, start_time)


def pretrain_with_args(forward_step_func, args, callbacks: Sequence[TrainingCallback] = (),
                       keep_distributed: bool = False,
                       start_time: Optional[float] = None) -> TrainResult:
    """`pretrain` for flags already parsed and validated (validate_args)."""
    start_time = time.time() if start_time is None else start_time
    result = TrainResult()
    if args.quant_check:
        print(f"{describe_config(args.quant_config, args.num_layers, args.params_dtype_name)}"
              f"\n(scheme from {args.quant_config.source})", flush=True)
        result.exit_reason = "quant-check"
        return result
    initialize_distributed(args)
    try:
        _pretrain(forward_step_func, args, list(callbacks), result, start_time)
    finally:
        checkpointing.release_save_lock()
        if not keep_distributed:
            destroy_distributed()
    return result


def _pretrain(forward_step_func, args, callbacks, result: TrainResult, start_time: float):
    set_random_seeds(args.seed)
    tokenizer = build_tokenizer(args)
    args.tokenizer_vocab_size = tokenizer.vocab_size     # recorded in checkpoints
    args.padded_vocab_size = vocab_size_with_padding(
        tokenizer.vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
    print_rank_0(format_args(args))
    if args.use_flash_attn:
        print_rank_0("note: --use-flash-attn: attention uses the fused kernel by itself "
                     "wherever nothing in attention is quantized")
    print_rank_0(f"{describe_config(args.quant_config, args.num_layers, args.params_dtype_name)}"
                 f"\n(scheme from {args.quant_config.source})")
    print_rank_0(describe_precision(args))
    if args.quant_schedule_switches:
        print_rank_0("precision schedule (--quant-schedule): " + schedule.describe(
            args.quant_schedule_switches, args.train_iters))
    for line in [wandb_problem(args), *args.capture_warnings, *stats_interval_warnings(args)]:
        if line:
            print_rank_0(line)
    print_rank_0(f"[{_timestamp()}] tokenizer {tokenizer.name}: vocab {tokenizer.vocab_size} "
                 f"(padded to {args.padded_vocab_size})")

    # Damaged data files or a damaged or unsafe checkpoint stop the run before anything is built.
    for line in check_dataset_files(args.data_prefixes, tokenizer):   # token ids vs vocabulary
        print_rank_0(line)
    for line in describe_budget(args):
        print_rank_0(line)
    if args.save:
        checkpointing.lock_save_dir(args.save)     # one run per --save directory, until exit
    to_load = checkpointing.checkpoint_to_load(
        args.load, args.load_fallback_to_previous, log=print_rank_0) if args.load else None
    if args.load:       # the settings it was saved with are this run's, or it says so
        checkpointing.check_run_settings(args.load, to_load, args, log=print_rank_0)
    try:
        ddp_model, raw_model, optimizer, scheduler, _ = setup_model_and_optimizer(args)
    except (RuntimeError, MemoryError) as exc:
        if not _caused_by_memory(exc):
            raise
        raise TrainingError(
            f"out of memory building the model ({_allocation(exc)}): "
            f"--num-layers {args.num_layers}, --hidden-size {args.hidden_size}, "
            f"--ffn-hidden-size {args.ffn_hidden_size}, vocabulary {args.padded_vocab_size} do "
            "not fit this machine; shrink them or split the model over more ranks "
            "(--tensor-model-parallel-size, --pipeline-model-parallel-size); "
            "tools/estimate_memory.py tells what fits") from None
    quant = args.quant_config
    if (quant.recipe or quant.rules is not None) \
            and parallel_state.get_tensor_model_parallel_rank() == 0 \
            and parallel_state.get_data_parallel_rank() == 0:
        # Per-site table of recipe runs, from the first rank of every pipeline stage.
        print(describe_sites(raw_model.quant_sites), flush=True)
    n_params = count_parameters(raw_model)
    print(f" > number of parameters on (tensor, pipeline) model parallel rank "
          f"({parallel_state.get_tensor_model_parallel_rank()}, "
          f"{parallel_state.get_pipeline_model_parallel_rank()}): {n_params}", flush=True)

    iteration, consumed_samples = 0, 0
    if args.load:
        iteration, consumed_samples = checkpointing.load_checkpoint(
            args.load, to_load, raw_model, optimizer, scheduler, args, log=print_rank_0)
    # The quantized weights cached for the micro-batches are dropped after every step of this
    # run's optimizer (and of no other); the runtime is closed when the run ends, however.
    runtime = runtime_of(raw_model)
    runtime.watch_optimizer(optimizer)
    run = _Run(iteration=iteration, consumed_samples=consumed_samples, loaded_at=iteration or None)
    try:
        _train(forward_step_func, args, callbacks, result, start_time, tokenizer, ddp_model,
               raw_model, optimizer, scheduler, runtime, run)
    finally:
        reason = run.exit_reason if run.completed else "exception"
        _end_callbacks(run.started, reason, failing=not run.completed)
        runtime.close()
    result.iteration = run.iteration
    result.exit_reason = run.exit_reason
    if run.exit_reason.startswith("error"):
        result.exit_code = 1
    print_rank_0(f"[{_timestamp()}] exiting at iteration {run.iteration}: {run.exit_reason} "
                 f"({(time.time() - start_time) / 60:.2f} min)")


@dataclass
class _Run:
    """Where a run stands: its counters, the callbacks started, how it ended."""

    iteration: int
    consumed_samples: int
    loaded_at: Optional[int]
    started: list = field(default_factory=list)
    exit_reason: str = "train-iters"
    completed: bool = False


def _end_callbacks(callbacks, exit_reason: str, failing: bool) -> None:
    """on_train_end(exit_reason) of every started callback, also when the run fails (then a
    callback's own error is one warning line and the run's exception goes on)."""
    for cb in callbacks:
        try:
            cb.on_train_end(exit_reason)
        except Exception as exc:  # noqa: BLE001 - the run's own exception must not be lost
            if not failing:
                raise
            print_rank_0(f"warning: {type(cb).__name__} could not finish after the run failed: "
                         f"{type(exc).__name__}: {exc}")


def _train(forward_step_func, args, callbacks, result, start_time, tokenizer, ddp_model,
           raw_model, optimizer, scheduler, runtime, run: _Run) -> None:
    """Datasets, callbacks and the training loop of a set-up run; `run` records where it
    stands, so that the caller ends the callbacks with the right exit reason."""
    iteration, consumed_samples, loaded_at = run.iteration, run.consumed_samples, run.loaded_at
    try:
        train_ds, valid_ds, _test_ds = build_datasets(args, tokenizer)
    except Exception as exc:   # megatron-core wraps a MemoryError of its builders
        if not _caused_by_memory(exc):
            raise
        raise TrainingError(
            f"out of memory building the datasets ({type(exc).__name__}): the sample index "
            f"holds --train-iters {args.train_iters} x --global-batch-size "
            f"{args.global_batch_size} = {args.train_iters * args.global_batch_size:,} samples "
            f"of --seq-length {args.seq_length}; lower --global-batch-size or "
            "--micro-batch-size") from exc
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    train_iter = build_data_iterator(train_ds, consumed_samples, args, dp_rank, dp_size)
    valid_iter = build_data_iterator(valid_ds, 0, args, dp_rank, dp_size, cyclic=True)
    if unscanned_sidecars(args.data_prefixes):
        # A sidecar trusted without a scan at start: its batches are checked as they come.
        train_iter = checked_batches(train_iter, tokenizer.vocab_size)
        valid_iter = checked_batches(valid_iter, tokenizer.vocab_size)

    logger = _TrainingLogger(args)
    capture = capture_callback(args)
    callbacks = callbacks + ([capture] if capture is not None else [])
    if args.quant_stats_interval:
        callbacks.append(QuantStatsCallback(
            args.quant_stats_interval, logger.log_quant_stats,
            ep_rank=parallel_state.get_expert_model_parallel_rank()))
    for cb in callbacks:
        cb.on_train_start([ddp_model], iteration)
        run.started.append(cb)

    micro_batch = {"index": 0}

    def counted_forward_step(data_iterator, model):
        for cb in callbacks:
            cb.on_micro_batch_start(iteration + 1, micro_batch["index"])
        micro_batch["index"] += 1
        return forward_step_func(data_iterator, model)

    signals = _SignalHandler()
    print_rank_0(f"[{_timestamp()}] training from iteration {iteration} to {args.train_iters} "
                 f"({args.num_micro_batches} micro-batches of {args.micro_batch_size} per "
                 f"data-parallel rank, DP={dp_size})")
    saved_at = validated_at = None

    def validate(at: int) -> None:
        nonlocal validated_at
        sync_params(ddp_model, args)
        val = evaluate(forward_step_func, valid_iter, ddp_model, args)
        if val is not None:
            result.val_losses[at] = val
        logger.log_validation(at, val)
        validated_at = at

    try:
        while iteration < args.train_iters:
            # Stochastic-rounding draws are keyed by (seed, iteration, DP rank, site, ...).
            runtime.start_iteration(args.seed, iteration + 1, dp_rank)
            _enter_phase(runtime, schedule.phase_at(args.quant_schedule_switches, iteration + 1),
                         iteration + 1)
            for cb in callbacks:
                cb.on_iteration_start(iteration + 1)
            micro_batch["index"] = 0
            try:
                loss, grad_norm, skipped = train_step(
                    counted_forward_step, train_iter, ddp_model, optimizer, scheduler, args)
            except (RuntimeError, MemoryError) as exc:
                raise _step_failure(exc, iteration + 1, args, saved_at or loaded_at) from exc
            iteration += 1
            consumed_samples += args.global_batch_size
            run.iteration, run.consumed_samples = iteration, consumed_samples
            if loss is not None:
                result.losses[iteration] = loss
            if grad_norm is not None:
                result.grad_norms[iteration] = float(grad_norm)
            stop = [r for r in (cb.on_iteration_end(iteration) for cb in callbacks) if r]
            logger.log_iteration(iteration, loss, optimizer.param_groups[0]["lr"], grad_norm,
                                 skipped, consumed_samples)

            if args.eval_interval and iteration % args.eval_interval == 0 and valid_iter:
                validate(iteration)

            if args.save and args.save_interval and iteration % args.save_interval == 0:
                sync_params(ddp_model, args)
                result.checkpoint = checkpointing.save_checkpoint(
                    args.save, iteration, raw_model, optimizer, scheduler, args,
                    consumed_samples, log=print_rank_0)
                saved_at = iteration
            reason = _exit_reason(args, iteration, start_time, signals.received, bool(stop))
            if reason is not None:
                run.exit_reason = stop[0] if reason == "callback" and stop else reason
                break
        if run.exit_reason == "train-iters" and valid_iter and validated_at != iteration:
            # As Megatron-LM: the end of training is always validated, whatever --eval-interval.
            validate(iteration)
    finally:
        signals.restore()
        logger.close()

    if args.save and saved_at != iteration and iteration > 0:
        sync_params(ddp_model, args)
        result.checkpoint = checkpointing.save_checkpoint(
            args.save, iteration, raw_model, optimizer, scheduler, args, consumed_samples,
            log=print_rank_0)
    run.completed = True




def checked_batches(iterator, vocab_size: int):
    """`iterator`'s batches, each checked for token ids outside the vocabulary (which the
    embedding would meet as an IndexError, or as a padding row in silence). The start-up check
    finds them in every .bin without a sidecar or small enough to verify its sidecar; this
    catches a wrong sidecar of a larger one. A max over a micro-batch of ids per step."""
    if iterator is None:
        return None

    def check():
        for batch in iterator:
            for key in ("tokens", "labels"):
                ids = batch.get(key) if isinstance(batch, dict) else None
                if ids is not None and ids.numel() and int(ids.max()) >= vocab_size:
                    raise TrainingError(
                        f"the training data holds token id {int(ids.max())}, outside the run's "
                        f"vocabulary (0..{vocab_size - 1}): the sidecar (PREFIX.json) of a "
                        "--data-path dataset too large to scan at start records a smaller "
                        "largest id; rebuild that dataset or its sidecar (python "
                        "tools/preprocess_data.py --write-sidecar PREFIX <tokenizer flags>), or "
                        "train with the tokenizer it was built with")
            yield batch

    return check()


def _allocation(exc: BaseException) -> str:
    """What failed to allocate, in a few words: 'tried to allocate 2,048,000,000 bytes'."""
    found = re.search(r"allocate (\d+) bytes", str(exc))
    if found:
        return f"an allocation of {int(found.group(1)):,} bytes failed"
    return type(exc).__name__


def _caused_by_memory(exc: BaseException) -> bool:
    """Whether a MemoryError (or an out-of-memory error) is in exc's cause/context chain."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc).lower()
        if isinstance(exc, MemoryError) or "out of memory" in text or \
                "can't allocate memory" in text:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _enter_phase(runtime, phase: str, iteration: int) -> None:
    """Run iteration `iteration` in the precision schedule's `phase`, saying so when it is not
    the phase the sites ran last (a switch, or a resume into a high-precision phase)."""
    if phase != runtime.phase:
        print_rank_0(f"[{_timestamp()}] --quant-schedule: from iteration {iteration}, {phase} "
                     f"({schedule.PHASE_TEXT[phase]})")
        runtime.phase = phase


def _step_failure(exc: BaseException, iteration: int, args, checkpoint_iteration):
    """The one-line TrainingError for a training step that failed in a way the user can act
    on (divergence, out of memory); anything else is re-raised as it is."""
    text = str(exc)
    where = (f"the last checkpoint is iteration {checkpoint_iteration} in "
             f"{args.save or args.load}" if checkpoint_iteration else "no checkpoint was saved")
    if "Unexpected result nan" in text or "Unexpected result inf" in text or "found NaN" in text:
        what = "NaN" if "nan" in text.lower() else "Inf"
        return TrainingError(
            f"training diverged at iteration {iteration}: {what} in the gradients "
            f"(--lr {args.lr:g}); {where}; lower --lr or raise --lr-warmup-iters, or look at "
            "the last log lines for the loss and grad norm that led there")
    if _caused_by_memory(exc):
        tokens = args.micro_batch_size * args.seq_length
        return TrainingError(
            f"out of memory at iteration {iteration} ({type(exc).__name__}): a micro-batch is "
            f"--micro-batch-size {args.micro_batch_size} x --seq-length {args.seq_length} = "
            f"{tokens:,} tokens; lower --micro-batch-size (the global batch is kept by more "
            "micro-batches) or use --recompute-activations")
    return exc


def _exit_reason(args, iteration, start_time, signal_received, callback_stop) -> Optional[str]:
    """Why the run should stop after this iteration (same answer on every rank), or None."""
    signal_any, callback_any, minutes = _max_over_ranks(
        float(signal_received), float(callback_stop), (time.time() - start_time) / 60.0)
    if signal_any > 0:
        return "signal"
    if callback_any > 0:
        return "callback"
    if args.exit_duration_in_mins is not None and minutes > args.exit_duration_in_mins:
        return "exit-duration-in-mins"
    if args.exit_interval is not None and iteration % args.exit_interval == 0:
        return "exit-interval"
    return None
