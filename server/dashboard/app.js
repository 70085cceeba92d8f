// The dashboard's logic: reads the JSON API with the operator's bearer token every 2 s and renders the fleet,
// the rounds and the charts. Every value from the server (device names and profiles come from devices) is put
// into the page as text, never as HTML. The token lives in this tab's sessionStorage; one passed in the URL
// fragment (#token=...; browsers never send fragments to servers) is moved there and removed from the address.
"use strict";

(() => {
  const POLL_MS = 2000;
  const KEY_TOKEN = "pfl-dashboard-token";
  const KEY_FED = "pfl-dashboard-federation";
  const $ = (id) => document.getElementById(id);
  const S = { token: null, fed: null, timer: null, polls: 0, inflight: false, again: false };

  class ApiError extends Error {
    constructor(status, detail) {
      super(`HTTP ${status}: ${detail}`);
      this.status = status;
    }
  }

  function fromFragment() {
    const h = new URLSearchParams(location.hash.slice(1));
    if (h.get("token")) sessionStorage.setItem(KEY_TOKEN, h.get("token"));
    if (h.get("federation")) sessionStorage.setItem(KEY_FED, h.get("federation"));
    if (location.hash) history.replaceState(null, "", location.pathname + location.search);
    S.token = sessionStorage.getItem(KEY_TOKEN);
    S.fed = sessionStorage.getItem(KEY_FED);
  }

  async function api(path) {
    const r = await fetch(path, {
      headers: { Authorization: `Bearer ${S.token}`, Accept: "application/json" },
      cache: "no-store", credentials: "omit", referrerPolicy: "no-referrer",
    });
    if (!r.ok) {
      let detail = r.statusText;
      try { detail = (await r.json()).detail || detail; } catch (e) { /* not JSON */ }
      throw new ApiError(r.status, String(detail).slice(0, 300));
    }
    return r.json();
  }

  // ------------------------------------------------------------------------------------------- formatting
  const pct = (x) => (x === null || x === undefined ? "–" : `${(100 * x).toFixed(1)} %`);
  const num = (x, d) => (x === null || x === undefined ? "–" : Number(x).toFixed(d));
  function bytes(n) {
    if (n === null || n === undefined) return "–";
    const u = ["B", "kB", "MB", "GB", "TB"];
    let i = 0;
    while (n >= 1000 && i < u.length - 1) { n /= 1000; i++; }
    return `${n.toFixed(i ? 1 : 0)} ${u[i]}`;
  }
  function ago(t) {
    if (t === null || t === undefined) return "never";
    const s = Math.max(0, Date.now() / 1000 - t);
    if (s < 60) return `${s.toFixed(0)} s ago`;
    if (s < 3600) return `${(s / 60).toFixed(0)} min ago`;
    return `${(s / 3600).toFixed(1)} h ago`;
  }
  function until(t) {
    if (t === null || t === undefined) return "–";
    const s = t - Date.now() / 1000;
    return s >= 0 ? `in ${s.toFixed(0)} s` : `${(-s).toFixed(0)} s ago`;
  }
  function duration(s) {
    if (s === null || s === undefined) return "–";
    return s < 120 ? `${s.toFixed(1)} s` : `${(s / 60).toFixed(1)} min`;
  }
  const label = (d) => d.name || `slot ${d.index}`;
  const sparse = (info) => (info.config || {}).algorithm === "dispfl";

  function text(id, value) { $(id).textContent = value; }

  function cell(tr, value, cls) {
    const td = document.createElement("td");
    td.textContent = value;
    if (cls) td.className = cls;
    tr.appendChild(td);
    return td;
  }

  function status(msg, cls) {
    const el = $("status");
    el.textContent = msg;
    el.className = `status ${cls}`;
  }

  function showError(msg) {
    const el = $("error");
    el.hidden = !msg;
    el.textContent = msg || "";
  }

  // -------------------------------------------------------------------------------------------- rendering
  function renderOverview(info, devices, rounds) {
    const cfg = info.config || {};
    text("ov-algorithm", `${cfg.algorithm || "?"} · ${cfg.model || ""} · ${cfg.dataset || ""}`);
    text("ov-round", `${info.round} / ${cfg.rounds ?? "?"}`);
    text("ov-state", info.state);
    const enrolled = devices.filter((d) => !d.revoked);
    text("ov-online", `${enrolled.filter((d) => d.online).length} / ${enrolled.length}`);
    text("ov-quorum", `${(100 * info.quorum).toFixed(0)} %`);
    text("ov-deadline", `${info.deadline_s} s`);
    // differential privacy (docs/privacy.md): the epsilon the published rounds have spent, at the config's delta;
    // the last published round's (null there: no bound, e.g. a distributed round of one update, never an older one)
    const spent = [...rounds].reverse().find((r) => r.round >= 1 && r.closed_at !== undefined && r.closed_at !== null);
    $("ov-privacy-card").hidden = !cfg.privacy;
    if (cfg.privacy) text("ov-privacy", !spent ? "ε 0" : spent.epsilon === undefined || spent.epsilon === null ? "no bound"
      : `ε ${Number(spent.epsilon).toFixed(2)} (δ ${cfg.privacy.delta ?? 1e-5})`);
    const cur = rounds.find((r) => r.round === info.round);
    text("cur-round", String(info.round));
    const badge = $("cur-state");
    badge.textContent = info.state;
    badge.className = `badge ${info.state}`;
    const expected = cur && cur.active !== null ? cur.active : null;
    const got = cur ? cur.updates : 0;
    text("cur-updates", expected === null ? `${got}` : `${got} / ${expected}`);
    $("cur-progress").max = Math.max(1, expected || 1);
    $("cur-progress").value = got;
    text("cur-quorum", cur && cur.quorum_updates !== null ? `closes at ${cur.quorum_updates}` : "");
    text("cur-deadline", cur && cur.deadline && info.state === "collecting" ? until(cur.deadline) : "–");
    text("cur-opened", cur && cur.opened_at ? ago(cur.opened_at) : "–");
    document.body.dataset.round = String(info.round);
    document.body.dataset.state = info.state;
  }

  function latestAccuracy(rounds) {
    const acc = {};
    for (const r of rounds) for (const [id, m] of Object.entries(r.devices)) acc[id] = m.accuracy;
    return acc;
  }

  function renderDevices(info, devices, rounds) {
    const acc = latestAccuracy(rounds);
    const body = $("devices").tBodies[0];
    const rows = devices.map((d) => {
      const tr = document.createElement("tr");
      tr.dataset.deviceId = d.device_id;
      tr.dataset.profile = d.profile;
      const name = cell(tr, "");
      const dot = document.createElement("span");
      dot.className = d.online ? "dot on" : "dot";
      name.append(dot, document.createTextNode(label(d)));
      name.title = d.device_id;
      cell(tr, d.profile);
      // what it says it is, beside the profile it declared; a flag where the two disagree (docs/dashboard.md)
      const p = d.platform;
      const machine = cell(tr, p ? `${p.machine} · ${p.language} · ${p.runtime} · ${p.threads} thr` : "–",
                           d.flags && d.flags.length ? "warn" : "");
      machine.title = d.flags && d.flags.length ? d.flags.join("\n") : (p ? p.os : "it said nothing (an earlier release)");
      if (d.flags && d.flags.length) tr.dataset.flagged = "true";
      cell(tr, String(d.index), "n");
      cell(tr, sparse(info) ? num(d.density, 2) : "dense", "n");
      cell(tr, sparse(info) ? "–" : String(d.kp), "n"); // K_P is FedPer's; DisPFL keeps no blocks apart
      cell(tr, d.revoked ? "revoked" : d.online ? "online" : "offline");
      cell(tr, d.last_round === null ? "–" : String(d.last_round), "n");
      cell(tr, ago(d.last_seen));
      cell(tr, bytes(d.bytes_up), "n");
      cell(tr, bytes(d.bytes_down), "n");
      cell(tr, pct(acc[d.device_id]), "n");
      // uploads the server refused, and neighbours' models the device left out (DisPFL): a misbehaving device
      // shows in the first, its neighbours in the second
      cell(tr, String(d.refused || 0), d.refused ? "n warn" : "n");
      cell(tr, sparse(info) ? String(d.dropped || 0) : "–", d.dropped ? "n warn" : "n");
      return tr;
    });
    body.replaceChildren(...rows);
  }

  // p50 / p95 of one figure of a class (pfl_edge.fleet.Spread); "–" where none reported
  function spread(s, fmt) {
    return s && s.n ? `${fmt(s.p50)} / ${fmt(s.p95)}` : "–";
  }

  function renderClasses(classes) {
    const body = $("classes").tBodies[0];
    const rows = classes.map((c) => {
      const tr = document.createElement("tr");
      tr.dataset.profile = c.profile;
      cell(tr, c.profile);
      cell(tr, String(c.devices), "n");
      cell(tr, String(c.reporting), "n");
      cell(tr, spread(c.step_ms, (v) => num(v, 1)), "n");
      cell(tr, spread(c.round_s, (v) => num(v, 2)), "n");
      cell(tr, spread(c.transfer_s, (v) => num(v, 3)), "n");
      cell(tr, spread(c.peak_rss_mb, (v) => num(v, 0)), "n");
      cell(tr, spread(c.bytes_up, bytes), "n");
      cell(tr, spread(c.bytes_down, bytes), "n");
      return tr;
    });
    body.replaceChildren(...rows);
  }

  function renderRounds(rounds) {
    const body = $("rounds").tBodies[0];
    const rows = rounds.filter((r) => r.round > 0).slice(-15).reverse().map((r) => {
      const tr = document.createElement("tr");
      tr.dataset.round = String(r.round);
      cell(tr, String(r.round), "n");
      const st = cell(tr, "");
      const b = document.createElement("span");
      b.className = `badge ${r.state || ""}`;
      b.textContent = r.state || "–";
      st.appendChild(b);
      cell(tr, r.active === null ? String(r.updates) : `${r.updates} / ${r.active}`, "n");
      cell(tr, r.quorum_updates === null ? "–" : String(r.quorum_updates), "n");
      for (const k of ["mean_accuracy", "min_accuracy", "median_accuracy", "max_accuracy"]) cell(tr, pct(r[k]), "n");
      cell(tr, duration(r.wall_s), "n");
      cell(tr, bytes(r.bytes_up), "n");
      cell(tr, bytes(r.bytes_down), "n");
      return tr;
    });
    body.replaceChildren(...rows);
  }

  function legend(id, items) {
    const el = $(id);
    el.replaceChildren(...items.map(([name, color]) => {
      const span = document.createElement("span");
      const sw = document.createElement("span");
      sw.className = "sw";
      sw.style.background = color;
      span.append(sw, document.createTextNode(name));
      return span;
    }));
  }

  function renderCharts(info, devices, rounds) {
    const P = PflCharts.PALETTE;
    const series = devices.map((d, i) => ({
      name: label(d), color: P[i % P.length],
      points: rounds.filter((r) => r.devices[d.device_id]).map((r) => [r.round, r.devices[d.device_id].accuracy]),
    }));
    const fmtPct = (v) => `${(100 * v).toFixed(0)}%`;
    PflCharts.lines($("chart-acc"), series, { yMin: 0, yMax: 1, fmtY: fmtPct });
    legend("legend-acc", series.map((s) => [s.name, s.color]));
    const spread = rounds.filter((r) => r.min_accuracy !== null).map((r) => ({
      round: r.round, min: r.min_accuracy, median: r.median_accuracy, max: r.max_accuracy, mean: r.mean_accuracy,
    }));
    PflCharts.band($("chart-spread"), spread, { yMin: 0, yMax: 1, fmtY: fmtPct });
    const withBytes = rounds.filter((r) => r.round > 0 && (r.bytes_up || r.bytes_down));
    PflCharts.bars($("chart-bytes"), withBytes.map((r) => r.round), [
      { name: "up", color: P[0], values: withBytes.map((r) => r.bytes_up) },
      { name: "down", color: P[4], values: withBytes.map((r) => r.bytes_down) },
    ], { fmtY: bytes, xLabel: "round" });
    legend("legend-bytes", [["up (device → server)", P[0]], ["down (server → device)", P[4]]]);
    // DisPFL: the fraction of weights each device's sparse mask keeps. Others train dense models, so the panel
    // shows what does differ per device there: K_P, the blocks it keeps personal.
    if (sparse(info)) {
      text("density-title", "Mask density per device");
      text("density-hint", "fraction of weights each device's mask keeps");
      PflCharts.bars($("chart-density"), devices.map(label),
        [{ name: "density", color: P[2], values: devices.map((d) => d.density) }],
        { fmtY: (v) => v.toFixed(2), yMax: 1, xLabel: "device" });
    } else {
      text("density-title", "Personal blocks (K_P) per device");
      text("density-hint", `${(info.config || {}).algorithm} trains dense models: no masks`);
      PflCharts.bars($("chart-density"), devices.map(label),
        [{ name: "K_P", color: P[2], values: devices.map((d) => d.kp) }],
        { fmtY: (v) => String(v), yMax: Math.max(1, ...devices.map((d) => d.kp)), xLabel: "device" });
    }
  }

  // ---------------------------------------------------------------------------------------------- polling
  async function loadFederations() {
    const feds = await api("/v1/federations");
    const sel = $("fed");
    const ids = feds.map((f) => f.id);
    if (!S.fed || !ids.includes(S.fed)) S.fed = ids.length ? ids[ids.length - 1] : null;
    const same = sel.options.length === ids.length && ids.every((id, i) => sel.options[i].value === id);
    if (!same) {
      sel.replaceChildren(...ids.map((id) => {
        const o = document.createElement("option");
        o.value = id;
        return o;
      }));
    }
    feds.forEach((f, i) => {
      sel.options[i].textContent = `${f.id} (${(f.config || {}).algorithm || "?"}, round ${f.round}, ${f.state})`;
    });
    if (S.fed) sel.value = S.fed;
    return S.fed;
  }

  // One read of everything; true if the next one is worth doing (a refused token is not asked again).
  async function once() {
    try {
      const fed = await loadFederations();
      if (fed) {
        const base = `/v1/federations/${encodeURIComponent(fed)}`;
        const [info, metrics, devices, classes] = await Promise.all([api(base), api(`${base}/metrics`),
          api(`${base}/devices`), api(`${base}/classes`)]);
        renderOverview(info, devices, metrics.rounds);
        renderDevices(info, devices, metrics.rounds);
        renderClasses(classes);
        renderRounds(metrics.rounds);
        renderCharts(info, devices, metrics.rounds);
      }
      S.polls += 1;
      document.body.dataset.polls = String(S.polls);
      status(fed ? `live · ${new Date().toLocaleTimeString()}` : "no federation yet", "ok");
      showError("");
      return true;
    } catch (e) {
      const refused = e.status === 401 || e.status === 403;
      status(refused ? "token refused" : "disconnected", "bad");
      showError(refused ? `${e.message} (the dashboard needs the admin token)` : String(e.message || e));
      return !refused;
    }
  }

  // At most one read in flight; a request for another meanwhile (a new token, another federation) runs after it.
  async function poll() {
    if (S.inflight) { S.again = true; return; }
    clearTimeout(S.timer);
    if (!S.token) { status("paste the admin token", "idle"); return; }
    S.inflight = true;
    let more = false;
    try { more = await once(); } finally { S.inflight = false; }
    if (S.again) { S.again = false; poll(); return; }
    if (more && S.token) S.timer = setTimeout(poll, POLL_MS);
  }

  function init() {
    fromFragment();
    $("auth").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const t = $("token").value.trim();
      $("token").value = "";
      if (!t) return;
      sessionStorage.setItem(KEY_TOKEN, t);
      S.token = t;
      poll();
    });
    $("forget").addEventListener("click", () => {
      sessionStorage.removeItem(KEY_TOKEN);
      S.token = null;
      clearTimeout(S.timer);
      status("token forgotten", "idle");
    });
    $("fed").addEventListener("change", (ev) => {
      S.fed = ev.target.value;
      sessionStorage.setItem(KEY_FED, S.fed);
      poll();
    });
    window.addEventListener("resize", () => poll());
    poll();
  }

  document.addEventListener("DOMContentLoaded", init);
})();
