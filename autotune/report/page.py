"""The frame of ``report.html``: its HTML skeleton, stylesheet and error recorder.

``PAGE`` is filled with :meth:`str.format` (title, style, onerror, plotly, heading, subtitle,
nav, sections, data). ``ONERROR`` runs before anything else on the page: every script error
and unhandled promise rejection lands in ``window.autotuneErrors`` and in the visible
``#js-errors`` box, so a broken figure is seen, and a test can read it.
"""

__all__ = ["ONERROR", "PAGE", "STYLE"]

ONERROR = """
window.autotuneErrors = [];
function autotuneRecord(text) {
  window.autotuneErrors.push(text);
  var box = document.getElementById("js-errors");
  if (box) { box.hidden = false; box.textContent = window.autotuneErrors.join("\\n"); }
}
window.onerror = function (message, source, line, column) {
  autotuneRecord(String(message) + " (" + (source || "inline") + ":" + line + ":" + column + ")");
  return false;
};
window.addEventListener("unhandledrejection", function (event) { autotuneRecord("unhandled rejection: " + event.reason); });
document.addEventListener("DOMContentLoaded", function () { if (window.autotuneErrors.length) autotuneRecord("(page loaded)"); });
"""

STYLE = """
:root { --fg: #111827; --muted: #6b7280; --line: #e5e7eb; --bg: #f3f4f6; --card: #fff; --accent: #2563eb; }
* { box-sizing: border-box; }
body { margin: 0; background: var(--bg); color: var(--fg); font: 14px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; }
header { background: #111827; color: #fff; padding: 18px 0 0; }
header h1 { margin: 0; font-size: 22px; font-weight: 600; }
header .sub { color: #9ca3af; font-size: 13px; margin-top: 2px; }
nav { display: flex; flex-wrap: wrap; gap: 2px 16px; margin-top: 12px; padding-bottom: 10px; }
nav a { color: #d1d5db; text-decoration: none; font-size: 13px; }
nav a:hover { color: #fff; }
.wrap { max-width: 1240px; margin: 0 auto; padding: 0 20px; }
main { padding: 18px 0 40px; }
.card { background: var(--card); border: 1px solid var(--line); border-radius: 10px; padding: 16px 20px; margin-bottom: 16px; min-width: 0; }
.card h2 { margin: 0 0 6px; font-size: 17px; }
h3 { font-size: 13px; text-transform: uppercase; letter-spacing: .04em; color: var(--muted); margin: 10px 0 6px; }
.lead { margin: 0 0 10px; color: #374151; }
.note { color: var(--muted); font-size: 13px; margin: 6px 0; }
.warn { color: #9a3412; background: #fff7ed; border: 1px solid #fdba74; border-radius: 6px; padding: 8px 12px; }
.split { display: grid; grid-template-columns: 3fr 2fr; gap: 16px; }
.split.even { grid-template-columns: 1fr 1fr; }
.split > .card { margin-bottom: 16px; }
@media (max-width: 900px) { .split, .split.even { grid-template-columns: 1fr; } }
.tiles { display: grid; grid-template-columns: repeat(4, 1fr); gap: 12px; margin: 6px 0 14px; }
.tile { border: 1px solid var(--line); border-radius: 8px; padding: 10px 14px; }
.tile .label { color: var(--muted); font-size: 12px; text-transform: uppercase; letter-spacing: .04em; }
.tile .value { font-size: 24px; font-weight: 600; }
.tile .sub { color: var(--muted); font-size: 12px; }
.tile.hero { background: #ecfdf5; border-color: #a7f3d0; }
.tile.hero .value { color: #047857; font-size: 30px; }
.scroll { overflow-x: auto; }
table { border-collapse: collapse; width: 100%; font-size: 13px; }
th, td { text-align: left; padding: 5px 8px; border-bottom: 1px solid var(--line); vertical-align: top; }
th { color: var(--muted); font-weight: 600; font-size: 12px; }
table.metrics td:nth-child(n+2), table.metrics th:nth-child(n+2) { text-align: right; font-variant-numeric: tabular-nums; }
table.trials td:nth-child(3), table.trials td:nth-child(4), table.trials td:nth-child(5), table.trials td:nth-child(6) { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
table.kv td { padding: 3px 8px; word-break: break-all; }
.mono, code { font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 12px; }
.reason { color: #4b5563; font-size: 12px; }
.status { display: inline-block; padding: 0 7px; border-radius: 9px; font-size: 12px; font-weight: 600; background: #fee2e2; color: #991b1b; }
.status.ok { background: #dbeafe; color: #1e40af; }
.status.infeasible { background: #fef3c7; color: #92400e; }
.flag { font-size: 11px; color: var(--muted); border: 1px solid var(--line); border-radius: 6px; padding: 0 4px; }
.flag.win { color: #047857; border-color: #a7f3d0; }
.chips { display: flex; flex-wrap: wrap; gap: 6px; }
.chip { background: #eef2ff; color: #3730a3; border-radius: 12px; padding: 2px 10px; font-family: ui-monospace, monospace; font-size: 12px; }
.facts { margin: 0; padding-left: 18px; color: #374151; }
#js-errors { background: #fee2e2; color: #991b1b; padding: 10px 20px; margin: 0; white-space: pre-wrap; }
"""

PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>{style}</style>
<script>{onerror}</script>
<script>{plotly}</script>
</head>
<body data-autotune="{data}">
<pre id="js-errors" hidden></pre>
<header><div class="wrap"><h1>{heading}</h1><div class="sub">{subtitle}</div><nav>{nav}</nav></div></header>
<main class="wrap">
{sections}
</main>
</body>
</html>
"""
