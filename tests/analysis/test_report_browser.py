"""report.html in a real browser: headless Chromium renders a report built from a synthetic
capture, takes a screenshot (a real PNG of the window's size with something drawn on it) and
dumps the rendered DOM (the summary table with one row per scheme, under its headers), and
measures the first screen in a 1400 px window: the summary, the per-layer picture and what the
alarming numbers mean fit it, and the page never scrolls sideways.

Chromium is not part of the Python environment: .ci/run installs it (Debian's `chromium`).
Without it the test is skipped on a developer machine, and fails under CI (environment
variable CI set), where a skip would hide that the report was never rendered."""

import json
import os
import re
import shutil
import struct
import subprocess
import tempfile
from html.parser import HTMLParser

import numpy as np
import pytest

from megatron.analysis import synthetic
from megatron.analysis.cli import main
from megatron.analysis.statistics import load_json

SCHEMES = ("bf16", "FA_linear_mxfp8", "linear_mxfp4")
WINDOW = (1280, 2000)
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync")
HEADERS = ["quant type", "worst site (lowest SQNR)", "saturated", "flushed to zero",
           "median SQNR dB", "worst SQNR dB", "loss gap to bf16"]


def _chromium() -> str:
    found = "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) \
        else shutil.which("chromium")
    if found:
        return found
    message = ("chromium is not installed (/usr/bin/chromium): .ci/run installs it with "
               "'apt-get install -y chromium'")
    if os.environ.get("CI"):
        pytest.fail(f"{message}; under CI the browser test must run, not be skipped")
    pytest.skip(message)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("browser")
    synthetic.write_capture(str(root / "tensors"), SCHEMES, layers=4, seq=8, batch=1,
                            hidden=32, ffn=32, modules=("linear_fc1", "linear_proj"))
    log = root / "bf16.log"
    log.write_text("".join(f" [2026-11-22 05:19:44] iteration {it:8d}/      10 | lm loss: "
                           f"{7 - it / 10:.6E} |\n" for it in range(1, 11)))
    out = root / "out"
    assert main(["--tensor-dir", str(root / "tensors"), "--loss-logs", f"bf16={log}",
                 "--output-dir", str(out), "--workers", "1", "--no-progress",
                 "--log-level", "ERROR"]) == 0
    return out


def _browse(*args) -> subprocess.CompletedProcess:
    """One headless Chromium run with a profile of its own (removed afterwards)."""
    browser = _chromium()
    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    try:
        return subprocess.run([browser, *FLAGS, f"--user-data-dir={profile}", *args],
                              capture_output=True, text=True, timeout=90, check=True)
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def test_screenshot_is_a_png_of_the_window_with_the_report_drawn(report, tmp_path):
    from PIL import Image

    shot = tmp_path / "report.png"
    _browse(f"--screenshot={shot}", f"--window-size={WINDOW[0]},{WINDOW[1]}",
            (report / "report.html").as_uri())
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert struct.unpack(">II", data[16:24]) == WINDOW
    pixels = np.asarray(Image.open(shot).convert("RGB"), dtype=np.int16)
    assert pixels.shape == (WINDOW[1], WINDOW[0], 3)
    ink = (pixels < 200).any(axis=2)                  # anything clearly darker than the page
    assert ink.mean() > 0.01, "the screenshot is blank"
    assert ink[:200].mean() > 0.005, "no heading at the top of the page"
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50   # text, tables, figures


class _Tables(HTMLParser):
    """The text of every <th>/<td> of <table id='summary'>, row by row."""

    def __init__(self):
        super().__init__()
        self.rows, self.depth, self.cell = [], 0, None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.depth += 1 if self.depth or dict(attrs).get("id") == "summary" else 0
        elif self.depth and tag == "tr":
            self.rows.append([])
        elif self.depth and tag in ("th", "td"):
            self.cell = ""

    def handle_endtag(self, tag):
        if tag == "table" and self.depth:
            self.depth -= 1
        elif self.depth and tag in ("th", "td") and self.cell is not None:
            self.rows[-1].append(self.cell.strip())
            self.cell = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell += data


def test_rendered_dom_holds_the_summary_table(report):
    dom = _browse("--dump-dom", (report / "report.html").as_uri()).stdout
    assert dom.count("id=\"summary\"") == 1
    parser = _Tables()
    parser.feed(dom)
    header, *rows = parser.rows
    assert header == HEADERS
    assert sorted(row[0] for row in rows) == sorted(SCHEMES)
    assert all(len(row) == len(HEADERS) for row in rows)
    doc = load_json(str(report / "statistics.json"))
    assert [row[0] for row in rows] == [row[0] for row in doc["summary"]["rows"]]
    bf16 = next(row for row in rows if row[0] == "bf16")
    assert bf16[1:] == ["\u2014"] * 5 + ["baseline"]


