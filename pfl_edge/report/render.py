"""The one-page report: one document (headings, paragraphs, lists, tables, plots) rendered twice, as Markdown
(plots beside it as PNG files) and as a self-contained HTML page (plots inline as base64 PNG, no external
reference of any kind). Every name from the input is escaped: a device chooses its own name."""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .plots import write_plots

__all__ = ["MAX_DEVICE_ROWS", "MAX_ROUND_ROWS", "render_html", "render_markdown", "write_report"]

MAX_ROUND_ROWS = 60  # the rounds table shows the last this many (report.json holds all)
MAX_DEVICE_ROWS = 200

Block = tuple[str, Any]  # ("h1" | "h2" | "p" | "ul" | "table" | "img", content)


def _f(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:.2f}"


def _nums(xs: Sequence[float | int]) -> str:
    return ", ".join(f"{x:g}" for x in xs) or "-"


def _headline(s: Mapping[str, Any]) -> list[str]:
    fin, acc = s["final"], s["final"]["accuracy"]
    short = fin["rounds_short_of_quorum"]
    server = "" if fin["server_bytes_up"] is None else (
        f" (the server counted {_mb(fin['server_bytes_up'])} MB of uploads, {_mb(fin['server_bytes_down'])} MB "
        "of downloads)")
    return [
        f"final round {fin['round'] if fin['round'] is not None else '-'}: mean device accuracy {_f(acc['mean'])} "
        f"(median {_f(acc['median'])}, min {_f(acc['min'])}, max {_f(acc['max'])}; "
        f"{fin['devices_reporting']} devices reporting)",
        f"traffic, all rounds and devices: {_mb(fin['bytes_up'])} MB up, {_mb(fin['bytes_down'])} MB down "
        f"as the devices reported{server}",
        f"{fin['rounds_recorded']} rounds recorded (planned: {s['rounds_planned'] or '-'}); "
        f"round wall time in all {_f(fin['round_wall_s'], 1)} s",
        "rounds closed short of quorum: " + (", ".join(map(str, short[:20])) if short else "none")
        + (f" ... ({len(short)} in all)" if len(short) > 20 else "")
        + ("" if s["quorum"] is not None else " (quorum unknown)"),
        *_privacy_line(s.get("privacy")),
    ]


def _privacy_line(p: Mapping[str, Any] | None) -> list[str]:
    if not p:
        return []
    eps = "unbounded (no noise)" if p["epsilon"] is None else _f(p["epsilon"], 2)
    return [f"differential privacy ({p['mode']}): epsilon {eps} at delta {p['delta']:g} after {p['rounds']} rounds "
            f"(noise multiplier {_f(p['noise_multiplier'], 3)}, clip {p['clip']:g}; Opacus's RDP accountant)"]


def _profiles_table(s: Mapping[str, Any]) -> Block:
    head = ["device class", "count", "density", "K_P", "final accuracy (mean)", "step ms (mean)", "MB up",
            "MB down"]
    rows = [[p["profile"], str(p["count"]), _nums(p["densities"]), _nums(p["kps"]), _f(p["final_accuracy_mean"]),
             _f(p["step_ms"], 1), _mb(p["bytes_up"]), _mb(p["bytes_down"])] for p in s["profiles"]]
    return ("table", (head, rows))


def _rounds_table(s: Mapping[str, Any]) -> list[Block]:
    head = ["round", "state", "updates / given a task", "reporting", "mean acc", "min", "median", "max", "MB up",
            "MB down", "wall s", "short of quorum"]
    rows = []
    for r in s["rounds"][-MAX_ROUND_ROWS:]:
        a = r["accuracy"]
        short = {True: "YES", False: "no", None: "-"}[r["short_of_quorum"]]
        rows.append([str(r["round"]), r["state"] or "-", f"{_n(r['updates'])} / {_n(r['active'])}",
                     str(r["reporting"]), _f(a["mean"]), _f(a["min"]), _f(a["median"]), _f(a["max"]),
                     _mb(r["bytes_up"]), _mb(r["bytes_down"]), _f(r["wall_s"], 1), short])
    out: list[Block] = []
    if len(s["rounds"]) > MAX_ROUND_ROWS:
        out.append(("p", f"The last {MAX_ROUND_ROWS} of {len(s['rounds'])} rounds; report.json holds all."))
    return [*out, ("table", (head, rows))]


def _devices_table(s: Mapping[str, Any]) -> list[Block]:
    head = ["device", "class", "density", "K_P", "final round", "final accuracy", "step ms", "MB up", "MB down"]
    rows = [[d["name"], d["profile"], _f(d["density"], 2), _n(d["kp"]), _n(d["final_round"]),
             _f(d["final_accuracy"]), _f(d["step_ms"], 1), _mb(d["bytes_up"]), _mb(d["bytes_down"])]
            for d in s["devices"][:MAX_DEVICE_ROWS]]
    out: list[Block] = [("table", (head, rows))]
    if len(s["devices"]) > MAX_DEVICE_ROWS:
        out.append(("p", f"The first {MAX_DEVICE_ROWS} of {len(s['devices'])} devices; report.json holds all."))
    return out


