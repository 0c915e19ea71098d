"""What an alarming number means, said where the report shows it.

A reader who sees "23% saturated" or "32% flushed to zero" needs the mechanism, not only the
number: `explanations(doc)` turns the numbers of statistics.json that cross a threshold into
one-paragraph explanations, keyed by where the report shows them: `summary` (the summary at
the top), `format_comparison`, `tensors_<scheme>` (per-tensor tables), `telemetry`, `run`
(provenance that differs between runs) and `figure:<file>` (figure captions). The first
mention (under the summary, or under the telemetry table when there is no capture) is the
full explanation; tables further down repeat a one-sentence version.

The mechanisms follow docs/analysis.md, "Definitions": MX blocks share a power-of-two scale
derived from the block's amax (`floor`: e = floor(log2 amax) - emax_elem, `rceil`:
e = ceil(log2(amax / max_normal))), an element saturates when |x| / 2^e exceeds the element
format's largest value and is flushed when it is below half the smallest subnormal.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Dict, List, Optional

from megatron.analysis.naming import display_site
from megatron.analysis.ranges import FormatRanges, format_ranges
from megatron.analysis.statistics import OUTPUT_SCHEMES_KEY
from megatron.quantization.config import SettingError, scheme_formats
from megatron.quantization.formats import canonical_format

# A share this large (of a scheme's, a table row's or a site's elements) is explained.
ALARM_FRACTION = 0.01
# A worst site this many dB below the scheme's median site is explained (6 dB ~ one bit).
SQNR_OUTLIER_DB = 6.0
FLOOR, RCEIL = "floor", "rceil"
SATURATED, FLUSHED = "saturated", "flushed"


def pct(fraction: float) -> str:
    """A share as the report's tables print it (four significant digits)."""
    return f"{100.0 * fraction:.3g}%"


def _binade_share(r: FormatRanges) -> float:
    """Under the floor rule the block amax lies in [2^emax, 2^(emax+1)) element units; the
    share of that binade above max_normal is what clamps."""
    low = 2.0 ** r.emax_elem
    return max(0.0, (2 * low - r.max_normal) / low)


def _element_name(r: FormatRanges) -> str:
    names = {"mxfp8_e4m3": "E4M3", "mxfp8_e5m2": "E5M2", "mxfp6_e2m3": "E2M3",
             "mxfp6_e3m2": "E3M2", "mxfp4": "E2M1"}
    return names.get(r.name, r.name)


def _blocking(tensor_name: Optional[str]) -> str:
    if tensor_name and tensor_name.endswith("_wgrad"):
        return f" (one block of {tensor_name} is 32 tokens of one feature)"
    return ""


def mx_saturation(fmt: str, scale_mode: Optional[str], tensor_name: Optional[str] = None,
                  short: bool = False) -> Optional[str]:
    """Why MX elements saturate (None when the rule cannot saturate or fmt is not MX)."""
    r = format_ranges(fmt)
    if r.kind != "mx" or not r.max_normal or r.emax_elem is None or scale_mode == RCEIL:
        return None
    share = _binade_share(r)
    low, high = 2.0 ** r.emax_elem, 2.0 ** (r.emax_elem + 1)
    elem = _element_name(r)
    assumed = "" if scale_mode == FLOOR else " (if the run used the default floor rule)"
    if short:
        return (f"MX floor scale rule{assumed}: the top {share:.0%} of the binade of a block's "
                f"largest magnitude lies above {elem}'s {r.max_normal:g} and is clamped; "
                "--mx-scale-mode rceil never saturates (see the explanation at the top).")
    return (f"OCP's floor rule{assumed} (--mx-scale-mode floor) sets a block's exponent to "
            f"floor(log2 amax) - {r.emax_elem}, which leaves its largest magnitude in "
            f"[{low:g}, {high:g}) while {elem} ({fmt}) stops at {r.max_normal:g}: the top "
            f"{share:.0%} of that binade clamps, so blocks of near-equal magnitudes"
            f"{_blocking(tensor_name)} saturate in bulk. --mx-scale-mode rceil never "
            "saturates (it costs the small elements up to one binade).")


def _flush_ratio(r: FormatRanges, scale_mode: Optional[str]) -> Optional[tuple]:
    """(lo, hi): an MX element more than lo..hi times below its block's amax is flushed."""
    if not r.min_subnormal or not r.max_normal or r.emax_elem is None:
        return None
    threshold = r.min_subnormal / 2
    if scale_mode == RCEIL:
        return r.max_normal / 2 / threshold, r.max_normal / threshold
    return 2.0 ** r.emax_elem / threshold, 2.0 ** (r.emax_elem + 1) / threshold