# A window of the size the report is designed for: a 1400 px wide laptop screen.
SCREEN = (1400, 1000)
_MEASURE = """<script>
window.addEventListener('load', function () {
  function box(el) { if (!el) return null; var r = el.getBoundingClientRect();
    return {top: r.top, bottom: r.bottom, left: r.left, right: r.right}; }
  var out = {inner: [window.innerWidth, window.innerHeight],
             scroll: [document.documentElement.scrollWidth, document.documentElement.scrollHeight],
             glance: box(document.getElementById('glance')),
             summary: box(document.getElementById('summary')),
             picture: box(document.querySelector('#glance figure img')),
             explain: box(document.querySelector('#glance ul.explain'))};
  var pre = document.createElement('pre'); pre.id = 'layout';
  pre.textContent = JSON.stringify(out); document.body.appendChild(pre);
});
</script>"""


def _layout(report, tmp_path) -> dict:
    """Boxes of the first screen's parts as Chromium lays them out in a SCREEN window."""
    page = tmp_path / "measured.html"
    page.write_text((report / "report.html").read_text().replace("</body>",
                                                                 _MEASURE + "</body>"))
    dom = _browse(f"--window-size={SCREEN[0]},{SCREEN[1]}", "--virtual-time-budget=10000",
                  "--dump-dom", page.as_uri()).stdout
    found = re.search(r'<pre id="layout">([^<]*)</pre>', dom)
    assert found, "the measuring script did not run"
    return json.loads(found.group(1))


def test_first_screen_holds_the_summary_and_the_per_layer_picture(report, tmp_path):
    """The report opens with one screen that answers "where does this format hurt": the
    summary table, the per-layer picture and the explanations of its alarming numbers, all
    within a 1400 px window, and nothing on the page is wider than the window."""
    box = _layout(report, tmp_path)
    width, height = box["inner"]
    assert width == SCREEN[0]
    assert box["scroll"][0] <= width, "the page scrolls sideways"
    for part in ("glance", "summary", "picture", "explain"):
        assert box[part] is not None, part
        assert box[part]["top"] >= 0 and box[part]["bottom"] <= height, (part, box[part], height)
        assert box[part]["right"] <= width, (part, box[part])
    assert box["summary"]["bottom"] <= box["picture"]["top"]
    # The picture is a real one: wider than a thumbnail, a few hundred pixels high.
    assert box["picture"]["right"] - box["picture"]["left"] >= 500
    assert 150 <= box["picture"]["bottom"] - box["picture"]["top"] <= 450
    # Everything else (the problems, the run, the tables, the figures) comes after it.
    assert box["scroll"][1] > height


def test_screenshot_of_the_first_screen_shows_the_per_layer_picture(report, tmp_path):
    from PIL import Image

    shot = tmp_path / "first-screen.png"
    _browse(f"--screenshot={shot}", f"--window-size={SCREEN[0]},{SCREEN[1]}",
            "--hide-scrollbars", (report / "report.html").as_uri())
    keep = os.environ.get("REPORT_SCREENSHOT_DIR")
    if keep:
        shutil.copy(shot, os.path.join(keep, "report-first-screen.png"))
    pixels = np.asarray(Image.open(shot).convert("RGB"), dtype=np.int16)
    assert pixels.shape == (SCREEN[1], SCREEN[0], 3)
    # viridis cells: saturated colours (far from grey), which tables and text never have
    spread = pixels.max(axis=2) - pixels.min(axis=2)
    assert (spread > 80).mean() > 0.02, "no per-layer heat map in the first screen"


def test_the_picture_names_the_layers_and_the_worst_operands(report):
    doc = load_json(str(report / "statistics.json"))
    (picture,) = [f for f in doc["figures"] if f.get("glance")]
    assert picture["file"] == "layer_overview.png"
    assert "worst quantized operand" in picture["caption"]
    layers = doc["quant_types"]["linear_mxfp4"]["quantized_layers"]
    assert [row["label"] for row in layers] == ["L1", "L2", "L3", "L4"]
    assert all(row["worst"]["sqnr_db"] <= row["sqnr_db"] for row in layers)
    html = (report / "report.html").read_text()
    assert html.index("id='summary'") < html.index("id='layer_overview'") \
        < html.index("id='run'")
