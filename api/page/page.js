// The control page: only the public API (/v1/tts, /v1/audio/voices, /readyz, /metrics, /v1/bundle), so it doubles
// as an example of it. wav and pcm play while they stream (Web Audio); the other formats play once fetched; "words"
// streams pcm with `timestamps` and highlights each word as heard.
"use strict";

const $ = (id) => document.getElementById(id);
const STREAMED = new Set(["wav", "pcm"]);
const WAV_HEADER = 44; // the streamed wav header (unknown sizes), then pcm16
const state = { played: { requests: 0, samples: 0, seconds: 0 }, recent: [], audio: null, sources: [], recorder: null,
                recorded: null, at: 0, anchors: [], words: [], heard: -1 };
window.cosyedge = state; // what the browser test reads

// With an API key configured the service answers 401: the page asks for the key once and sends it as a Bearer
// header with every API call, like any client (kept for this tab only, in sessionStorage).
function withKey(options) {
  const key = sessionStorage.getItem("cosyedge-api-key");
  return key ? { ...options, headers: { ...(options.headers || {}), Authorization: `Bearer ${key}` } } : options;
}

async function api(path, options = {}) {
  const response = await fetch(path, withKey(options));
  if (response.status === 401) $("key-form").hidden = false;
  if (!response.ok) {
    let message = `HTTP ${response.status}`;
    try {
      const body = await response.json();
      message = `${body.error.code}: ${body.error.message}`;
    } catch (_) { /* not the API's JSON error */ }
    throw new Error(message);
  }
  return response;
}

function say(id, text, error = false) {
  $(id).textContent = text;
  $(id).classList.toggle("error", error);
}

// -- status: readiness, queue depth, latency, bundle --------------------------------------------------------
async function refreshStatus() {
  try {
    const response = await fetch("/readyz");
    const body = await response.json();
    $("ready").textContent = response.ok ? "ready" : (body.error ? body.error.code : "not ready");
    $("ready").className = "badge " + (response.ok ? "ok" : "bad");
    $("queue").textContent = response.ok ? body.queue_depth : "-";
  } catch (_) {
    $("ready").textContent = "unreachable";
    $("ready").className = "badge bad";
  }
  try {
    showMetrics(await (await api("/metrics")).text());
  } catch (_) { /* the next poll tries again */ }
}

function showMetrics(text) {
  const routes = {};
  let hits = 0, misses = 0;
  for (const line of text.split("\n")) {
    const m = line.match(/^cosyedge_request_duration_seconds_(sum|count)\{route="([^"]+)"\} (\S+)$/);
    if (m) (routes[m[2]] = routes[m[2]] || {})[m[1]] = Number(m[3]);
    if (line.startsWith("cosyedge_cache_hits_total ")) hits = Number(line.split(" ")[1]);
    if (line.startsWith("cosyedge_cache_misses_total ")) misses = Number(line.split(" ")[1]);
  }
  const rows = Object.entries(routes).filter(([route, v]) => route.startsWith("/v1/") && v.count);
  $("routes").replaceChildren(...rows.map(([route, v]) => row([route, v.count, `${(1000 * v.sum / v.count).toFixed(0)} ms`])));
  $("cache").textContent = `phrase cache: ${hits} hits, ${misses} misses`;
}

function row(cells) {
  const tr = document.createElement("tr");
  for (const cell of cells) {
    const td = document.createElement("td");
    td.textContent = cell;
    tr.append(td);
  }
  return tr;
}

async function loadBundle() {
  const bundle = await (await api("/v1/bundle")).json();
  $("bundle-name").textContent = bundle.name;
  const items = [["name", bundle.name], ["family", bundle.family], ["sample rate", `${bundle.sample_rate} Hz`],
                 ["graphs", bundle.selection], ["voices", bundle.voices]];
  $("bundle").replaceChildren(...items.flatMap(([k, v]) => {
    const dt = document.createElement("dt"), dd = document.createElement("dd");
    dt.textContent = k;
    dd.textContent = v;
    return [dt, dd];
  }));
  const quality = bundle.quality || {};
  $("quality").textContent = Object.keys(quality).length ? JSON.stringify(quality, null, 2)
    : "this bundle was built without a quality report";
}

