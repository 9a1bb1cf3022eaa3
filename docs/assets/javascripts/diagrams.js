// Draws each ```mermaid block (a <div class="diagram">) with the local mermaid.min.js
// shipped beside this file: the site renders offline, from disk.
document.addEventListener("DOMContentLoaded", function () {
  if (typeof mermaid === "undefined") return;
  mermaid.initialize({ startOnLoad: false, securityLevel: "strict" });
  mermaid.run({ querySelector: "div.diagram" });
});
