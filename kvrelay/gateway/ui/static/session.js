// The session page's step graph: the agents and their edges, from the JSON block the
// server rendered (#graph-data), drawn by the vendored cytoscape.
(function () {
  const data = JSON.parse(document.getElementById("graph-data").textContent);
  window.kvrelayGraph = cytoscape({
    container: document.getElementById("graph"),
    elements: data,
    layout: { name: "breadthfirst", directed: true, padding: 10 },
    style: [
      { selector: "node", style: { "label": "data(label)", "background-color": "#6fa8dc", "font-size": 11 } },
      { selector: "edge", style: { "curve-style": "bezier", "target-arrow-shape": "triangle", "width": 2,
        "line-color": "data(colour)", "target-arrow-color": "data(colour)" } },
    ],
  });
})();
