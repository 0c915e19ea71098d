"""Training-loop integration of tensor capture (a training callback, configured by a
`CaptureConfig`; the loop calls the methods below).

Life cycle, driven by the training loop:
- on_train_start: every rank agrees on a run id (rank 0 claims it), opens its manifest and
  starts its writer thread; rank 0 writes run-{run_id}.json.
- on_iteration_start: for a captured iteration, the GEMM observer watches the model (through
  its quantization runtime; otherwise nothing watches and the quantized layers run their
  unobserved fast path).
- on_micro_batch_start: tell the observer which micro-batch is running forward.
- on_iteration_end: stop watching, log one line, report a capture failure as a stop reason
  starting with "error" (or keep training with --tensor-save-continue-on-error), and return
  "control-iter" after the last iteration --control-iter names (after the writer has
  drained), whether or not capture failed on the way.
- on_train_end: drain the writer (bounded by --tensor-save-drain-timeout), write the rank's
  summary file (its space was reserved at the start, so a full disk does not lose it) and
  log the summary line. The training loop calls it from its `finally`, so a run that dies by
  an exception is finalised too (exit reason "exception").
"""

from __future__ import annotations

import os
import sys
from datetime import datetime
from typing import Dict, Optional

import torch

from megatron.quantization.runtime import runtimes
from megatron.tensor_capture import format as capture_format
from megatron.tensor_capture.config import CaptureConfig
from megatron.tensor_capture.hooks import CaptureObserver
from megatron.tensor_capture.policy import CapturePolicy
from megatron.tensor_capture.records import (
    HostBufferPool, Recorder, RunContext, SiteInfo, site_info)
from megatron.tensor_capture.diskio import ReservedFile, describe_error, free_bytes
from megatron.tensor_capture.estimate import estimate_bytes, site_shapes
from megatron.tensor_capture.progress import human_bytes
from megatron.tensor_capture.routing import RuleRouter
from megatron.tensor_capture.writer import CaptureWriter

def _mb(nbytes: float) -> str:
    return f"{nbytes / 2 ** 20:.1f} MiB"


def _now() -> str:
    return datetime.now().astimezone().isoformat(timespec="seconds")


def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _parallel_ranks() -> Dict[str, int]:
    ranks = {"rank": 0, "world_size": 1, "tp_rank": 0, "pp_rank": 0, "dp_rank": 0, "ep_rank": 0}
    if not _dist_ready():
        return ranks
    from megatron.core import parallel_state as ps

    ranks.update(rank=torch.distributed.get_rank(), world_size=torch.distributed.get_world_size())
    if ps.model_parallel_is_initialized():
        ranks.update(tp_rank=ps.get_tensor_model_parallel_rank(),
                     pp_rank=ps.get_pipeline_model_parallel_rank(),
                     dp_rank=ps.get_data_parallel_rank(),
                     ep_rank=ps.get_expert_model_parallel_rank())
    return ranks


def collect_sites(model_chunks, ep_rank: int = 0) -> Dict[str, SiteInfo]:
    """SiteInfo of every GEMM site in the model chunks (wrappers are looked through)."""
    sites: Dict[str, SiteInfo] = {}
    for chunk in model_chunks:
        expert_offset = {}
        for module in chunk.modules():
            experts = getattr(module, "local_experts", None)
            if isinstance(experts, torch.nn.ModuleList):
                for sub in experts.modules():
                    site = getattr(sub, "quant_site", None)
                    if site is not None:
                        expert_offset[site.name] = ep_rank * len(experts)
        for module in chunk.modules():
            site = getattr(module, "quant_site", None)
            if site is not None:
                sites[site.name] = site_info(site, expert_offset.get(site.name, 0))
            for attr in ("qk_site", "pv_site"):
                site = getattr(module, attr, None)
                if site is None:
                    continue
                groups = getattr(module, "num_query_groups_per_partition", None)
                heads = getattr(module, "num_attention_heads_per_partition", None)
                per_group = heads // groups if groups and heads else None
                sites[site.name] = site_info(site, groups=groups, heads_per_group=per_group)
    return sites


