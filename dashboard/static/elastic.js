/* Polling panels (marked data-poll) skip their request while the tab is hidden. Done here, in a
   static file, instead of an hx-trigger filter, because filters need eval and the CSP forbids it. */
document.addEventListener("htmx:confirm", function (event) {
  if (document.visibilityState !== "visible" && event.target.hasAttribute("data-poll")) {
    event.preventDefault();
  }
});
