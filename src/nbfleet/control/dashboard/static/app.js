// nbfleet dashboard: confirmations, live workspace states, token selection.
// No framework, no external URL; text goes into the page with textContent only.
"use strict";

document.addEventListener("submit", (event) => {
  const form = event.target;
  const message = form instanceof HTMLFormElement ? form.dataset.confirm : undefined;
  if (message && !window.confirm(message)) {
    event.preventDefault();
  }
});

document.addEventListener("focusin", (event) => {
  const input = event.target;
  if (input instanceof HTMLInputElement && input.hasAttribute("data-select-on-focus")) {
    input.select();
  }
});

function renderState(cell, item) {
  const state = document.createElement("span");
  state.className = "state state-" + item.state;
  state.textContent = item.state;
  const parts = [state];
  if (item.desired_state && item.desired_state !== item.state) {
    const wants = document.createElement("span");
    wants.className = "muted";
    wants.textContent = " \u2192 " + item.desired_state;
    parts.push(wants);
  }
  if (item.last_error) {
    const error = document.createElement("div");
    error.className = "error small";
    error.textContent = item.last_error;
    parts.push(error);
  }
  cell.replaceChildren(...parts);
}

function poll(table) {
  const url = table.dataset.poll;
  let failures = 0;
  const tick = async () => {
    if (document.hidden) {
      return;
    }
    try {
      const response = await fetch(url, {headers: {Accept: "application/json"},
                                         credentials: "same-origin"});
      if (!response.ok) {
        throw new Error(String(response.status));
      }
      const body = await response.json();
      for (const item of body.items) {
        const cell = table.querySelector(`[data-ws-state="${CSS.escape(item.id)}"]`);
        if (cell && cell.dataset.last !== JSON.stringify(item)) {
          cell.dataset.last = JSON.stringify(item);
          renderState(cell, item);
        }
      }
      failures = 0;
    } catch (_error) {
      failures += 1;
      if (failures >= 5) {
        window.clearInterval(timer);  // signed out or the server is away: stop asking
      }
    }
  };
  const timer = window.setInterval(tick, 3000);
}

document.querySelectorAll("table[data-poll]").forEach(poll);
