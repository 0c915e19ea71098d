"""The report's tables, built once from statistics.json and rendered by textreport (plain
text) and report (HTML): a title, notes, headers and rows of (value, kind) cells. The summary
table (one row per scheme) is also written into statistics.json (`Table.as_json`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from megatron.analysis import provenance, study
from megatron.analysis.hifp8 import TENSOR, cast_views
from megatron.analysis.naming import display_site
from megatron.analysis.statistics import OUTPUT_SCHEME_KEY, OUTPUT_SCHEMES_KEY

Cell = Tuple[object, str]       # (value, kind): kind "text", "int", "pct", "pct100", "db", "g"
REGION_KEYS = ("underflow", "denormal", "mant1", "mant2", "mant3", "overflow")
REGION_HEADERS = ["underflow", "denormal", "1-bit mant", "2-bit mant", "3-bit mant", "overflow"]


SUMMARY_KEY = "summary"
DASH = "\u2014"        # a missing value in the summary table


@dataclass
class Table:
    key: str
    title: str
    headers: List[str]
    rows: List[List[Cell]]
    notes: List[str] = field(default_factory=list)
    missing: str = "-"     # how a missing value (None) is shown
    # What the alarming numbers of this table mean (megatron.analysis.explain), shown with it.
    explanations: List[str] = field(default_factory=list)

    def cells(self) -> List[List[str]]:
        """The rows as plain text."""
        return [[self.missing if value is None else fmt(value, kind) for value, kind in row]
                for row in self.rows]

    def as_json(self) -> dict:
        """The table with its raw values (null where missing), for statistics.json."""
        return {"key": self.key, "title": self.title, "headers": list(self.headers),
                "rows": [[value for value, _ in row] for row in self.rows],
                "notes": list(self.notes), "explanations": list(self.explanations)}


def fmt(value, kind: str = "g") -> str:
    """A cell as plain text ("-" for missing values)."""
    if value is None:
        return "-"
    if kind == "text" or isinstance(value, str):
        return str(value)
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if kind == "pct":
        return f"{100.0 * value:.4g}%"
    if kind == "pct100":
        return f"{value:.4g}%"
    if kind == "db":
        return f"{value:.2f}"
    if kind == "int":
        return f"{int(value):,}"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _t(value) -> Cell:
    return (value, "text")


def _left_out_note(left_out: dict, what: str) -> Optional[str]:
    if not left_out:
        return None
    parts = [f"{scheme}: {item['records']:,} records ({', '.join(item['tensor_names'])})"
             for scheme, item in sorted(left_out.items())]
    return f"Left out as {what}: " + "; ".join(parts) + "."


def run_table(doc: dict) -> Optional[Table]:
    rows = [[_t(label), _t(value)] for label, value in provenance.lines(doc.get("provenance"))]
    return Table("run", "Run", ["item", "value"], rows) if rows else None


def captures_table(doc: dict) -> Optional[Table]:
    schemes = doc.get(OUTPUT_SCHEMES_KEY) or {}
    if not schemes:
        return None
    comparison = doc.get("comparison") or {}
    shared = comparison.get("per_scheme") or {}
    rows = []
    for scheme, sec in schemes.items():
        cap, overall = sec["capture"], sec["overall"] or {}
        same = shared.get(scheme) or {}
        quant = (same.get("quantization") or {})
        rows.append([_t(scheme), _t(cap.get("status", "complete")),
                     (cap["manifest_records"], "int"),
                     (overall.get("records_with_tensors"), "int"),
                     (same.get("records"), "int"), (same.get("elements"), "int"),
                     (same.get("absmax"), "g"), (same.get("kurtosis"), "g"),
                     ((sec.get("quantized") or {}).get("records"), "int"),
                     (quant.get("sqnr_db"), "db")])
    notes = []
    if len(schemes) > 1:
        notes.append(f"Columns from 'compared' on are over the "
                     f"{comparison.get('tensors_in_every_scheme', 0)} tensors (layer, module, "
                     f"tensor name) every scheme captured, so schemes are compared on the same "
                     f"tensors; quantized records count all of a scheme's quantized operands.")
        note = _left_out_note(comparison.get("left_out") or {}, "not captured by every scheme")
        if note:
            notes.append(note)
    return Table("captures", "Captures", ["quant type", "status", "records", "with tensors",
                                          "compared", "elements", "absmax", "kurtosis",
                                          "quantized records", "SQNR dB (quantized)"],
                 rows, notes)


def format_table(doc: dict) -> Optional[Table]:
    comp = doc.get("format_comparison") or []
    if not comp:
        return None
    rows = [[_t(r[OUTPUT_SCHEME_KEY]), _t(r["format"]), _t(r["operation"]),
             (r["records"], "int"), (r["sqnr_db"], "db"), (r["mse"], "g"),
             (r["relative_error"], "g"), (r["saturated_fraction"], "pct"),
             (r["flushed_fraction"], "pct"), (r["nonfinite_fraction"], "pct")] for r in comp]
    comparison = doc.get("comparison") or {}
    notes = []
    if len(comparison.get("quantized_schemes") or []) > 1:
        notes.append(f"Over the {comparison['quantized_operands_in_every_quantized_scheme']} "
                     "operands (layer, module, tensor name) every quantized scheme quantized; "
                     "statistics.json's format_comparison_all has every operand.")
        note = _left_out_note(comparison.get("left_out_quantized") or {},
                              "not quantized by every quantized scheme")
        if note:
            notes.append(note)
    return Table("format_comparison", "Quantization error by format (quantized operands)",
                 ["quant type", "format", "operation", "records", "SQNR dB", "MSE",
                  "rel. error", "saturated", "flushed", "non-finite"], rows, notes)


def tensor_tables(doc: dict) -> List[Table]:
    out = []
    for scheme, sec in (doc.get(OUTPUT_SCHEMES_KEY) or {}).items():
        rows = []
        for name, m in (sec.get("by_tensor") or {}).items():
            q = m.get("quantization") or {}
            scale = q.get("scale_exponent")
            rows.append([_t(name), (m["records"], "int"), (m["absmax"], "g"), (m["std"], "g"),
                         (m["dynamic_range_binades"], "g"), (q.get("sqnr_db"), "db"),
                         (q.get("saturated_fraction"), "pct"),
                         (q.get("flushed_fraction"), "pct"),
                         _t(f"{scale['min']}..{scale['max']}" if scale else None)])
        if rows:
            out.append(Table(f"tensors_{scheme}", f"{scheme}: per tensor",
                             ["tensor", "records", "absmax", "std", "range (binades)",
                              "SQNR dB", "saturated", "flushed", "E8M0 exps"], rows))
    return out


def hifp8_table(doc: dict) -> Optional[Table]:
    """HiF8 regions per scheme and tensor class, read with the run's HiF8 scaling: the HiF8
    operands as the grid saw them, and, when the HiF8 runs scaled per tensor, the other
    schemes' tensors as HiF8 would see them with the same rule, besides the unscaled values.
    None when no run used HiF8 (the regions describe HiF8's grid)."""
    if not doc.get("hifp8_scaling"):
        return None
    rows = []
    scaled_any = cast_scaled = False
    scaled_run = TENSOR in cast_views(doc.get("hifp8_scaling") or {})
    by_class = (doc.get("comparison") or {}).get("by_tensor_class") or {}
    for scheme, classes in by_class.items():
        for cls, m in classes.items():
            views = []
            if m.get("hifp8_scaled_records") and m.get("hifp8_grid_regions"):
                scaled_any = True
                views.append((f"HiF8 grid (scaled x2^k, {m['hifp8_scaled_records']} records)",
                              m["hifp8_grid_regions"]))
            elif scaled_run and not m.get("hifp8_grid_regions") \
                    and m.get("hifp8_tensor_scaled_regions"):
                cast_scaled = True
                views.append(("if cast with a per-tensor scale",
                              m["hifp8_tensor_scaled_regions"]))
            views.append(("unscaled values", m.get("hifp8_regions")))
            for view, regions in views:
                if regions:
                    rows.append([_t(scheme), _t(cls), _t(view)] +
                                [(regions[k], "pct") for k in REGION_KEYS])
    if not rows:
        return None
    notes = ["Share of finite nonzero values per region of HiF8's tapered format, over the "
             "tensors every scheme captured. 'unscaled values' are where the captured values "
             "fall on HiF8's grid as they are"]
    if scaled_any:
        notes[0] += ("; 'HiF8 grid' rows are the HiF8 operands quantized with a per-tensor "
                     "scale, as the grid saw them (hp * 2^k)")
    if cast_scaled:
        notes[0] += ("; 'if cast with a per-tensor scale' rows read the other schemes' "
                     "tensors with the HiF8 runs' scaling (--hifp8-scaling tensor): each "
                     "record times 2^k, k from its amax by the rule training uses (amax * 2^k "
                     "in [8, 16))")
    notes[0] += "."
    return Table("hifp8_regions", "HiF8 precision regions", ["quant type", "tensors", "values"]
                 + REGION_HEADERS, rows, notes)


def _scale_range(low, high) -> Optional[str]:
    if low is None or high is None:
        return None
    return fmt(low) if low == high else f"{fmt(low)}..{fmt(high)}"


def scales_table(doc: dict) -> Optional[Table]:
    """NVFP4 and FP8 operands: their per-tensor and block scales, and for NVFP4 the shares of
    blocks whose E4M3 scale is zero or subnormal."""
    rows = []
    for r in doc.get("scales") or []:
        nv = r.get("nvfp4_block_scales") or {}
        rows.append([_t(r[OUTPUT_SCHEME_KEY]), _t(r["format"]), _t(r["tensor_class"]),
                     _t(r["operation"]), (r["records"], "int"),
                     _t(_scale_range(r.get("tensor_scale_min"), r.get("tensor_scale_max"))),
                     (r.get("blocks") or None, "int"),
                     _t(_scale_range(r.get("block_scale_min"), r.get("block_scale_max"))),
                     (nv.get("zero_fraction"), "pct"), (nv.get("subnormal_fraction"), "pct"),
                     (r.get("saturated_fraction"), "pct")])
    if not rows:
        return None
    return Table("scales", "Scales of NVFP4 and FP8 operands",
                 ["quant type", "format", "tensors", "operation", "records", "tensor scale",
                  "blocks", "block scales", "zero scale", "subnormal scale", "saturated"],
                 rows,
                 ["Tensor scale: NVFP4's float32 2688 / amax, FP8's fp8_max / amax (from the "
                  "delayed amax under delayed scaling), over the records. Block scales: the "
                  "nonzero NVFP4 E4M3 block scales, the FP8 blockwise tile scales. Zero / "
                  "subnormal scale: the share of NVFP4 blocks whose E4M3 scale is 0 (the whole "
                  "block became 0; all-zero blocks included) or below 2^-6 (subnormal: coarse "
                  "scale, elements may saturate at 6). Saturated: elements the clamp changed "
                  "(NVFP4 |v| >= 7, FP8 beyond max + half a step)."])


def _gap_note(losses: dict) -> str:
    """What a loss gap is, and what its spread is not (seed-to-seed noise)."""
    base = losses.get("baseline") or "(baseline not found)"
    return (f"gap = mean loss minus {base}'s mean loss over the last "
            f"{100 * losses.get('window_fraction', 0.1):.0f}% of the iterations both runs "
            f"logged (at least {losses.get('min_window', 3)}); spread = "
            "sqrt(std_run^2 + std_baseline^2) over that window (sample std): the curves' "
            "batch-to-batch spread, not seed-to-seed noise, which one run per scheme cannot "
            "measure (tools/study.py can).")


def loss_table(doc: dict) -> Optional[Table]:
    losses = doc.get("losses") or {}
    if not losses.get("table"):
        return None
    rows = []
    for r in losses["table"]:
        window = r.get("gap_window") or r.get("window")
        mean_std = (None if r.get("window_mean_loss") is None else
                    f"{fmt(r['window_mean_loss'])} ± {fmt(r['window_std_loss'])}")
        validation = None
        if r.get("validation_difference_to_baseline") is not None:
            validation = (f"{fmt(r['validation_difference_to_baseline'])} "
                          f"(it {r['validation_compared_at_iteration']})")
        rows.append([_t(r["run"]), (r["final_iteration"], "int"), (r["final_loss"], "g"),
                     _t(f"{window[0]}-{window[1]}" if window else None), _t(mean_std),
                     (r.get("gap_to_baseline"), "g"), (r.get("gap_spread"), "g"),
                     (r.get("relative_gap_to_baseline"), "pct"), _t(r.get("gap_note")),
                     (r["final_validation_loss"], "g"), _t(validation)])
    base = losses.get("baseline") or "(baseline not found)"
    notes = [_gap_note(losses) + " Validation: the difference at the last common evaluation "
             "(one point, not a gap)."]
    return Table("losses", f"Loss gap to {base}",
                 ["run", "last iteration", "final loss", "window", "mean ± std", "gap",
                  "spread", "rel. gap", "note", "validation loss", "validation difference"],
                 rows, notes)


def _where(item: Optional[dict], with_step: bool = True) -> Optional[str]:
    if not item or item.get("site") is None:
        return None
    step = f", it {item['step']}" if with_step else ""
    return f"{display_site(item['site'])} {item['operand']}{step}"


def _nonfinite(scheme: dict) -> str:
    item = scheme.get("nonfinite")
    if not item:
        return "none"
    return (f"{item['operands']} operand(s), first {display_site(item['site'])} "
            f"{item['operand']} at it "
            f"{item['first_step']}")


def telemetry_table(doc: dict) -> Optional[Table]:
    telemetry = doc.get("telemetry") or {}
    if not telemetry.get("schemes"):
        return None
    rows = []
    for scheme, s in telemetry["schemes"].items():
        worst = s.get("worst_sqnr_db_at_last_step") or {}
        sat = s.get("max_saturated_pct") or {}
        flushed = s.get("max_flushed_pct") or {}
        rows.append([_t(scheme), _t(f"{s['steps'][0]}-{s['steps'][1]} ({s['points']})"),
                     (s["quantized_operands"], "int"),
                     (s.get("mean_sqnr_db_at_last_step"), "db"), (worst.get("value"), "db"),
                     _t(_where(worst or None, with_step=False)),
                     (sat.get("value"), "pct100"), _t(_where(sat or None)),
                     (flushed.get("value"), "pct100"), _t(_where(flushed or None)),
                     ((s.get("max_amax") or {}).get("value"), "g"), _t(_nonfinite(s))])
        blocks = [s.get("max_block_scale_zero_pct"), s.get("max_block_scale_subnormal_pct")]
        if any(blocks):
            rows[-1].append(_t(" / ".join(fmt((b or {}).get("value"), "pct100")
                                         for b in blocks)))
    nvfp4 = any(len(row) > 12 for row in rows)
    headers = ["quant type", "iterations (points)", "quantized operands",
               "mean SQNR dB (last)", "worst SQNR dB (last)", "worst operand",
               "max saturated", "where", "max flushed", "where", "max amax", "NaN/Inf"]
    notes = ["From the quant/... scalars training logs with --quant-stats-interval; "
             "'last' is the last logged iteration."]
    if nvfp4:
        headers.append("NVFP4 zero / subnormal block scales (max)")
        rows = [row + [_t(None)] * (len(headers) - len(row)) for row in rows]
        notes.append("NVFP4: the largest share, over operands and iterations, of blocks whose "
                     "E4M3 scale is 0 / subnormal (below 2^-6).")
    return Table("telemetry", "Quantization telemetry (TensorBoard)", headers, rows, notes)


def study_table(doc: dict) -> Optional[Table]:
    """The multi-seed study (--study study.json): final losses and paired gaps."""
    data = doc.get("study")
    if not data:
        return None
    rows = [[_t(cell) for cell in row] for row in study.table_rows(data)]
    return Table("study", "Scheme study over seeds (tools/study.py)", list(study.HEADER), rows,
                 [study.describe_budget(data) + f"; baseline {data['baseline']}.",
                  study.noise_note(data),
                  "Gap: the mean over seeds of the per-seed relative difference of the final "
                  "validation loss, with its 95% t interval; 'within noise' when the interval "
                  "contains 0."])


def _loss_gap(row: Optional[dict], baseline: Optional[str]) -> Optional[str]:
    """A run's loss gap to the baseline in words: value ± spread (relative), and whether it
    is within the curves' spread."""
    if not row:
        return None
    if row["run"] == baseline:
        return "baseline"
    gap = row.get("gap_to_baseline")
    if gap is None:
        return None
    text = f"{gap:+.3g} \u00b1 {row['gap_spread']:.2g}"
    if row.get("relative_gap_to_baseline") is not None:
        text += f" ({100 * row['relative_gap_to_baseline']:+.2g}%)"
    return text + (", within the curves' spread" if row.get("gap_within_noise")
                   else ", beyond the curves' spread")


def summary_table(doc: dict) -> Optional[Table]:
    """One row per scheme, at the top of the reports: the worst quantized site, the saturated
    and flushed-to-zero shares, the median and worst site SQNR and the loss gap."""
    schemes = doc.get(OUTPUT_SCHEMES_KEY) or {}
    losses = doc.get("losses") or {}
    by_run = {r["run"]: r for r in losses.get("table") or []}
    run_of = {}
    for scheme in schemes:
        for name in (scheme, scheme.split("@")[0]):
            if name in by_run:
                run_of[scheme] = name
                break
    names = list(schemes) + [run for run in by_run if run not in run_of.values()]
    if not names:
        return None
    rows = []
    incomplete = False
    for name in names:
        sec = schemes.get(name) or {}
        q = (sec.get("quantized") or {}).get("quantization") or {}
        sites = sec.get("quantized_sites") or {}
        worst = sites.get("worst") or {}
        run = run_of.get(name) if name in schemes else name
        status = (sec.get("capture") or {}).get("status", "complete")
        label = name if status == "complete" else f"{name}: {status}"
        incomplete |= status != "complete"
        rows.append([_t(label), _t(worst.get("site")), (q.get("saturated_fraction"), "pct"),
                     (q.get("flushed_fraction"), "pct"), (sites.get("median_sqnr_db"), "db"),
                     (worst.get("sqnr_db"), "db"),
                     _t(_loss_gap(by_run.get(run), losses.get("baseline")))])
    baseline = losses.get("baseline") or (doc.get("inputs") or {}).get("loss_baseline") \
        or "bf16"
    notes = ["Per scheme over all of its quantized operands (the format table below compares "
             "only the operands every scheme quantized). A site is one operand of one layer "
             "(layer, module, tensor name) over every captured iteration, micro-batch and "
             "rank; the worst site has the lowest SQNR = 10 log10(sum x^2 / sum (q - x)^2), "
             "i.e. the highest relative error sqrt(sum (q - x)^2 / sum x^2); median and worst "
             "SQNR are over the sites. Saturated: finite elements clamped at the format's "
             "largest value; flushed to zero: nonzero elements that became 0."]
    if by_run:
        notes.append("Loss gap: " + _gap_note(losses) + " Shown as gap \u00b1 spread "
                     "(relative gap).")
    else:
        notes.append(f"Loss gap to {baseline}: no loss logs given (--loss-logs / --loss-dir).")
    if incomplete:
        notes.append("A scheme marked 'incomplete run (killed?)' is summarised from the records "
                     "its capture finished (see the problems).")
    notes.append(f"{DASH}: not available (an unquantized scheme has no quantization error, a "
                 "scheme without a loss log no gap).")
    return Table(SUMMARY_KEY, "Summary", ["quant type", "worst site (lowest SQNR)",
                                          "saturated", "flushed to zero", "median SQNR dB",
                                          "worst SQNR dB", f"loss gap to {baseline}"],
                 rows, notes, missing=DASH)


def explained(table: Table, doc: dict) -> Table:
    """`table` with the explanations of the alarming numbers it shows (doc["explanations"],
    megatron.analysis.explain)."""
    table.explanations = list((doc.get("explanations") or {}).get(table.key, []))
    return table


def all_tables(doc: dict) -> List[Table]:
    """Every table in report order (the summary first), each with the explanations of the
    alarming numbers it shows."""
    tables: Sequence[Optional[Table]] = (
        [summary_table(doc), run_table(doc), study_table(doc), captures_table(doc),
         format_table(doc)]
        + tensor_tables(doc)
        + [scales_table(doc), hifp8_table(doc), loss_table(doc), telemetry_table(doc)])
    return [explained(t, doc) for t in tables if t is not None]
