// Live updates without a build step: every [data-live] region of the page is re-fetched
// from the page's own URL every few seconds and swapped in place, unless the operator is
// typing in it. Forms with data-confirm ask before they submit.
(function () {
  "use strict";
  var interval = parseInt(document.body.getAttribute("data-live-interval") || "2000", 10);
  var status = document.getElementById("live-status");

  function busy(region) {
    var active = document.activeElement;
    return active && active !== document.body && region.contains(active) &&
      (active.tagName === "INPUT" || active.tagName === "SELECT" || active.tagName === "TEXTAREA");
  }

  function openDetails(region) {
    var open = [];
    region.querySelectorAll("details").forEach(function (d, i) { if (d.open) open.push(i); });
    return open;
  }

  function refresh() {
    var regions = document.querySelectorAll("[data-live]");
    if (!regions.length || document.hidden) { return schedule(); }
    fetch(window.location.href, { credentials: "same-origin", headers: { "X-Live": "1" } })
      .then(function (response) {
        if (response.redirected || !response.ok) { throw new Error("status " + response.status); }
        return response.text();
      })
      .then(function (html) {
        var fresh = new DOMParser().parseFromString(html, "text/html");
        regions.forEach(function (region) {
          var next = region.id && fresh.getElementById(region.id);
          if (!next || busy(region)) { return; }
          var open = openDetails(region);
          region.innerHTML = next.innerHTML;
          region.querySelectorAll("details").forEach(function (d, i) {
            if (open.indexOf(i) >= 0) { d.open = true; }
          });
          bindConfirms(region);
        });
        if (status) { status.className = "live-dot on"; }
      })
      .catch(function () { if (status) { status.className = "live-dot off"; } })
      .then(schedule);
  }

  function schedule() { window.setTimeout(refresh, interval); }

  function bindConfirms(root) {
    root.querySelectorAll("form[data-confirm]").forEach(function (form) {
      if (form.dataset.bound) { return; }
      form.dataset.bound = "1";
      form.addEventListener("submit", function (event) {
        if (!window.confirm(form.getAttribute("data-confirm"))) { event.preventDefault(); }
      });
    });
  }

  bindConfirms(document);
  schedule();
})();