// -- voices ----------------------------------------------------------------------------------------------
async function loadVoices(select) {
  const listing = await (await api("/v1/audio/voices")).json();
  const chosen = select || $("voice").value;
  $("voice").replaceChildren(...listing.voices.map((v) => new Option(`${v.name} (${v.kind})`, v.name)));
  if (listing.voices.some((v) => v.name === chosen)) $("voice").value = chosen;
  $("voices").replaceChildren(...listing.voices.map((v) => {
    const li = document.createElement("li");
    li.textContent = `${v.name} - ${v.kind}${v.registered ? ", registered here" : ""}`;
    li.dataset.voice = v.name;
    if (v.registered) {
      const remove = document.createElement("button");
      remove.type = "button";
      remove.textContent = "delete";
      remove.addEventListener("click", () => deleteVoice(v.name));
      li.append(remove);
    }
    return li;
  }));
}

async function deleteVoice(name) {
  try {
    await api(`/v1/audio/voices/${encodeURIComponent(name)}`, { method: "DELETE" });
    say("voice-status", `deleted ${name}`);
    await loadVoices();
  } catch (e) {
    say("voice-status", e.message, true);
  }
}

async function register(event) {
  event.preventDefault();
  const clip = $("voice-file").files[0] || state.recorded;
  if (!clip) return say("voice-status", "choose a clip or record one", true);
  const form = new FormData();
  form.append("name", $("voice-name").value.trim());
  form.append("text", $("voice-text").value);
  form.append("audio", clip, clip.name || "recording.wav");
  say("voice-status", "registering...");
  try {
    const voice = await (await api("/v1/audio/voices", { method: "POST", body: form })).json();
    say("voice-status", `registered ${voice.name}`);
    state.recorded = null;
    await loadVoices(voice.name);
  } catch (e) {
    say("voice-status", e.message, true);
  }
}

// Recording: raw samples through Web Audio, saved as 16-bit WAV (what the service reads; no browser codec).
async function toggleRecording() {
  if (state.recorder) {
    const { stream, context, chunks } = state.recorder;
    state.recorder = null;
    stream.getTracks().forEach((t) => t.stop());
    await context.close();
    state.recorded = wavBlob(chunks, context.sampleRate);
    $("record").textContent = "Record";
    return say("voice-status", `recorded ${(chunks.reduce((n, c) => n + c.length, 0) / context.sampleRate).toFixed(1)} s`);
  }
  try {
    const stream = await navigator.mediaDevices.getUserMedia({ audio: true });
    const context = new AudioContext();
    const source = context.createMediaStreamSource(stream);
    const tap = context.createScriptProcessor(4096, 1, 1);
    const chunks = [];
    tap.onaudioprocess = (e) => chunks.push(new Float32Array(e.inputBuffer.getChannelData(0)));
    source.connect(tap);
    tap.connect(context.destination);
    state.recorder = { stream, context, chunks };
    $("record").textContent = "Stop recording";
    say("voice-status", "recording... read the transcript aloud");
  } catch (e) {
    say("voice-status", `no microphone: ${e.message}`, true);
  }
}

function wavBlob(chunks, rate) {
  const samples = chunks.reduce((n, c) => n + c.length, 0);
  const view = new DataView(new ArrayBuffer(WAV_HEADER + 2 * samples));
  const text = (at, s) => [...s].forEach((ch, i) => view.setUint8(at + i, ch.charCodeAt(0)));
  text(0, "RIFF"); view.setUint32(4, 36 + 2 * samples, true); text(8, "WAVEfmt ");
  view.setUint32(16, 16, true); view.setUint16(20, 1, true); view.setUint16(22, 1, true);
  view.setUint32(24, rate, true); view.setUint32(28, 2 * rate, true); view.setUint16(32, 2, true);
  view.setUint16(34, 16, true); text(36, "data"); view.setUint32(40, 2 * samples, true);
  let at = WAV_HEADER;
  for (const chunk of chunks) {
    for (const x of chunk) { view.setInt16(at, Math.max(-1, Math.min(1, x)) * 32767, true); at += 2; }
  }
  return new Blob([view], { type: "audio/wav" });
}