def _times(value: float) -> str:
    exponent = math.log2(value)
    return f"2^{exponent:.0f}" if value >= 4096 and exponent == int(exponent) else f"{value:g}"


def flushing(fmt: str, scale_mode: Optional[str], short: bool = False) -> str:
    """Why elements become 0 in `fmt`."""
    r = format_ranges(fmt)
    if r.kind == "mx":
        lo, hi = _flush_ratio(r, scale_mode) or (None, None)
        where = (f"{_times(lo)} to {_times(hi)} times below its block's largest magnitude"
                 if lo else "far below its block's largest magnitude")
        if short:
            return (f"{fmt}: an element {where} becomes 0 (see the explanation at the top).")
        return (f"An MX element below half of {_element_name(r)}'s smallest subnormal "
                f"({r.min_subnormal:g}) in block units, {where}, becomes 0, so blocks that mix "
                "a large value with small ones lose the small ones.")
    if r.kind == "nvfp4":
        return ("NVFP4 scales each 16-element block so that its amax maps to 6 (E2M1's "
                "largest); an element more than about 24 times below its block's amax falls "
                "under 0.25, half of E2M1's smallest subnormal 0.5, and becomes 0, as do whole "
                "blocks whose E4M3 block scale rounds to 0 (the Scales table).")
    if r.kind == "fp8" and r.min_subnormal and r.max_normal:
        return (f"{fmt} scales the tensor (or 128-element tile) so that its amax maps to "
                f"{r.max_normal:g}; an element more than about "
                f"{_times(r.max_normal / (r.min_subnormal / 2))} times below that amax becomes 0.")
    if r.kind == "hifp8":
        return ("HiF8 represents magnitudes down to 2^-22 (denormals); smaller values "
                "(small gradients without a scale) underflow to 0; --hifp8-scaling tensor "
                "scales each operand so that its amax lands in [8, 16).")
    return f"{fmt}: elements below half the format's smallest subnormal become 0."


def saturation(fmt: str, scale_mode: Optional[str], tensor_name: Optional[str] = None,
               short: bool = False) -> Optional[str]:
    """Why elements saturate in `fmt` (None for MX under rceil: it cannot)."""
    r = format_ranges(fmt)
    if r.kind == "mx":
        return mx_saturation(fmt, scale_mode, tensor_name, short)
    if r.kind == "hifp8":
        return ("HiF8 clamps magnitudes from 32768 (its largest value; training saturates "
                "instead of overflowing): large activations or unscaled operands; "
                "--hifp8-scaling tensor scales each operand so that its amax lands in [8, 16).")
    if r.kind == "nvfp4":
        return ("NVFP4 elements saturate at 6 in blocks whose E4M3 block scale is subnormal "
                "(below 2^-6: three or fewer significant bits), rounded far below the block's "
                "amax; the Scales table shows those blocks' share.")
    if r.kind == "fp8":
        return (f"{fmt} saturates at {r.max_normal:g} when its scale comes from an amax "
                "smaller than the tensor's own: under delayed scaling (--fp8-recipe delayed) "
                "from the amax history of earlier iterations, which a growing tensor "
                "outgrows; current or blockwise scaling does not saturate.")
    return None


def _scale_mode(doc: dict, scheme: str) -> Optional[str]:
    """The MX scale rule of a scheme: from its records, else the runs' recorded flag."""
    modes = (doc.get("mx_scale_modes") or {}).get(scheme)
    if modes in (FLOOR, RCEIL):
        return modes
    field = ((doc.get("provenance") or {}).get("fields") or {}).get("scale_mode") or {}
    return field.get("value") if field.get("value") in (FLOOR, RCEIL) else None


def _first_format(text: Optional[str]) -> Optional[str]:
    """A site's formats read `a, b` when its records differ; the explanation follows `a`."""
    return text.split(", ")[0] if text else None


# what -> (the quantized_sites entry, the metrics key, how the summary says it)
_SHARES = {SATURATED: ("most_saturated", "saturated_fraction",
                       "of its quantized elements saturated"),
           FLUSHED: ("most_flushed", "flushed_fraction",
                     "of its nonzero quantized elements flushed to zero")}


def _why(what: str, fmt: str, mode: Optional[str], tensor_name: Optional[str],
         short: bool = False) -> Optional[str]:
    if what == SATURATED:
        return saturation(fmt, mode, tensor_name, short=short)
    return flushing(fmt, mode, short=short)


