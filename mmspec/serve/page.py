"""The demo page served at ``GET /``: one static HTML document with inline JavaScript, no build
step. It is kept as a Python string (not a data file) so that it ships in the wheel without
package-data settings.

Three panels talk to the same API as any client: an image (chosen or dropped) -> the caption,
streamed over server-sent events, with tau, acceptance and the speedup over plain decoding; a prompt
-> an image; a text -> an audio player. Each shows the method's stats next to plain decoding's
(``mmspec.compare_baseline``).
"""

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>mmspec serve</title>
<link rel="icon" href="data:,">
<style>
  body { font-family: system-ui, sans-serif; max-width: 60rem; margin: 1.5rem auto; padding: 0 1rem; color: #222; }
  section { border: 1px solid #ccc; border-radius: 6px; padding: 1rem; margin-bottom: 1rem; }
  h1 { font-size: 1.4rem; } h2 { font-size: 1.1rem; margin-top: 0; }
  #drop { border: 2px dashed #999; padding: 1rem; text-align: center; cursor: pointer; }
  #drop.over { background: #eef; }
  img.preview { max-height: 12rem; image-rendering: pixelated; display: block; margin: .5rem 0; }
  .stats { font-family: ui-monospace, monospace; font-size: .85rem; color: #444; white-space: pre-wrap; }
  .error { color: #b00; }
  input[type=text] { width: 70%; }
</style>
</head>
<body>
<h1>mmspec serve</h1>
<p>API key (if the server has one): <input id="key" type="password" autocomplete="off"></p>

<section id="caption">
  <h2>Caption an image</h2>
  <div id="drop">Drop an image here or click to choose one<input id="file" type="file" accept="image/*" hidden></div>
  <img id="capimg" class="preview" alt="" hidden>
  <p>Question: <input id="question" type="text" value="Describe the image."> max tokens
     <input id="maxtokens" type="number" value="__MAX_TOKENS__" min="1" max="__MAX_TOKENS_LIMIT__" style="width:5rem"></p>
  <button id="capgo" disabled>Caption</button>
  <p id="captext"></p>
  <div id="capstats" class="stats"></div>
</section>

<section id="image">
  <h2>Text to image</h2>
  <p>Prompt: <input id="prompt" type="text" value="a red circle above a blue square"> seed <input id="seed" type="number" value="0" style="width:5rem"></p>
  <button id="imggo">Generate</button>
  <img id="imgout" class="preview" alt="" hidden>
  <div id="imgstats" class="stats"></div>
</section>

<section id="speech">
  <h2>Text to speech</h2>
  <p>Text: <input id="say" type="text" value="It is half past four and it is raining."></p>
  <button id="ttsgo">Say it</button>
  <p><audio id="audio" controls hidden></audio></p>
  <div id="ttsstats" class="stats"></div>
</section>

<script>
"use strict";
const $ = (id) => document.getElementById(id);
let imageUri = null;
let models = {};

function headers() {
  const h = {"Content-Type": "application/json"};
  if ($("key").value) h["Authorization"] = "Bearer " + $("key").value;
  return h;
}
function fmt(x, digits = 2) { return (x === null || x === undefined) ? "n/a" : Number(x).toFixed(digits); }
function known(x) { return x !== null && x !== undefined; }
// The method's stats on one line, plain decoding's (the same request decoded one token per
// forward, run by compare_baseline) on the next, then the speedup: baseline time / method time.
// The speech endpoint's header carries no baseline time, so it is speedup x method time there.
function statsLine(s) {
  const method = [`${s.method}: tau ${fmt(s.tau)}`];
  if (known(s.acceptance_rate)) method.push(`acceptance ${fmt(s.acceptance_rate)}`);
  method.push(`${fmt(s.wall_time_s)} s`, `batch ${s.batch_size}`);
  let baseline = s.baseline_wall_time_s;
  if (!known(baseline) && s.stats) baseline = s.stats.baseline_wall_time_s;
  if (!known(baseline) && known(s.speedup) && known(s.wall_time_s)) baseline = s.speedup * s.wall_time_s;
  const plain = known(baseline) ? `plain decoding: tau 1.00 | ${fmt(baseline)} s` : "plain decoding: not run";
  return [method.join(" | "), plain, `speedup ${known(s.speedup) ? fmt(s.speedup) + "x" : "n/a"}`].join("\\n");
}
function showError(box, message) {
  box.innerHTML = ""; const p = document.createElement("span"); p.className = "error"; p.textContent = message; box.appendChild(p);
}
async function fail(box, response) {
  let message = response.status + " " + response.statusText;
  try { message = (await response.json()).error.message; } catch (e) {}
  showError(box, message);
}
// A button's handler: disabled while it runs (each clears its box before its first await, so no earlier
// result or error shows while it starts); anything thrown (the server gone, a bad answer) is shown in its box.
function handler(button, box, run) {
  $(button).onclick = async () => {
    $(button).disabled = true;
    try { await run(); } catch (e) { showError($(box), String(e)); } finally { $(button).disabled = false; }
  };
}
async function loadModels() {
  try {
    const r = await fetch("/v1/models", {headers: headers()});
    if (!r.ok) return;
    for (const m of (await r.json()).data) models[m.task] = m.id;
  } catch (e) {}
}

function useFile(file) {
  if (!file) return;
  const reader = new FileReader();
  reader.onload = () => { imageUri = reader.result; $("capimg").src = imageUri; $("capimg").hidden = false; $("capgo").disabled = false; };
  reader.readAsDataURL(file);
}
$("drop").onclick = () => $("file").click();
$("file").onchange = () => useFile($("file").files[0]);
$("drop").ondragover = (e) => { e.preventDefault(); $("drop").classList.add("over"); };
$("drop").ondragleave = () => $("drop").classList.remove("over");
$("drop").ondrop = (e) => { e.preventDefault(); $("drop").classList.remove("over"); useFile(e.dataTransfer.files[0]); };

handler("capgo", "capstats", async () => {
  $("captext").textContent = ""; $("capstats").textContent = "decoding...";
  await loadModels();
  const body = {model: models["image-captioning"] || "caption", stream: true, temperature: 0,
                max_tokens: Number($("maxtokens").value),
                mmspec: {compare_baseline: true},
                messages: [{role: "user", content: [{type: "image_url", image_url: {url: imageUri}},
                                                    {type: "text", text: $("question").value}]}]};
  const r = await fetch("/v1/chat/completions", {method: "POST", headers: headers(), body: JSON.stringify(body)});
  if (!r.ok) return fail($("capstats"), r);
  const reader = r.body.getReader(); const decoder = new TextDecoder(); let buffer = "";
  while (true) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buffer.indexOf("\\n\\n")) >= 0) {
      const line = buffer.slice(0, cut).trim(); buffer = buffer.slice(cut + 2);
      if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
      const event = JSON.parse(line.slice(6));
      if (event.error) { showError($("capstats"), event.error.message); continue; }
      for (const choice of event.choices) $("captext").textContent += choice.delta.content || "";
      if (event.mmspec) {
        $("capstats").textContent = statsLine(event.mmspec) +
          (event.mmspec.baseline_text !== undefined ? `\\nplain decoding said: ${event.mmspec.baseline_text}` +
           ` (identical: ${event.mmspec.identical_to_baseline})` : "");
      }
    }
  }
});

handler("imggo", "imgstats", async () => {
  $("imgout").hidden = true; $("imgstats").textContent = "generating...";
  await loadModels();
  const body = {prompt: $("prompt").value, n: 1, seed: Number($("seed").value), response_format: "b64_json",
                mmspec: {compare_baseline: true}};
  if (models["text-to-image"]) body.model = models["text-to-image"];
  const r = await fetch("/v1/images/generations", {method: "POST", headers: headers(), body: JSON.stringify(body)});
  if (!r.ok) return fail($("imgstats"), r);
  const out = await r.json();
  $("imgout").src = "data:image/png;base64," + out.data[0].b64_json; $("imgout").hidden = false;
  $("imgstats").textContent = statsLine(out.mmspec);
});

handler("ttsgo", "ttsstats", async () => {
  $("audio").hidden = true; $("ttsstats").textContent = "speaking...";
  await loadModels();
  const body = {model: models["text-to-speech"] || "tts", input: $("say").value, voice: "default",
                response_format: "wav", mmspec: {compare_baseline: true}};
  const r = await fetch("/v1/audio/speech", {method: "POST", headers: headers(), body: JSON.stringify(body)});
  if (!r.ok) return fail($("ttsstats"), r);
  const stats = JSON.parse(r.headers.get("X-Mmspec-Stats") || "{}");
  $("audio").src = URL.createObjectURL(await r.blob()); $("audio").hidden = false;
  $("ttsstats").textContent = statsLine(stats);
});
</script>
</body>
</html>
"""


def render_page(max_tokens_limit: int) -> str:
    """:data:`PAGE` for a server whose ``--max-tokens-limit`` is ``max_tokens_limit``: the caption
    panel's "max tokens" starts at the chat default (64, or the limit when lower: as a request
    without ``max_tokens`` gets) and goes no higher than the limit (it sent 64 whatever the limit,
    which a server started with a lower one refused with a 400)."""
    from .tasks import DEFAULT_MAX_TOKENS

    return (PAGE.replace("__MAX_TOKENS_LIMIT__", str(max_tokens_limit))
            .replace("__MAX_TOKENS__", str(min(DEFAULT_MAX_TOKENS, max_tokens_limit))))