// -- speaking --------------------------------------------------------------------------------------------
function stopPlayback() {
  state.sources.forEach((s) => { try { s.stop(); } catch (_) { /* already ended */ } });
  state.sources = [];
  state.anchors = [];
  $("player").pause();
}

// pcm16 little-endian, played right after what is already scheduled; returns its sample count.
function schedulePcm(view, rate) {
  const context = state.audio, samples = view.byteLength / 2;
  const buffer = context.createBuffer(1, samples, rate);
  const channel = buffer.getChannelData(0);
  for (let i = 0; i < samples; i++) channel[i] = view.getInt16(2 * i, true) / 32768;
  const source = context.createBufferSource();
  source.buffer = buffer;
  source.connect(context.destination);
  state.at = Math.max(state.at, context.currentTime);
  source.start(state.at);
  state.at += buffer.duration;
  state.sources.push(source);
  return samples;
}

async function play() {
  const format = $("format").value;
  const text = $("text").value;
  const body = { text, voice: $("voice").value, speed: Number($("speed").value), format,
                 stream: STREAMED.has(format) };
  if ($("repeatable").checked) Object.assign(body, { deterministic: true, seed: 0 }); // cacheable (api/README.md)
  const words = $("words-on").checked;
  if (words) Object.assign(body, { format: "pcm", stream: true, timestamps: true }); // NDJSON: audio and its words
  stopPlayback();
  if (body.stream) {
    state.audio = state.audio || new AudioContext();
    await state.audio.resume(); // inside the click: allowed to make sound
  }
  say("speak-status", "synthesizing...");
  const started = performance.now();
  try {
    const response = await api("/v1/tts", { method: "POST", headers: { "Content-Type": "application/json" },
                                           body: JSON.stringify(body) });
    const result = words ? await playWords(response, started)
      : body.stream ? await playStream(response, format === "wav", started) : await playFile(response, format, started);
    const cache = response.headers.get("X-Cosyedge-Cache");
    result.total = performance.now() - started;
    state.played.requests += 1;
    state.played.samples += result.samples;
    state.played.seconds += result.seconds;
    state.recent.unshift({ text: text.slice(0, 40), ...result, cache });
    state.recent = state.recent.slice(0, 5);
    $("recent").replaceChildren(...state.recent.map((r) => row([r.text, `${r.first.toFixed(0)} ms`,
                                                                  `${r.total.toFixed(0)} ms`, r.cache || "-"])));
    const how = words ? "pcm, words" : `${format}${body.stream ? ", streamed" : ""}`;
    say("speak-status", `${result.seconds.toFixed(2)} s of audio (${how})`);
  } catch (e) {
    say("speak-status", e.message, true);
  }
}

async function playStream(response, wav, started) {
  const context = state.audio;
  const rate = Number(response.headers.get("X-Sample-Rate"));
  const reader = response.body.getReader();
  let skip = wav ? WAV_HEADER : 0, carry = new Uint8Array(0), samples = 0, first = null;
  state.at = context.currentTime + 0.05;
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    let bytes = new Uint8Array(carry.length + value.length);
    bytes.set(carry);
    bytes.set(value, carry.length);
    const dropped = Math.min(skip, bytes.length);
    bytes = bytes.subarray(dropped);
    skip -= dropped;
    const usable = bytes.length - (bytes.length % 2);
    carry = bytes.slice(usable);
    if (!usable) continue;
    samples += schedulePcm(new DataView(bytes.buffer, bytes.byteOffset, usable), rate);
    if (first === null) first = performance.now() - started;
  }
  return { first: first ?? performance.now() - started, samples, seconds: samples / rate };
}

