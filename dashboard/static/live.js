/* Live updates: while a page has a [data-live] element, one EventSource on its URL (/events).
   Each event refreshes the page's panels (an `elastic-refresh` on body, the event htmx panels
   already listen to) and is written to #live-log. While the stream is open, the 5 s polling of
   panels whose every change the events announce (marked data-live-covered: the database is their
   only source) is skipped; when it closes, polling resumes. Panels that also show what only Slurm
   knows (other users' jobs) keep polling.
   A static file: the CSP allows no inline script and no eval. */
(function () {
  "use strict";
  var holder = document.querySelector("[data-live]");
  if (!holder || !window.EventSource) { return; }
  var body = document.body;
  var pending = null;
  function refresh() {  // coalesce a burst of events into one refresh
    if (pending) { return; }
    pending = setTimeout(function () {
      pending = null;
      body.dispatchEvent(new CustomEvent("elastic-refresh", { bubbles: true }));
    }, 150);
  }
  function log(text) {
    var list = document.getElementById("live-log");
    if (!list) { return; }
    var item = document.createElement("li");
    item.textContent = new Date().toISOString().substring(11, 19) + " " + text;
    list.insertBefore(item, list.firstChild);
    while (list.children.length > 30) { list.removeChild(list.lastChild); }
  }
  function describe(name, d) {
    if (name === "migration") {
      var phases = Object.keys(d.phases || {}).map(function (k) { return k + " " + Number(d.phases[k]).toFixed(3) + " s"; });
      return "migration #" + d.id + " " + d.job + " " + d.from + " \u2192 " + d.to + ": " + d.status +
        (phases.length ? " (" + phases.join(", ") + ")" : "") + (d.pause_s != null ? ", pause " + Number(d.pause_s).toFixed(3) + " s" : "");
    }
    if (name === "request") {
      return "request #" + d.id + " " + d.action + " (job " + d.job_id + "): " + d.status + (d.message ? " \u2014 " + d.message : "");
    }
    if (name === "placement") { return "placement changed"; }
    return name + ": " + (d.message || "");
  }
  var source = new EventSource(holder.getAttribute("data-live"));
  source.onopen = function () { body.setAttribute("data-live-state", "open"); };
  source.onerror = function () { body.setAttribute("data-live-state", source.readyState === 2 ? "closed" : "reconnecting"); };
  ["placement", "migration", "request", "error"].forEach(function (name) {
    source.addEventListener(name, function (event) {
      var data = {};
      try { data = JSON.parse(event.data); } catch (e) { data = { message: event.data }; }
      body.setAttribute("data-live-last", name);
      log(describe(name, data));
      refresh();
    });
  });
  document.addEventListener("htmx:confirm", function (event) {
    var elt = event.detail && event.detail.elt;
    if (body.getAttribute("data-live-state") === "open" && elt && elt.hasAttribute("data-live-covered") &&
        !event.detail.triggeringEvent) {
      event.preventDefault();  // the stream is live: skip this poll
    }
  });
})();
