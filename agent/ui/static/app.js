// infernet ui: polls the agent through this page's server (agent/ui/__init__.py), read only.
"use strict";
const token = new URLSearchParams(location.search).get("token") || "";
let selected = new URLSearchParams(location.search).get("job") || null;
let valPlot = null, trainPlot = null, lastChart = "";

async function api(path) {
  const response = await fetch(path, { headers: { "X-Infernet-Token": token }, cache: "no-store" });
  const body = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error(body.error || `${path}: HTTP ${response.status}`);
  return body;
}

function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text === null || text === undefined ? "–" : String(text);
  if (cls) td.className = cls;
  row.appendChild(td);
  return td;
}

function fill(table, items, render) {
  const body = document.querySelector(`#${table} tbody`);
  body.replaceChildren();
  for (const item of items) {
    const row = document.createElement("tr");
    render(row, item);
    body.appendChild(row);
  }
}

const short = (id) => (id ? `…${id.slice(-8)}` : "–");
const num = (x, digits = 3) => (x === null || x === undefined ? "–" : Number(x).toFixed(digits));

function renderPeers(peers) {
  document.getElementById("peer-count").textContent = `(${peers.filter((p) => p.live).length} live)`;
  fill("peers", peers, (row, p) => {
    row.dataset.peer = p.peer_id;
    cell(row, short(p.peer_id)).title = p.peer_id;
    cell(row, p.live ? "yes" : "no");
    cell(row, p.gpus && p.gpus.length ? p.gpus.map((g) => g.name).join(", ") : (p.device || "–"));
    cell(row, p.gpus && p.gpus.length ? p.gpus.map((g) => `${num(g.vram_free_gb, 0)} / ${num(g.vram_total_gb, 0)}`).join(", ") : "–");
    cell(row, (p.models || []).map((m) => m.name).join(", "));
    cell(row, p.price_per_hour);
    cell(row, p.busy ? "busy" : "idle");
  });
}

function renderJobs(jobs) {
  if (!selected && jobs.length) selected = jobs[0].id;
  fill("jobs", jobs, (row, j) => {
    row.dataset.job = j.id;
    if (j.id === selected) row.className = "selected";
    row.addEventListener("click", () => { selected = j.id; refresh(); });
    cell(row, j.id.slice(0, 12));
    cell(row, j.name);
    cell(row, j.role);
    cell(row, j.state, j.state);
    cell(row, `${j.round} / ${j.rounds}`);
    cell(row, j.accepted);
  });
}

function chart(holder, existing, data, series, xLabel) {
  if (existing) existing.destroy();
  holder.replaceChildren();
  const whole = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000];  // rounds and steps are integers
  const opts = { width: 460, height: 240, scales: { x: { time: false } }, series: [{ label: xLabel }, ...series],
                 axes: [{ incrs: whole, label: xLabel }, {}] };
  return new uPlot(opts, data, holder);
}