// -- words as they are heard: the speech stream with `timestamps` (api/README.md) ----------------------------
// Each NDJSON line holds the pcm made since the last one and the words that audio completes, on the stream's clock;
// `anchors` tie that clock to the AudioContext's (each line's first sample and when it plays), so a gap in the audio
// does not skew the highlight. A plain fetch, unlike a WebSocket, carries the API key as a Bearer header.
async function playWords(response, started) {
  const rate = Number(response.headers.get("X-Sample-Rate"));
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  state.at = state.audio.currentTime + 0.05;
  state.words = [];
  state.heard = -1;
  $("words").replaceChildren();
  const highlight = setInterval(showHeard, 50);
  let samples = 0, first = null, partial = "";
  try {
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      const lines = (partial + value).split("\n");
      partial = lines.pop();
      for (const line of lines) {
        const { audio, words } = JSON.parse(line);
        const pcm = Uint8Array.from(atob(audio), (c) => c.charCodeAt(0));
        if (pcm.length) {
          state.anchors.push({ from: samples / rate, at: Math.max(state.at, state.audio.currentTime) });
          samples += schedulePcm(new DataView(pcm.buffer), rate);
          if (first === null) first = performance.now() - started;
        }
        for (const word of words) {
          const span = document.createElement("span");
          span.textContent = word.text;
          $("words").append(span, " ");
          state.words.push(word);
        }
      }
    }
  } finally {
    setTimeout(() => clearInterval(highlight), 1000 * (state.at - state.audio.currentTime) + 500);
  }
  return { first: first ?? performance.now() - started, samples, seconds: samples / rate };
}

// The word being heard: the last one started at the stream's position now (`state.heard`, its span marked).
function showHeard() {
  const now = state.audio.currentTime;
  const anchor = state.anchors.filter((a) => a.at <= now).pop();
  if (!anchor) return;
  const position = anchor.from + (now - anchor.at);
  let heard = -1;
  state.words.forEach((w, i) => { if (w.start_s <= position) heard = i; });
  if (heard === state.heard) return;
  state.heard = heard;
  [...$("words").children].forEach((span, i) => span.classList.toggle("heard", i === heard));
}

async function playFile(response, format, started) {
  const blob = await response.blob();
  const first = performance.now() - started;
  const url = URL.createObjectURL(blob);
  const player = $("player");
  const loaded = new Promise((resolve, reject) => {
    player.onloadedmetadata = () => resolve(player.duration);
    player.onerror = () => reject(new Error(`this browser cannot play ${format}; use the download link`));
  });
  player.src = url;
  Object.assign($("download"), { href: url, download: `cosyedge.${format}`, hidden: false });
  const seconds = await loaded;
  await player.play();
  return { first, samples: Math.round(seconds * Number(response.headers.get("X-Sample-Rate"))), seconds };
}

// -- start -----------------------------------------------------------------------------------------------
window.addEventListener("DOMContentLoaded", async () => {
  $("play").addEventListener("click", play);
  $("stop").addEventListener("click", stopPlayback);
  $("register").addEventListener("submit", register);
  $("record").addEventListener("click", toggleRecording);
  $("key-form").addEventListener("submit", useKey);
  await refreshStatus();
  setInterval(refreshStatus, 2000);
  await load();
});

async function load() {
  try {
    await Promise.all([loadVoices(), loadBundle()]);
    say("speak-status", "");
    document.body.dataset.loaded = "yes";
  } catch (e) {
    say("speak-status", `the service is not ready: ${e.message}`, true);
  }
}

async function useKey(event) {
  event.preventDefault();
  sessionStorage.setItem("cosyedge-api-key", $("api-key").value);
  $("api-key").value = "";
  $("key-form").hidden = true;
  await Promise.all([refreshStatus(), load()]);
}
