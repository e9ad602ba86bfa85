// The chat page (llmserve/server/api/ui.py serves it): one conversation kept in this tab,
// streamed from /v1/chat/completions. Every URL is relative: the page talks to the server that
// served it and to nothing else (its Content-Security-Policy says so too).
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "llmserve-api-key";

const chat = {
  model: null,             // the OpenAI model name, from /info
  maxImages: 0,            // images a request may carry; 0: the model takes text only
  turns: [],               // {role, content, element}: content as the API takes it
  attached: [],            // data: URLs of the images waiting for the next message
  controller: null,        // the AbortController of the answer being streamed, else null
};

// -- the API key ---------------------------------------------------------------------------

function authHeaders() {
  const key = sessionStorage.getItem(KEY_STORAGE);
  return key ? { Authorization: `Bearer ${key}` } : {};
}

// Ask for the key (resolves once one is entered); the page waits on it after a 401.
function askForKey(note) {
  return new Promise((resolve) => {
    $("key-note").textContent = note;
    $("key-box").hidden = false;
    $("key").focus();
    $("key-form").onsubmit = (event) => {
      event.preventDefault();
      sessionStorage.setItem(KEY_STORAGE, $("key").value.trim());
      $("key").value = "";
      $("key-box").hidden = true;
      resolve();
    };
  });
}

// fetch with the key; on a 401, ask for the key and send the request again
async function api(path, init = {}) {
  for (;;) {
    const response = await fetch(path, { ...init, headers: { ...init.headers, ...authHeaders() } });
    if (response.status !== 401) return response;
    await askForKey(sessionStorage.getItem(KEY_STORAGE) ? "That key was refused." : "");
  }
}

async function errorMessage(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    return `${response.status}: ${body.error?.message ?? body.error ?? text}`;   // OpenAI's shape, else TGI's
  } catch {
    return `${response.status}: ${text || response.statusText}`;
  }
}

