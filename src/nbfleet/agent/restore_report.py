"""A kernel's restore report, made fit for the agent protocol and for the notebook.

The kernel writes ``restore-report.json`` and user code runs in that kernel, so
the report is untrusted input: :func:`clean_report` keeps only well-formed
entries, cut to size, in the shape of ``protocol.agent.RestoreReport``;
:func:`describe` is what the user reads in the notebook after a resume.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["clean_report", "describe"]

#: Entries kept per list of a restore report, and characters per name or reason: the
#: kernel writes the report (user code runs there); the API and the notebook show it.
REPORT_ENTRIES = 10_000
NAME_CHARS = 200
TEXT_CHARS = 1000
#: Entries of each kind the notebook's resume message names (the API has them all).
DESCRIBE_ENTRIES = 20
#: The ``type`` the kernel gives a setting in its report's ``lost``
#: (``nbfleet.kernel.settings.SETTING``; the agent does not import kernel code).
SETTING_TYPE = "kernel setting"
#: The ``status`` of a value in ``lost`` that came back, but different.
CHANGED = "changed"
#: The kernel's own words for a changed value (``nbfleet.kernel.verify.DIFFERS``).
DIFFERS = "it came back different from the value saved at suspend"


def clean_report(body: dict[str, Any]) -> dict[str, Any]:
    """The kernel's report in the agent protocol's shape (``RestoreReport``).

    User code runs in the kernel and may have written the file, so every entry is
    checked: one of the wrong type is dropped, strings and lists are cut to size;
    nothing in it can fail the resume. The kernel lists a value that came back
    different in ``lost`` too (marked ``status: changed``) and a lost setting as a
    lost value of type ``kernel setting``: here each is in ``changed`` or
    ``settings`` only, so ``lost`` means not defined after the resume.
    """
    changed: dict[str, dict[str, str]] = {}
    lost: list[dict[str, str]] = []
    settings = [{"name": name, "status": "restored"} for name in _names(body.get("settings"))]
    for entry, status in _entries(body.get("lost")):
        if status == CHANGED:
            changed.setdefault(entry["name"], entry)
        elif entry["type"] == SETTING_TYPE:
            settings.append({"name": entry["name"], "status": "lost", "reason": entry["reason"]})
        else:
            lost.append(entry)
    for name in _names(body.get("changed")):  # reported without a reason in ``lost``
        if len(changed) < REPORT_ENTRIES:
            changed.setdefault(name, {"name": name, "type": "?", "reason": DIFFERS})
    restored = [name for name in _names(body.get("restored")) if name not in changed]
    recomputed = [name for name in _names(body.get("recomputed"))
                  if name not in changed and name not in set(restored)]
    placed = set(restored) | set(recomputed) | set(changed)
    report: dict[str, Any] = {
        "restored": restored,
        "changed": list(changed.values()),
        "recomputed": recomputed,
        "lost": [entry for entry in lost if entry["name"] not in placed],
        "settings": settings[:REPORT_ENTRIES],
    }
    if "imports" in body:
        report["imports"] = _names(body["imports"], TEXT_CHARS)
    return report


def _text(value: str, limit: int) -> str:
    """One line of at most ``limit`` characters (control characters become spaces)."""
    value = value[:limit]
    if value.isprintable():
        return value
    return "".join(c if c.isprintable() else " " for c in value)


def _names(value: object, limit: int = NAME_CHARS) -> list[str]:
    """The strings of a list, cut to size; anything else (the list itself too) is dropped."""
    if not isinstance(value, list):
        return []
    strings = (_text(item, limit) for item in value if isinstance(item, str) and item)
    return list(itertools.islice(strings, REPORT_ENTRIES))


def _entries(value: object) -> Iterator[tuple[dict[str, str], str | None]]:
    """The well-formed ``{"name", "type", "reason"}`` entries of a ``lost`` list, each
    with its ``status``; an entry without a string name is dropped."""
    if not isinstance(value, list):
        return
    kept = 0
    for item in value:
        if kept >= REPORT_ENTRIES:
            return
        if not isinstance(item, dict):
            continue
        name, kind, reason = item.get("name"), item.get("type"), item.get("reason")
        if not isinstance(name, str) or not name:
            continue
        kept += 1
        status = item.get("status")
        yield ({"name": _text(name, NAME_CHARS),
                "type": _text(kind, NAME_CHARS) if isinstance(kind, str) and kind else "?",
                "reason": (_text(reason, TEXT_CHARS) if isinstance(reason, str) and reason
                           else "no reason was given")},
               status if isinstance(status, str) else None)


def describe(report: dict[str, Any]) -> str:
    """The lines a user sees in the notebook when the kernel comes back: what came
    back as saved, what came back changed and what did not, each with its reason."""
    if report["files_only"]:
        return f"[nbfleet] Resumed with your files only: {report['error']}.\n"
    restored, recomputed = report["restored"], report["recomputed"]
    changed, lost = report.get("changed", []), report["lost"]
    settings = report.get("settings", [])
    lost_settings = [s for s in settings if s["status"] == "lost"]
    if not restored and not recomputed and not changed and not lost and not lost_settings:
        return ""
    line = f"[nbfleet] Resumed: restored {len(restored)} variables"
    kept = len(settings) - len(lost_settings)
    if kept:
        line += f" and {kept} kernel settings"
    if recomputed:
        line += f", recomputed {_listed(recomputed)}"
    if changed:
        line += f"; {len(changed)} came back changed"
    lines = [line + "."]
    lines += _each(changed, "Changed", lambda item: f"{item['name']} ({item['type']}): "
                                                     f"{item['reason']}")
    lines += _each(lost, "Not restored", lambda item: f"{item['name']} ({item['type']}): "
                                                      f"{item['reason']}")
    lines += _each(lost_settings, "Setting not restored",
                   lambda item: f"{item['name']}: {item.get('reason') or 'no reason was given'}")
    return "".join(f"{text}\n" for text in lines)


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:DESCRIBE_ENTRIES])
    more = len(names) - DESCRIBE_ENTRIES
    return f"{shown} and {more} more" if more > 0 else shown


def _each(items: list[dict[str, Any]], label: str,
          text: Callable[[dict[str, Any]], str]) -> list[str]:
    """One line per item, the first DESCRIBE_ENTRIES only: a notebook is no place for
    thousands (the workspace's restore report has them all)."""
    lines = [f"[nbfleet] {label}: {text(item)}." for item in items[:DESCRIBE_ENTRIES]]
    if len(items) > DESCRIBE_ENTRIES:
        lines.append(f"[nbfleet] {label}: {len(items) - DESCRIBE_ENTRIES} more, listed in "
                     "the workspace's restore report.")
    return lines
