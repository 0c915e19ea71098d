"""Where the analysed numbers come from: model, schemes, captured iterations and key flags.

Sources are the captures' run files (`run-*.json`: the capture run's arguments) and the
argument block printed at the top of each training log given as a loss source. A value every
source agrees on is shown once; otherwise each distinct value is listed with the sources that
have it, so a report never hides that two runs were trained differently.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

from megatron.analysis.intlists import format_int_list

# Keys under which a run may record the code version it ran (git describe).
COMMIT_KEYS = ("git_describe", "git_commit", "commit")
NOT_RECORDED = "not recorded by the runs"


def _text(value) -> Optional[str]:
    """Values from run files (JSON) and logs (text) in one spelling: an empty list or tuple
    (`[]` in a run file, `()` in a log's argument block) is no value, and a sequence reads
    the same from both."""
    if value is None or value == "None":
        return None
    if isinstance(value, (list, tuple)):
        value = "[" + ", ".join(str(v) for v in value) + "]"
    text = str(value)
    if text.startswith("(") and text.endswith(")"):
        text = "[" + text[1:-1].rstrip(",") + "]"
    return None if text in ("[]", "") else text


def _model(args) -> Optional[str]:
    layers, hidden = _text(args.get("num_layers")), _text(args.get("hidden_size"))
    if layers is None and hidden is None:
        return None
    preset = _text(args.get("model_preset")) or "custom shape"
    return f"{preset}, {layers} layer{'' if layers == '1' else 's'}, hidden {hidden}"


def _precision(args) -> Optional[str]:
    if "bf16" not in args and "fp16" not in args:
        return None
    for name in ("bf16", "fp16"):
        if _text(args.get(name)) == "True":
            return name
    return "fp32"


def _batch(args) -> Optional[str]:
    gbs, mbs = _text(args.get("global_batch_size")), _text(args.get("micro_batch_size"))
    return None if gbs is None and mbs is None else f"global {gbs}, micro {mbs}"


# Flags that change which GEMMs are quantized, or how, beyond the scheme: (key, default).
_OVERRIDES = (("quant_fprop", None), ("quant_dgrad", None), ("quant_wgrad", None),
              ("quant_backward", "True"), ("hifp8_scaling", "none"),
              ("quant_skip_layers", None), ("linear_quant", None), ("attn_qk_quant", None),
              ("attn_pv_quant", None), ("quant_output_layer", "False"))


def _overrides(args) -> Optional[str]:
    """The non-default override flags as typed ('none' when the run recorded them all at
    their defaults; None for runs that predate them)."""
    if not any(key in args for key, _ in _OVERRIDES):
        return None
    parts = []
    for key, default in _OVERRIDES:
        value = _text(args.get(key))
        if value is None or value == default:
            continue
        flag = "--" + key.replace("_", "-")
        if value in ("True", "False"):
            parts.append(flag if value == "True" else flag.replace("--", "--no-", 1))
        else:
            parts.append(f"{flag} {value}")
    return " ".join(parts) or "none"


def _plain(key: str) -> Callable[[dict], Optional[str]]:
    return lambda args: _text(args.get(key))


FIELDS: Tuple[Tuple[str, str, Callable[[dict], Optional[str]]], ...] = (
    ("model", "model", _model),
    ("scale_mode", "MX scale mode", _plain("mx_scale_mode")),
    ("mx_grad_format", "MXFP8 gradient format", _plain("mx_grad_format")),
    ("overrides", "scheme overrides", _overrides),
    ("lr", "learning rate", _plain("lr")),
    ("batch", "batch size", _batch),
    ("seq_length", "sequence length", _plain("seq_length")),
    ("precision", "precision", _precision),
    ("train_iters", "train iterations", _plain("train_iters")),
    ("seed", "seed", _plain("seed")),
)


def _commit(doc: dict, args: dict) -> Optional[str]:
    for where in (doc, args):
        for key in COMMIT_KEYS:
            if _text(where.get(key)):
                return _text(where.get(key))
    return None


def _sources(captures, curves) -> List[Tuple[str, dict, dict]]:
    """(label, document, its arguments) per capture run file and per training log."""
    out = []
    for capture in captures:
        for run in capture.runs:
            args = run.get("args") if isinstance(run.get("args"), dict) else {}
            out.append((f"{capture.quant_scheme} capture", run, args))
    for curve in curves:
        if curve.args:
            out.append((f"{curve.name} training", {}, curve.args))
    return out


def _field(label: str, values: Dict[str, Optional[str]]) -> Optional[dict]:
    present = {source: v for source, v in values.items() if v is not None}
    if not present:
        return None
    distinct = sorted(set(present.values()))
    if len(distinct) == 1:
        return {"label": label, "value": distinct[0], "by_value": None}
    return {"label": label, "value": None,
            "by_value": {v: sorted(s for s, x in present.items() if x == v) for v in distinct}}


def build(captures, curves, schemes: Sequence[str], iterations: Dict[str, List[int]],
          telemetry_schemes: Sequence[str] = ()) -> dict:
    """statistics.json `provenance`."""
    sources = _sources(captures, curves)
    fields = {}
    for key, label, extract in FIELDS:
        item = _field(label, {name: extract(args) for name, _, args in sources})
        if item is not None:
            fields[key] = item
    commits = {_commit(doc, args) for _, doc, args in sources} - {None}
    all_schemes = sorted(set(schemes) | {c.name for c in curves} | set(telemetry_schemes))
    return {
        "schemes": all_schemes,
        "sources": [name for name, _, _ in sources],
        "fields": fields,
        "captured_iterations": {s: format_int_list(its) for s, its in iterations.items()},
        "commit": ", ".join(sorted(commits)) if commits else None,
    }


def lines(provenance: Optional[dict]) -> List[Tuple[str, str]]:
    """(label, text) rows for the text and HTML reports."""
    if not provenance:
        return []
    rows = [("schemes", ", ".join(provenance["schemes"]) or "-")]
    captured = provenance.get("captured_iterations") or {}
    if captured:
        distinct = set(captured.values())
        rows.append(("captured iterations", f"{distinct.pop()} (every scheme)"
                     if len(distinct) == 1 else
                     "; ".join(f"{s}: {its}" for s, its in sorted(captured.items()))))
    for item in (provenance.get("fields") or {}).values():
        if item["value"] is not None:
            rows.append((item["label"], item["value"]))
        else:
            rows.append((item["label"], "differs: " + "; ".join(
                f"{value} ({', '.join(names)})" for value, names in item["by_value"].items())))
    rows.append(("commit", provenance.get("commit") or NOT_RECORDED))
    return rows