def _n(x: int | None) -> str:
    return "-" if x is None else str(x)


def document(s: Mapping[str, Any]) -> list[Block]:
    cfg = s["config"]
    setup = ", ".join(f"{k} {cfg[k]}" for k in ("dataset", "partition", "model") if isinstance(cfg.get(k), str))
    return [
        ("h1", f"pfl-edge report: {s['name']}"),
        ("p", f"{s['source']} run; algorithm {s['algorithm'] or '-'}; {s['devices_count']} devices; state "
              f"{s['state'] or '-'}; quorum {_f(s['quorum'], 2)}" + (f"; {setup}" if setup else "")),
        ("ul", _headline(s)),
        ("img", ("accuracy", "Accuracy per device over rounds: each device's line, the min-max band, the median "
                             "(dashed) and the mean (black)")),
        ("h2", "Device classes"), _profiles_table(s),
        ("img", ("profiles", "Mean final accuracy per device class (device count in brackets)")),
        ("h2", "Rounds"), *_rounds_table(s),
        ("img", ("traffic", "Bytes per round, all devices: up (updates sent) and down (models fetched)")),
        ("img", ("rounds", "Round wall time (bars; red: closed short of quorum) and updates per round")),
        ("h2", "Devices"), *_devices_table(s),
        ("p", "Accuracy: each device's deployed model on its own test data, as the device reported it. MB: 10^6 "
              "bytes. Step ms: the device's mean training step. report.json holds every number."),
    ]


def _md_cell(text: str) -> str:
    # a cell is one line; | would end it early, and markup in a device's name must show as text
    out = " ".join(text.split())
    for ch in "\\`*_[]<>|#":
        out = out.replace(ch, "\\" + ch)
    return out


def render_markdown(s: Mapping[str, Any], images: Mapping[str, str]) -> str:
    """Markdown; ``images``: plot name -> the PNG's path relative to the Markdown file."""
    lines: list[str] = []
    for kind, c in document(s):
        if kind in ("h1", "h2"):
            lines += [f"{'#' if kind == 'h1' else '##'} {_md_cell(c)}", ""]
        elif kind == "p":
            lines += [_md_cell(c), ""]
        elif kind == "ul":
            lines += [f"- {_md_cell(x)}" for x in c] + [""]
        elif kind == "img" and c[0] in images:
            lines += [f"![{_md_cell(c[1])}]({images[c[0]]})", ""]
        elif kind == "table":
            head, rows = c
            lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            lines += ["| " + " | ".join(_md_cell(x) for x in row) + " |" for row in rows] + [""]
    return "\n".join(lines)


_CSS = ("body{font-family:sans-serif;max-width:1100px;margin:1em auto;padding:0 1em;color:#222}"
        "table{border-collapse:collapse;font-size:13px;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 6px;"
        "text-align:right}td:first-child,th:first-child{text-align:left}figure{margin:1em 0}"
        "figcaption{font-size:12px;color:#555}")


def render_html(s: Mapping[str, Any], images: Mapping[str, bytes]) -> str:
    """One HTML page holding everything: ``images`` (plot name -> PNG bytes) go inline as base64."""
    e = html.escape
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{e(str(s['name']))}</title>"
             f"<style>{_CSS}</style></head><body>"]
    for kind, c in document(s):
        if kind in ("h1", "h2", "p"):
            parts.append(f"<{kind}>{e(c)}</{kind}>")
        elif kind == "ul":
            parts.append("<ul>" + "".join(f"<li>{e(x)}</li>" for x in c) + "</ul>")
        elif kind == "img" and c[0] in images:
            data = base64.b64encode(images[c[0]]).decode("ascii")
            parts.append(f"<figure><img alt='{e(c[0])}' src='data:image/png;base64,{data}'>"
                         f"<figcaption>{e(c[1])}</figcaption></figure>")
        elif kind == "table":
            head, rows = c
            parts.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>"
                         + "".join("<tr>" + "".join(f"<td>{e(x)}</td>" for x in row) + "</tr>" for row in rows)
                         + "</table>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(summary: Mapping[str, Any], out: Path) -> dict[str, Path]:
    """``report.json``, ``report.md``, ``report.html`` and the plots' PNGs into ``out``; returns name -> path."""
    out.mkdir(parents=True, exist_ok=True)
    plots = write_plots(summary, out)
    paths = {"json": out / "report.json", "markdown": out / "report.md", "html": out / "report.html"}
    paths["json"].write_text(json.dumps(summary, indent=1))
    paths["markdown"].write_text(render_markdown(summary, {k: p.name for k, p in plots.items()}))
    paths["html"].write_text(render_html(summary, {k: p.read_bytes() for k, p in plots.items()}))
    return {**paths, **plots}