def _share_note(scheme: str, sec: dict, what: str, mode: Optional[str]) -> Optional[tuple]:
    """(the full explanation for the summary, its one-sentence version) of a scheme's
    saturated or flushed share, None when no site reaches ALARM_FRACTION."""
    entry, key, says = _SHARES[what]
    site = (sec.get("quantized_sites") or {}).get(entry)
    # the most affected site's share is at least the scheme's pooled share
    if not site or site[key] < ALARM_FRACTION:
        return None
    fmt = _first_format(site.get("format"))
    why = _why(what, fmt, mode, site["tensor_name"]) if fmt else None
    if not why:
        return None
    total = ((sec.get("quantized") or {}).get("quantization") or {}).get(key) or 0
    return (f"{scheme}: {pct(total)} {says} ({pct(site[key])} at {site['site']}). {why}",
            _why(what, fmt, mode, site["tensor_name"], short=True))


def _nonfinite_note(scheme: str, sec: dict) -> List[str]:
    share = ((sec.get("quantized") or {}).get("quantization") or {}).get("nonfinite_fraction")
    if not share:
        return []
    return [f"{scheme}: {pct(share)} of its quantized values are NaN or Inf: the "
            "high-precision operands held them (a diverging run; the telemetry's NaN/Inf "
            "column says where first), or a format without saturation overflowed."]


def _outlier_note(scheme: str, sec: dict) -> List[str]:
    """Why the worst site lies SQNR_OUTLIER_DB or more below the median site."""
    sites = sec.get("quantized_sites") or {}
    worst, median = sites.get("worst"), sites.get("median_sqnr_db")
    if not worst or median is None or not math.isfinite(worst["sqnr_db"]) \
            or median - worst["sqnr_db"] < SQNR_OUTLIER_DB:
        return []
    gap = median - worst["sqnr_db"]
    if (worst.get("saturated_fraction") or 0) >= ALARM_FRACTION:
        reason = (f"{pct(worst['saturated_fraction'])} of it saturated, which dominates its "
                  "error (above)")
    elif (worst.get("flushed_fraction") or 0) >= ALARM_FRACTION:
        reason = (f"{pct(worst['flushed_fraction'])} of it flushed to zero, which dominates "
                  "its error (above)")
    else:
        reason = ("not saturation or flushing but values spread over more binades per block "
                  "(or tensor) than the element format resolves (its range: the per-tensor "
                  "table)")
    return [f"{scheme}: its worst site, {worst['site']}, is at {worst['sqnr_db']:.1f} dB, "
            f"{gap:.0f} dB (about {gap / 6.02:.1f} bits) below the median site: {reason}."]


def _capture_notes(doc: dict, out: Dict[str, List[str]], explained: set) -> None:
    for scheme, sec in (doc.get(OUTPUT_SCHEMES_KEY) or {}).items():
        mode = _scale_mode(doc, scheme)
        short: Dict[str, str] = {}
        for what in _SHARES:
            note = _share_note(scheme, sec, what, mode)
            if note:
                out["summary"].append(note[0])
                short[what] = note[1]
                explained.add((scheme, what))
        out["summary"] += _nonfinite_note(scheme, sec) + _outlier_note(scheme, sec)
        _table_notes(doc, scheme, sec, short, out)


def _table_notes(doc: dict, scheme: str, sec: dict, short: Dict[str, str],
                 out: Dict[str, List[str]]) -> None:
    """The one-sentence versions under the tables (and heat maps) showing those numbers."""
    def flagged(metrics: dict, key: str) -> bool:
        return ((metrics.get("quantization") or {}).get(key) or 0) >= ALARM_FRACTION

    for what, line in short.items():
        key = _SHARES[what][1]
        names = [name for name, m in (sec.get("by_tensor") or {}).items() if flagged(m, key)]
        if names:
            out[f"tensors_{scheme}"].append(
                f"{what} >= {pct(ALARM_FRACTION)} ({', '.join(names)}): {line}")
        rows = [r for r in doc.get("format_comparison") or []
                if r.get("quant_type") == scheme and (r.get(key) or 0) >= ALARM_FRACTION]
        if rows:
            out["format_comparison"].append(f"{scheme} {what}: {line}")
        out[f"figure:error_heatmap_{scheme.replace('/', '_')}.png"].append(
            f"{what.capitalize()} cells: {line}")