function renderJob(job) {
  document.getElementById("job").hidden = false;
  document.getElementById("job-name").textContent = job.name;
  document.getElementById("job-id").textContent = job.id.slice(0, 16);
  const facts = document.getElementById("job-facts");
  const kind = [job.type === "dpo" ? "DPO" : "", job.method === "full" ? "full fine-tuning" : ""].filter(Boolean).join(", ");
  facts.textContent = (kind ? `${kind}; ` : "") + `state ${job.state}, round ${job.round} of ${job.rounds}, coordinator ${short(job.coordinator)} ` +
    `(term ${job.term}), verdicts ${job.verdicts.accepted} accepted / ${job.verdicts.rejected} rejected` +
    (job.reason ? ` — ${job.reason}` : "");
  facts.className = job.state;
  fill("shards", job.shard_states, (row, s) => {
    cell(row, s.index); cell(row, s.state, s.state); cell(row, s.attempt); cell(row, short(s.worker)).title = s.worker || "";
    cell(row, s.step); cell(row, num(s.loss)); cell(row, s.verdict ? (s.verdict.accepted ? "accepted" : `rejected: ${s.verdict.reason}`) : "–");
  });
  fill("aggregates", job.aggregates, (row, a) => {
    cell(row, a.round); cell(row, a.cid.slice(0, 16) + "…").title = a.cid; cell(row, a.method);
    cell(row, a.shards.join(", ")); cell(row, num(a.validation_loss)); cell(row, num(a.base_validation_loss));
    cell(row, num(a.reward_accuracy, 2));  // a DPO job's; "–" for SFT
  });
  // charts, redrawn only when their data changed
  const rounds = job.aggregates.map((a) => a.round);
  const key = JSON.stringify([job.id, job.aggregates, job.curves]);
  if (key === lastChart) return;
  lastChart = key;
  const val = document.getElementById("val-chart");
  val.dataset.points = String(job.aggregates.filter((a) => a.validation_loss !== null).length);
  valPlot = chart(val, valPlot, [rounds, job.aggregates.map((a) => a.validation_loss), job.aggregates.map((a) => a.base_validation_loss)],
                  [{ label: "aggregate", stroke: "#2f6fde", points: { show: true } },
                   { label: "base", stroke: "#999", dash: [4, 4], points: { show: true } }], "round");
  // training curves: one series per shard and worker, steps counted on across rounds
  const curves = {}, offsets = {};
  for (const c of [...(job.curves || [])].sort((a, b) => a.round - b.round || a.shard - b.shard || a.attempt - b.attempt)) {
    const name = `shard ${c.shard} ${short(c.worker)}`;
    const offset = offsets[c.shard] || 0;
    (curves[name] = curves[name] || []).push(...c.points.map(([step, loss]) => [offset + step, loss]));
    if (c.accepted) offsets[c.shard] = offset + Math.max(0, ...c.points.map(([step]) => step));
  }
  const names = Object.keys(curves).sort();
  const xs = [...new Set(names.flatMap((n) => curves[n].map(([x]) => x)))].sort((a, b) => a - b);
  const data = [xs, ...names.map((n) => { const m = new Map(curves[n]); return xs.map((x) => (m.has(x) ? m.get(x) : null)); })];
  const train = document.getElementById("train-chart");
  train.dataset.series = String(names.length);
  const palette = ["#2f6fde", "#d9480f", "#2b8a3e", "#862e9c", "#e67700", "#0b7285"];
  trainPlot = chart(train, trainPlot, data, names.map((n, i) => ({ label: n, stroke: palette[i % palette.length], spanGaps: true,
                                                                    points: { show: true } })), "step");
}

// the quick-inference box of a job with an aggregate: suggestions from its validation split, answers on submit
let inferJob = null;

async function post(path, body) {
  const response = await fetch(path, { method: "POST", cache: "no-store",
    headers: { "X-Infernet-Token": token, "Content-Type": "application/json" }, body: JSON.stringify(body) });
  const answer = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error(answer.error || `HTTP ${response.status}`);
  return answer;
}

async function showInfer(job) {
  const form = document.getElementById("infer");
  form.hidden = !job.aggregates.length;
  if (form.hidden || inferJob === job.id) return;
  inferJob = job.id;
  const box = document.getElementById("suggestions");
  box.replaceChildren();
  try {
    for (const prompt of (await api(`/api/jobs/${job.id}/prompts`)).prompts) {
      const button = document.createElement("button");
      button.type = "button";
      button.textContent = prompt.length > 60 ? prompt.slice(0, 57) + "…" : prompt;
      button.addEventListener("click", () => { document.getElementById("prompt").value = prompt; });
      box.appendChild(button);
    }
  } catch (error) {
    box.textContent = String(error.message || error);
  }
}

document.getElementById("infer").addEventListener("submit", async (event) => {
  event.preventDefault();
  const answer = document.getElementById("answer"), base = document.getElementById("base-answer");
  answer.textContent = "…"; base.textContent = "…";
  try {
    const result = await post(`/api/jobs/${selected}/infer`, { prompt: document.getElementById("prompt").value });
    answer.textContent = result.answer; base.textContent = result.base_answer;
  } catch (error) {
    answer.textContent = String(error.message || error); base.textContent = "";
  }
});

async function refresh() {
  const status = document.getElementById("status");
  try {
    const [peers, jobs] = await Promise.all([api("/api/peers"), api("/api/jobs")]);
    renderPeers(peers);
    renderJobs(jobs);
    if (selected) {
      const job = await api(`/api/jobs/${selected}`);
      renderJob(job);
      showInfer(job);
    }
    status.textContent = `updated ${new Date().toLocaleTimeString()}`;
    document.body.dataset.ready = "1";
  } catch (error) {
    status.textContent = String(error.message || error);
  }
}

refresh();
setInterval(refresh, 2000);
