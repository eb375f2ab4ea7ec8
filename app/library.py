"""The library: this browser's documents and their readings (or, logged in on a Space, the account's), as HTML
(the data comes from Store.library).

Each reading row carries data-session; its buttons carry data-action (open | continue | delete), which
static/library.js sends to the server. Documents are grouped in the order of their most recently opened reading.
The library says whose it is in data-owner: `account` or `browser`.
"""
from __future__ import annotations

import datetime

from .render import esc

ACCOUNT = "hf:"  # the owner of a logged-in account's sessions: ACCOUNT + its Hugging Face username


def _when(iso: str | None) -> str:
    try:
        return datetime.datetime.fromisoformat(iso).astimezone().strftime("%d %b %Y %H:%M")
    except (TypeError, ValueError):
        return "—"


def _size(row: dict) -> str:
    if row["pages"]:
        return f"{row['pages']:,} page{'s' if row['pages'] != 1 else ''}"
    if row["tokens"]:
        return f"{row['tokens']:,} tokens"
    return f"{row['chars']:,} characters"


def _status(row: dict, running: set[str]) -> str:
    if row["id"] in running:
        return "reading"
    if row["segments_total"] and row["segments_read"] >= row["segments_total"]:
        return "read"
    return "stopped" if row["segments_read"] else "not started"


def library_html(rows: list[dict], running: set[str] = frozenset(), current: str | None = None,
                 owner: str | None = None) -> str:
    """`rows`: Store.library(owner), last opened first. `running`: sessions with an engine job now.
    `current`: the session on screen (marked as such). `owner`: whose library it is (None: not known yet)."""
    account = owner[len(ACCOUNT):] if owner and owner.startswith(ACCOUNT) else None
    whose = "" if owner is None else f' data-owner="{"account" if account else "browser"}"'
    head = (f'<div class="mg-library-account">Signed in as {esc(account)}: these readings follow your account to '
            'any browser where you sign in.</div>' if account else "")
    if not rows:
        return (f'<div class="mg-library mg-library-empty"{whose}>{head}Your library is empty: the documents you '
                'read here are listed with their progress, to open or continue later.</div>')
    docs: dict[int, list[dict]] = {}
    for row in rows:
        docs.setdefault(row["document_id"], []).append(row)
    out = []
    for doc_id, readings in docs.items():
        first = readings[0]
        title = first["title"] or first["document_name"]
        items = []
        for r in readings:
            total, read = r["segments_total"] or 0, r["segments_read"] or 0
            pct = 0 if not total else round(100 * read / total)
            status = _status(r, running)
            can_continue = status == "stopped" and r["id"] not in running
            question = r["question"] or "(no question)"
            buttons = ['<button type="button" class="mg-lib-btn" data-action="open">Open</button>']
            if can_continue:
                buttons.append('<button type="button" class="mg-lib-btn" data-action="continue">Continue</button>')
            if r["id"] not in running:
                buttons.append('<button type="button" class="mg-lib-btn mg-lib-delete" data-action="delete">'
                               'Delete</button>')
            here = ' data-current="1"' if r["id"] == current else ""
            items.append(
                f'<li class="mg-reading" data-session="{esc(r["id"])}" data-read="{read}" data-total="{total}" '
                f'data-status="{status}"{here}>'
                f'<div class="mg-reading-q">“{esc(question)}”</div>'
                f'<div class="mg-reading-progress" title="{read} of {total} segments read">'
                f'<div class="mg-progress"><div class="mg-progress-bar" style="width:{pct}%"></div></div>'
                f'<span class="mg-reading-count">{read} / {total} segments · {esc(status)}</span></div>'
                f'<div class="mg-reading-facts">{r["kept"]} margin{"s" if r["kept"] != 1 else ""} kept · '
                f'{r["answers_count"]} question{"s" if r["answers_count"] != 1 else ""} asked · '
                f'opened {esc(_when(r["opened"]))} · {esc(r["model"] or "?")}</div>'
                f'<div class="mg-reading-actions">{"".join(buttons)}</div></li>')
        out.append(
            f'<section class="mg-libdoc" data-document="{doc_id}"><header><span class="mg-libdoc-title">'
            f'{esc(title)}</span><span class="mg-libdoc-meta">{esc(first["kind"].upper())} · {esc(_size(first))}'
            f' · {esc(first["document_name"])}</span></header><ul>{"".join(items)}</ul></section>')
    return f'<div class="mg-library"{whose}>{head}{"".join(out)}</div>'