def _telemetry_format(doc: dict, scheme: str, item: dict) -> Optional[str]:
    """The element format of a telemetry operand, from the scheme's name (None when the
    name is not a scheme's: a recipe label) and the run's MXFP8 gradient format."""
    try:
        linear, attention = scheme_formats(scheme.split("@")[0])
    except SettingError:    # a recipe or recipe-file label: its formats are per site
        return None
    fmt = attention if ".core_attention" in (item.get("site") or "") else linear
    if fmt in ("none", None):
        return None
    if fmt == "fp8":
        return "fp8_e4m3"
    grad = ((doc.get("provenance") or {}).get("fields") or {}).get("mx_grad_format") or {}
    if fmt == "mxfp8" and "grad" in (item.get("operand") or "") and grad.get("value") == "e5m2":
        return "mxfp8_e5m2"
    return canonical_format(fmt)


def _telemetry_notes(doc: dict, out: Dict[str, List[str]], explained: set) -> None:
    for scheme, s in ((doc.get("telemetry") or {}).get("schemes") or {}).items():
        mode = _scale_mode(doc, scheme)
        for what in (SATURATED, FLUSHED):
            item = s.get(f"max_{what}_pct") or {}
            if (item.get("value") or 0) < 100 * ALARM_FRACTION or not item.get("site"):
                continue
            fmt = _telemetry_format(doc, scheme, item)
            where = (f"{scheme}: up to {item['value']:.3g}% of {display_site(item['site'])} "
                     f"{item['operand']} {what} (iteration {item['step']}). ")
            if fmt is None:
                out["telemetry"].append(where + "The scheme's formats are per site (a recipe); "
                                        "see the format table and the Scales table.")
                continue
            # explained in full under the summary already: the one-sentence version here
            short = (scheme, what) in explained
            why = _why(what, fmt, mode, _telemetry_tensor(item.get("operand")), short=short)
            if why:
                out["telemetry"].append(where + why)


def _telemetry_tensor(operand: Optional[str]) -> Optional[str]:
    """The capture's tensor name of a telemetry operand (`wgrad.input` -> `input_wgrad`)."""
    if not operand or "." not in operand:
        return None
    gemm, name = operand.split(".", 1)
    return f"{name}_{gemm}" if gemm in ("wgrad", "dgrad") and name in (
        "input", "grad_output", "weight") else name


def _loss_notes(doc: dict, out: Dict[str, List[str]]) -> None:
    rows = [r for r in (doc.get("losses") or {}).get("table") or []
            if r.get("gap_to_baseline") is not None and not r.get("gap_within_noise")]
    if rows:
        out["summary"].append(
            f"Loss gaps beyond the curves' spread ({', '.join(r['run'] for r in rows)}) are "
            "not yet a format effect: the spread is one run's batch-to-batch wiggle, and "
            "seed-to-seed noise, unknown from one run per scheme, is often larger; "
            "tools/study.py measures it with several seeds.")


def _provenance_notes(doc: dict, out: Dict[str, List[str]]) -> None:
    prov = doc.get("provenance") or {}
    field = (prov.get("fields") or {}).get("train_iters") or {}
    by_value = field.get("by_value") or {}
    if by_value:
        # Sources are "<scheme> capture" / "<scheme> training": the note applies when each
        # value comes from one kind of source only, and each kind has its own value.
        kinds = {v: {s.rsplit(" ", 1)[-1] for s in sources} for v, sources in by_value.items()}
        if all(len(k) == 1 for k in kinds.values()) and \
                len({next(iter(k)) for k in kinds.values()}) == len(kinds):
            out["run"].append("train iterations differ between the capture runs and the "
                              "trainings only: a capture that resumes a trained checkpoint "
                              "for more iterations records its own --train-iters (make demo "
                              "captures iteration 31 of 30-iteration trainings).")
    if prov.get("commit") and "," in prov["commit"]:
        out["run"].append("The runs recorded different commits ('-dirty': with uncommitted "
                          "changes): their numbers may come from different code.")


def explanations(doc: dict) -> Dict[str, List[str]]:
    """{where: [explanation, ...]} for the numbers of `doc` that cross the thresholds."""
    out: Dict[str, List[str]] = defaultdict(list)
    explained: set = set()           # (scheme, saturated / flushed) explained in full above
    _capture_notes(doc, out, explained)
    _loss_notes(doc, out)
    _telemetry_notes(doc, out, explained)
    _provenance_notes(doc, out)
    return {key: value for key, value in out.items() if value}

