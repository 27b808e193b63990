// scheduled-d web console: the only script the pages load (the CSP allows no inline one).
// 1. Remember the browser's time zone in a cookie, so times show in the viewer's zone.
// 2. Submit the zone picker when it changes.
// 3. Follow a running run's output: fetch the fragment named by data-follow every
//    data-every ms and swap it in, until the run finishes (bounded to one hour).
(function () {
  "use strict";
  try {
    var zone = Intl.DateTimeFormat().resolvedOptions().timeZone;
    if (zone && document.cookie.indexOf("sd_tz=") === -1) {
      document.cookie = "sd_tz=" + encodeURIComponent(zone) + "; path=/ui; SameSite=Strict; max-age=31536000";
    }
  } catch (e) { /* no Intl: times stay in UTC */ }

  document.addEventListener("DOMContentLoaded", function () {
    var pickers = document.querySelectorAll("select.autosubmit");
    for (var i = 0; i < pickers.length; i++) {
      pickers[i].addEventListener("change", function (event) { event.target.form.submit(); });
    }
    follow(document.getElementById("output"), 0);
  });

  var MAX_POLLS = 1800;

  function follow(element, polls) {
    if (!element || !element.dataset.follow || polls >= MAX_POLLS) { return; }
    var url = element.dataset.follow;
    var every = parseInt(element.dataset.every, 10) || 2000;
    window.setTimeout(function () {
      fetch(url, { credentials: "same-origin", headers: { "Accept": "text/html" } })
        .then(function (response) { return response.ok ? response.text() : Promise.reject(response.status); })
        .then(function (html) {
          var holder = document.createElement("div");
          holder.innerHTML = html;
          var fresh = holder.querySelector("#output");
          if (fresh) {
            element.replaceWith(fresh);
            follow(fresh, polls + 1);
          }
        })
        .catch(function () { follow(element, polls + 1); });
    }, every);
  }
})();