// -- Markdown --------------------------------------------------------------------------------
// A small renderer for answers: fenced code blocks, headings, lists, paragraphs, `code`,
// **bold** and *italic*. The text is HTML-escaped before anything else, so a model's output never
// becomes markup: the only tags in the result are the ones written here. Links and images stay
// text (an image would make the browser fetch from wherever the model says).

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
const escapeHTML = (text) => text.replace(/[&<>"']/g, (c) => ESCAPES[c]);

function renderInline(text) {
  const spans = [];
  // code spans first, held out (as \0N\0) so that no emphasis applies inside them
  let html = escapeHTML(text).replace(/`([^`\n]+)`/g, (_, code) => `\0${spans.push(code) - 1}\0`);
  html = html.replace(/\*\*(?=\S)(.+?)\*\*/g, "<strong>$1</strong>")
             .replace(/(^|[^*\w])\*([^\s*](?:[^*]*[^\s*])?)\*(?!\*)/g, "$1<em>$2</em>");
  return html.replace(/\0(\d+)\0/g, (_, i) => `<code>${spans[Number(i)]}</code>`);
}

const FENCE = /^\s*(```|~~~)\s*([\w+#.-]*)/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const LIST_ITEM = /^\s*([-*+]|\d+[.)])\s+(.*)$/;

function renderMarkdown(source) {
  const lines = source.replace(/\0/g, "").split("\n");
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(FENCE);
    if (fence) {                         // a code block, to its closing fence or the end (still streaming)
      const code = [];
      for (i++; i < lines.length && !lines[i].trim().startsWith(fence[1]); i++) code.push(lines[i]);
      i++;
      const lang = fence[2] ? ` data-lang="${escapeHTML(fence[2])}"` : "";
      out.push(`<pre><code${lang}>${escapeHTML(code.join("\n"))}</code></pre>`);
      continue;
    }
    const heading = line.match(HEADING);
    if (heading) {
      const level = heading[1].length;
      out.push(`<h${level}>${renderInline(heading[2])}</h${level}>`);
      i++;
      continue;
    }
    const item = line.match(LIST_ITEM);
    if (item) {                          // consecutive items of one kind make one list
      const tag = /\d/.test(item[1]) ? "ol" : "ul";
      const items = [];
      let m;
      while (i < lines.length && (m = lines[i].match(LIST_ITEM)) && /\d/.test(m[1]) === (tag === "ol")) {
        items.push(`<li>${renderInline(m[2])}</li>`);
        i++;
      }
      out.push(`<${tag}>${items.join("")}</${tag}>`);
      continue;
    }
    if (!line.trim()) {
      i++;
      continue;
    }
    const paragraph = [];                // lines up to a blank line or another block
    while (i < lines.length && lines[i].trim() && !FENCE.test(lines[i]) && !HEADING.test(lines[i])
           && !LIST_ITEM.test(lines[i])) {
      paragraph.push(renderInline(lines[i]));
      i++;
    }
    out.push(`<p>${paragraph.join("<br>")}</p>`);
  }
  return out.join("");
}

// -- the conversation view --------------------------------------------------------------------

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function addMessage(role) {
  const node = element("div", `message ${role}`);
  node.append(element("div", "body"));
  const log = $("log");
  log.append(node);
  log.scrollTop = log.scrollHeight;
  return node;
}

function showUserMessage(text, images) {
  const node = addMessage("user");
  node.querySelector(".body").textContent = text;
  for (const url of images) {
    const img = element("img", "thumb");
    img.src = url;
    img.alt = "attached image";
    node.append(img);
  }
  return node;
}

// Re-render an answer at most once a frame, however fast its chunks come.
function showAnswer(node, text) {
  node.pendingText = text;
  if (node.renderScheduled) return;
  node.renderScheduled = true;
  requestAnimationFrame(() => {
    node.renderScheduled = false;
    const log = $("log");
    const atBottom = log.scrollHeight - log.scrollTop - log.clientHeight < 40;
    node.querySelector(".body").innerHTML = renderMarkdown(node.pendingText);   // escaped: see renderMarkdown
    if (atBottom) log.scrollTop = log.scrollHeight;
  });
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  const last = chat.turns.at(-1);
  $("regenerate").disabled = busy || !last;
}

// -- streaming an answer ----------------------------------------------------------------------

// The JSON events of an SSE body, up to [DONE] (sse-starlette ends lines with \r\n).
async function* sseEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
      const data = block.split(/\r?\n/).filter((l) => l.startsWith("data:"))
                        .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

function numberField(id) {
  const value = $(id).value.trim();
  return value === "" ? undefined : Number(value);
}

function requestBody() {
  const system = $("system").value.trim();
  const messages = chat.turns.map(({ role, content }) => ({ role, content }));
  return {
    model: chat.model,
    messages: system ? [{ role: "system", content: system }, ...messages] : messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: numberField("temperature"),
    top_p: numberField("top-p"),
    max_tokens: numberField("max-tokens"),    // unset: as many as the context leaves
  };
}

function describeSpeed(tokens, start, first, end, stopped) {
  const parts = [`${tokens} token${tokens === 1 ? "" : "s"}`];
  if (tokens > 1 && end > first) parts.push(`${((tokens - 1) / ((end - first) / 1000)).toFixed(1)} tokens/s`);
  if (first !== null) parts.push(`${Math.round(first - start)} ms to first token`);
  if (stopped) parts.push("stopped");
  return parts.join(" · ");
}

async function answer() {
  const node = addMessage("assistant");
  const controller = new AbortController();
  chat.controller = controller;
  setBusy(true);
  const start = performance.now();
  let first = null;
  let text = "";
  let chunks = 0;
  let usage = null;
  let error = null;
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(requestBody()), signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const event of sseEvents(response.body)) {
      if (event.error) throw new Error(event.error.message ?? JSON.stringify(event.error));
      if (event.usage) usage = event.usage;
      const delta = event.choices?.[0]?.delta?.content;
      if (delta) {
        first ??= performance.now();
        text += delta;
        chunks++;
        showAnswer(node, text);
      }
    }
  } catch (e) {
    if (!controller.signal.aborted) error = e.message;   // a stop aborts the fetch: not an error
  }
  const end = performance.now();
  chat.controller = null;
  const stopped = controller.signal.aborted;
  if (text) {
    chat.turns.push({ role: "assistant", content: text, element: node });
    showAnswer(node, text);
  }
  // the server's count when the stream ran to its end; a stopped one counts its chunks (one a token)
  const tokens = usage?.completion_tokens ?? chunks;
  const stats = element("div", "stats", describeSpeed(tokens, start, first, end, stopped));
  if (error) node.append(element("div", "error", error));
  else if (!text && !stopped) node.append(element("div", "error", "the model answered nothing"));
  node.append(stats);
  if (!text) node.errorOnly = true;      // regenerate drops it
  setBusy(false);
  $("input").focus();
}