class TensorCaptureCallback:
    """Captures GEMM tensors at the iterations and micro-batches `config` selects.

    `run_info` is what the run file records besides the capture settings: `args` (the run's
    flags, JSON-ready) and `quant_config` (the printed per-GEMM configuration).
    """

    def __init__(self, config: CaptureConfig, run_info: Optional[dict] = None):
        self.config = config
        self.run_info = dict(run_info or {})
        self.continue_on_error = config.continue_on_error
        self.directory = config.directory
        self.policy: Optional[CapturePolicy] = None
        self.writer: Optional[CaptureWriter] = None
        self.summary_file: Optional[ReservedFile] = None
        self.observer: Optional[CaptureObserver] = None
        self.recorder: Optional[Recorder] = None
        self.run_id: Optional[str] = None
        self.ranks = _parallel_ranks()
        self.error: Optional[str] = None
        self.stopped = False          # capture off for the rest of the run
        self.registered = False
        self.finished = False
        self.exit_reason: Optional[str] = None
        self.error_reported = False   # the stop reason was returned once
        self._iteration_marks = (0, 0, 0.0, 0.0)
        self.runtimes = []            # the quantization runtimes of the model's chunks

    # -- set-up ----------------------------------------------------------------------------

    def on_train_start(self, model_chunks, iteration: int) -> None:
        config = self.config
        self.runtimes = runtimes(model_chunks)
        self.ranks = _parallel_ranks()
        self.policy = CapturePolicy(
            control_iter=config.control_iter, micro_batches=config.micro_batches,
            layers=config.layers, name_filter=config.name_filter, start_iteration=iteration,
            rules=config.rules)
        self.run_id, error = self._agree_on_run_id()
        if error is None:
            error = self._open_writer()
        error, here = self._first_error_on_any_rank(error)
        if error is not None:
            self._fail(error, quiet=not here)
            return
        context = RunContext(run_id=self.run_id, quant_scheme=config.quant_scheme,
                             rank=self.ranks["rank"], tp_rank=self.ranks["tp_rank"],
                             pp_rank=self.ranks["pp_rank"], dp_rank=self.ranks["dp_rank"],
                             world_size=self.ranks["world_size"])
        router = RuleRouter(self.policy, self.writer.submit)
        self.recorder = router.recorder = Recorder(
            context=context, submit=router.submit, pool=HostBufferPool(self.writer.max_bytes))
        self.observer = CaptureObserver(self.policy, router,
                                        collect_sites(model_chunks, self.ranks["ep_rank"]),
                                        on_error=self._on_capture_exception)
        micro = min(config.micro_batches, config.num_micro_batches)
        self._log(f"capturing {self._iterations_text(iteration)}, micro-batches "
                  f"0..{micro - 1}, mode {config.mode} -> {self.directory} (run "
                  f"{self.run_id}); rules: {self.policy.describe()}")
        missed = sorted(self.policy.unreachable())
        if missed:
            which = f"iterations {', '.join(map(str, missed))} are" if len(missed) > 1 else \
                f"iteration {missed[0]} is"
            self._log(f"note: {which} not after the resumed iteration {iteration}, so not "
                      "captured")
        self._warn_if_disk_too_small(model_chunks, iteration)

    def _iterations_text(self, iteration: int) -> str:
        config, last = self.config, self.policy.last_iteration
        parts = []
        if config.control_iter == 0:
            parts.append("every iteration")
        elif last is not None:
            parts.append(f"iterations {iteration + 1}..{last} (then the run ends)")
        schedules = {r.schedule.describe() for r in self.policy.rules
                     if r.mode != "off" and not r.schedule.empty}
        if schedules:
            parts.append(f"iterations {' / '.join(sorted(schedules))}")
        return " and ".join(parts) or "no iteration"

    def _warn_if_disk_too_small(self, model_chunks, iteration: int) -> None:
        """One warning line when the estimated capture exceeds the free space. Ranks on one
        node share its disk (LOCAL_WORLD_SIZE of them under torchrun); local rank 0 speaks."""
        config = self.config
        if int(os.environ.get("LOCAL_RANK", "0")) != 0:
            return
        def plan(info, role, quantized):
            rule = self.policy.rule_for(info, role, quantized)
            return None if rule is None else \
                (rule.mode, self.policy.iteration_count(rule, config.train_iters))

        shapes = site_shapes(model_chunks, config.micro_batch_size, config.seq_length)
        micro = min(config.micro_batches, config.num_micro_batches)
        need = estimate_bytes(shapes, plan, micro, config.element_bytes) * \
            int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        free = free_bytes(self.directory)
        if free is not None and need > free:
            print(f"warning: tensor capture: the capture needs about {human_bytes(need)} but "
                  f"{self.directory} has {human_bytes(free)} free; it will stop with 'no space "
                  "left on device' (capture fewer iterations, layers or tensors, or use "
                  "--tensor-save-mode stats)", file=sys.stderr, flush=True)

    def _run_payload(self, run_id: str) -> bytes:
        config = self.config
        payload = {
            "format_version": capture_format.FORMAT_VERSION, "run_id": run_id,
            capture_format.SCHEME_KEY: config.quant_scheme, "mode": config.mode,
            "control_iter": config.control_iter,
            "collect_micro_batches": config.micro_batches,
            "config_file": config.config_file,
            "rules": [rule.to_json() for rule in config.rules],
            "world_size": self.ranks["world_size"], "args": self.run_info.get("args", {}),
            "quant_config": self.run_info.get("quant_config", ""), "start_time": _now(),
        }
        return capture_format.json_line(payload).encode("utf-8")

    def _agree_on_run_id(self):
        """Rank 0 claims a run id unique in the directory and broadcasts it (or its error)."""
        result = [None, None]
        if self.ranks["rank"] == 0:
            base = capture_format.base_run_id()
            try:
                run_id = capture_format.claim_run_id(self.directory, base,
                                             self._run_payload)
                result = [run_id, None]
            except OSError as exc:
                result = [base, describe_error(exc, directory=self.directory)]
        if self.ranks["world_size"] > 1 and _dist_ready():
            torch.distributed.broadcast_object_list(result, src=0)
        return result[0], result[1]

    def _open_writer(self) -> Optional[str]:
        try:
            os.makedirs(self.directory, exist_ok=True)
            manifest = capture_format.manifest_file(self.directory, self.run_id, self.ranks["rank"])
            self.summary_file = ReservedFile(capture_format.summary_file(
                self.directory, self.run_id, self.ranks["rank"]))
            self.writer = CaptureWriter(
                self.directory, manifest, max_records=self.config.queue_records,
                max_bytes=self.config.queue_bytes)
        except OSError as exc:
            return describe_error(exc, directory=self.directory)
        return None

    def _first_error_on_any_rank(self, error: Optional[str]):
        """(error, whether it happened here): every rank stops capturing if any rank could
        not start, so all ranks make the same decision."""
        if self.ranks["world_size"] == 1 or not _dist_ready():
            return error, True
        flag = torch.tensor([1.0 if error else 0.0])
        if torch.cuda.is_available():
            flag = flag.cuda()
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if flag.item() > 0 and error is None:
            return "capture could not start on another rank", False
        return error, True

    # -- per iteration ---------------------------------------------------------------------

    def on_iteration_start(self, iteration: int) -> None:
        if self.stopped or self.observer is None or not self.policy.captures_iteration(iteration):
            return
        self.observer.begin_iteration(iteration)
        for runtime in self.runtimes:
            runtime.add_observer(self.observer)
        self.registered = True
        w = self.writer
        self._iteration_marks = (self.recorder.records, self.recorder.data_bytes,
                                 self.observer.seconds, w.stall_seconds)

    def on_micro_batch_start(self, iteration: int, micro_batch: int) -> None:
        if self.registered:
            self.observer.micro_batch = micro_batch

    def on_iteration_end(self, iteration: int) -> Optional[str]:
        captured = self.registered
        self._unregister()
        last = self.policy.last_iteration if self.policy else None
        if captured and not self.stopped and (
                iteration == last or iteration >= self.config.train_iters):
            # The run is about to end: wait for the writer so its errors still count.
            self.writer.drain(self.config.drain_timeout)
        if captured:
            self._log_iteration(iteration)
        self._check_writer()
        if self.error is not None and not self.error_reported:
            self.error_reported = True
            if not self.continue_on_error:
                return f"error: tensor capture: {self.error}"
        if last is not None and iteration >= last:
            return "control-iter"
        return None

    def _unregister(self) -> None:
        if self.registered:
            for runtime in self.runtimes:
                runtime.remove_observer(self.observer)
            self.observer.end_iteration()
            self.registered = False

    def _log_iteration(self, iteration: int) -> None:
        records, data, seconds, stall = self._iteration_marks
        w = self.writer
        self._log(f"iteration {iteration}: {self.recorder.records - records} records "
                  f"({_mb(self.recorder.data_bytes - data)}) captured in "
                  f"{self.observer.seconds - seconds:.2f} s, stall "
                  f"{w.stall_seconds - stall:.2f} s; written so far {w.records} records, "
                  f"{_mb(w.bytes)}, {w.pending} pending")

    # -- errors ----------------------------------------------------------------------------

    def _check_writer(self) -> None:
        if self.writer is not None and self.writer.error is not None and self.error is None:
            self._fail(self.writer.error)

    def _on_capture_exception(self, exc: BaseException) -> None:
        self._fail(f"capture failed: {type(exc).__name__}: {exc}")

    def _fail(self, message: str, quiet: bool = False) -> None:
        """Record the first failure, say it once, and stop capturing."""
        if self.error is not None:
            return
        self.error = message
        self.stopped = True
        self._unregister()
        if quiet:
            return
        then = "continuing training without capture" if self.continue_on_error else \
            "stopping the run (pass --tensor-save-continue-on-error to keep training)"
        print(f"error: tensor capture{self._rank_label()}: {message}; capture stopped, {then}",
              file=sys.stderr, flush=True)

    def _rank_label(self) -> str:
        return f" (rank {self.ranks['rank']})" if self.ranks["world_size"] > 1 else ""

    # -- end -------------------------------------------------------------------------------

    def on_train_end(self, exit_reason: str) -> None:
        self.exit_reason = exit_reason
        self.finalize()

    def finalize(self, timeout: Optional[float] = None) -> None:
        """Drain the writer, write this rank's summary and log the summary line (once)."""
        if self.finished:
            return
        self.finished = True
        self._unregister()
        if self.writer is None:
            if self.summary_file is not None:
                self.summary_file.discard()
            if self.error is not None:
                self._log(f"summary: no records (capture failed: {self.error})", force=True)
            return
        timeout = self.config.drain_timeout if timeout is None else timeout
        self.writer.close(timeout)
        self._check_writer()
        summary = self.writer.summary()
        summary.update(error=self.error, end_time=_now(), run_id=self.run_id,
                       rank=self.ranks["rank"], exit_reason=self.exit_reason,
                       capture_seconds=round(self.observer.seconds, 6) if self.observer else 0.0)
        self._write_summary(summary)
        status = f"capture failed: {self.error}" if self.error else "complete"
        self._log(f"summary: {summary['records']} records, {summary['files']} files, "
                  f"{_mb(summary['bytes'])}, writing {summary['write_seconds']:.2f} s, stall "
                  f"{summary['stall_seconds']:.2f} s, {summary['dropped']} dropped ({status}) "
                  f"-> {self.directory} (run {self.run_id})", force=self.error is not None)

    def _write_summary(self, summary: dict) -> None:
        path = self.summary_file.path
        try:
            self.summary_file.write(capture_format.json_text(summary))
        except OSError as exc:
            self.summary_file.discard()
            message = describe_error(exc, path)
            if self.error is None:
                # The one line of a capture failure (records were complete, the summary not).
                self.error = message
                print(f"error: tensor capture{self._rank_label()}: {message}; the run summary "
                      f"{path} was not written", file=sys.stderr, flush=True)
            elif message != self.error:       # the same full disk is not said twice
                print(f"warning: tensor capture: summary not written ({message})",
                      file=sys.stderr, flush=True)

    def _log(self, message: str, force: bool = False) -> None:
        if self.ranks["rank"] == 0 or force:
            rank = f" rank {self.ranks['rank']}" if self.ranks["world_size"] > 1 else ""
            print(f"[tensor capture{rank}] {message}", flush=True)
