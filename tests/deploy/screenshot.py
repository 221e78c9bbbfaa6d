"""The dashboard picture in docs/deploy.md: every Grafana panel drawn by Prometheus itself.

Grafana cannot be installed here (no Debian package, no registry), so the panels are
shown as Prometheus graphs: this writes a Prometheus console template (Prometheus's own
dashboard format, drawn with the classic UI's graph library) with one graph per panel of
deploy/grafana/kvgate.json, the same PromQL and legends, into the live stack of
tests/deploy/live.py after its load, and takes a headless Chromium screenshot of it.

    .venv/bin/python -m tests.deploy.screenshot --out docs/dashboard.png

Needs Debian's prometheus and chromium.
"""

from __future__ import annotations

import argparse
import asyncio
import html
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp

from tests.deploy.live import RATE_INTERVAL, Stack, run
from tests.deploy.panels import DASHBOARD

WIDTH = 1400
GRAPH_W, GRAPH_H = 560, 130

_HEAD = r"""<!doctype html><html><head>
<link rel="stylesheet" href="/classic/static/rickshaw/rickshaw.min.css">
<link rel="stylesheet" href="/classic/static/bootstrap4/css/bootstrap.min.css">
<link rel="stylesheet" href="/classic/static/css/prom_console.css">
<script src="/classic/static/d3/d3.min.js"></script>
<script src="/classic/static/vendor/rickshaw/vendor/d3.layout.min.js"></script>
<script src="/classic/static/rickshaw/rickshaw.min.js"></script>
<script src="/classic/static/jquery/jquery.min.js"></script>
<script>var PATH_PREFIX = "";</script>
<script src="/classic/static/js/prom_console.js"></script>
<script>
// Grafana's legendFormat, with [[label]] for its double-brace label (this page is a Go
// template, where double braces are actions).
function legend(f) {
  return function (m) {
    return f.replace(/\[\[\s*(\w+)\s*\]\]/g, function (_, k) { return m[k] || ""; });
  };
}
</script>
<style>
body { margin: 8px; font-size: 11px; }
h3 { font-size: 18px; margin: 4px 0 2px 0; }
h4 { font-size: 13px; margin: 6px 0 0 0; font-weight: 600; }
.row-title { width: 100%; font-size: 14px; font-weight: 700; border-bottom: 1px solid #999;
  margin-top: 6px; }
.grid { display: flex; flex-wrap: wrap; }
.cell { width: 50%; padding-right: 12px; }
.prom_graph_link, .prom_graph_xtitle { display: none; }
.rickshaw_legend { font-size: 10px; padding: 1px 4px; }
.rickshaw_legend .line { display: inline-block; margin-right: 8px; }
</style></head><body>
"""


def _legend(fmt: str) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", r"[[\1]]", fmt)


def console_page(duration_s: int) -> str:
    dash = json.loads(DASHBOARD.read_text())
    parts = [
        _HEAD,
        f"<h3>{html.escape(dash['title'])}: the Grafana dashboard's panels, ",
        "drawn by Prometheus from a live run</h3>",
    ]
    n = 0
    open_grid = False
    for panel in dash["panels"]:
        if panel["type"] == "row":
            if open_grid:
                parts.append("</div>")
            parts.append(f'<div class="row-title">{html.escape(panel["title"])}</div>')
            parts.append('<div class="grid">')
            open_grid = True
            continue
        exprs = [t["expr"].replace("$__rate_interval", RATE_INTERVAL) for t in panel["targets"]]
        names = [
            f"legend({json.dumps(_legend(t.get('legendFormat', '')))})" for t in panel["targets"]
        ]
        unit = panel["fieldConfig"]["defaults"].get("unit", "")
        fmt = "PromConsole.NumberFormatter.humanizeNoSmallPrefix"
        parts.append(f'<div class="cell"><h4>{html.escape(panel["title"])}</h4>')
        parts.append(f'<div id="g{n}"></div><script>new PromConsole.Graph({{')
        parts.append(f'node: document.querySelector("#g{n}"), expr: {json.dumps(exprs)},')
        parts.append(f"name: [{', '.join(names)}], duration: {duration_s}, width: {GRAPH_W},")
        parts.append(f"height: {GRAPH_H}, yUnits: {json.dumps(unit if unit != 'short' else '')},")
        parts.append(f"yAxisFormatter: {fmt}, yHoverFormatter: {fmt}}});</script></div>")
        n += 1
    if open_grid:
        parts.append("</div>")
    parts.append("</body></html>\n")
    return "".join(parts)


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if exe := shutil.which(name):
            return exe
    raise RuntimeError("chromium not found: apt-get install chromium")


def screenshot(url: str, out: Path, height: int) -> None:
    with tempfile.TemporaryDirectory(prefix="kvgate-chromium-") as profile:
        argv = [
            chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            f"--window-size={WIDTH},{height}",
            "--virtual-time-budget=15000",
            f"--screenshot={out}",
            url,
        ]
        subprocess.run(argv, check=True, capture_output=True, timeout=120)


def shrink(png: Path) -> None:
    """Quantise to a small palette: a chart needs few colours, the docs a small file."""
    from PIL import Image

    with Image.open(png) as im:
        small = im.convert("RGB").quantize(colors=64, method=Image.Quantize.MEDIANCUT)
    small.save(png, optimize=True)


async def capture(out: Path, load_s: float, height: int) -> dict:
    async def shoot(st: Stack) -> None:
        assert st.consoles is not None
        (st.consoles / "kvgate.html").write_text(console_page(int(load_s + 15)))
        async with aiohttp.ClientSession() as s:
            async with s.get(st.prometheus + "/consoles/kvgate.html") as r:
                if r.status != 200:  # a template error: no picture of an error message
                    raise RuntimeError(f"console page: {r.status} {await r.text()}")
        await asyncio.to_thread(screenshot, st.prometheus + "/consoles/kvgate.html", out, height)

    return await run(load_s, after=shoot)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("docs/dashboard.png"))
    ap.add_argument("--load", type=float, default=40.0)
    ap.add_argument("--height", type=int, default=1990)
    args = ap.parse_args()
    summary = asyncio.run(capture(args.out.resolve(), args.load, args.height))
    shrink(args.out)
    print("load:", summary["load"])
    print(f"{args.out}: {args.out.stat().st_size // 1024} KB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