// -- actions ------------------------------------------------------------------------------------

function send() {
  const text = $("input").value;
  if (chat.controller || (!text.trim() && !chat.attached.length)) return;
  const images = chat.attached;
  const content = images.length
    ? [{ type: "text", text }, ...images.map((url) => ({ type: "image_url", image_url: { url } }))]
    : text;
  chat.turns.push({ role: "user", content, element: showUserMessage(text, images) });
  $("input").value = "";
  chat.attached = [];
  showAttachments();
  answer();
}

function stop() {
  chat.controller?.abort();
}

function regenerate() {
  if (chat.controller || !chat.turns.length) return;
  if (chat.turns.at(-1).role === "assistant") chat.turns.pop().element.remove();
  const last = $("log").lastElementChild;
  if (last?.errorOnly) last.remove();
  answer();
}

function newChat() {
  stop();
  chat.turns = [];
  $("log").replaceChildren();
  setBusy(false);
}

function showAttachments() {
  const box = $("attachments");
  box.replaceChildren();
  chat.attached.forEach((url, i) => {
    const img = element("img", "thumb");
    img.src = url;
    img.alt = "image to send";
    img.title = "click to remove";
    img.onclick = () => { chat.attached.splice(i, 1); showAttachments(); };
    box.append(img);
  });
}

function attachFiles(files) {
  for (const file of files) {
    if (chat.attached.length >= chat.maxImages) break;     // the server's --max-images-per-request
    const reader = new FileReader();
    reader.onload = () => { chat.attached.push(reader.result); showAttachments(); };
    reader.readAsDataURL(file);
  }
}

// -- start -----------------------------------------------------------------------------------

async function start() {
  $("composer").addEventListener("submit", (event) => { event.preventDefault(); send(); });
  $("input").addEventListener("keydown", (event) => {
    // Enter sends, Shift+Enter is a new line; not while an input method is composing a character
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  document.addEventListener("keydown", (event) => { if (event.key === "Escape") stop(); });
  $("stop").addEventListener("click", stop);
  $("regenerate").addEventListener("click", regenerate);
  $("new-chat").addEventListener("click", newChat);
  $("attach").addEventListener("click", () => $("file").click());
  $("file").addEventListener("change", () => { attachFiles($("file").files); $("file").value = ""; });

  const response = await api("/info");
  if (!response.ok) {
    $("log").append(element("div", "error", `/info: ${await errorMessage(response)}`));
    return;
  }
  const info = await response.json();
  chat.model = info.model_id;
  chat.maxImages = info.takes_images ? info.max_images_per_request : 0;
  $("model").textContent = info.model_id;
  $("context").textContent = `context: ${info.max_total_tokens} tokens`;
  document.title = `${info.model_id} · llmserve`;
  // the model's recommended sampling where it has one, else the API's own defaults
  const defaults = info.generation_config ?? {};
  $("temperature").value = defaults.temperature ?? 1;
  $("top-p").value = defaults.top_p ?? 1;
  $("max-tokens").max = info.max_total_tokens;
  $("max-tokens").placeholder = "as many as fit";
  $("attach").hidden = chat.maxImages === 0;
  document.body.dataset.ready = "true";     // for tests: /info has been read
  $("input").focus();
}

start();
