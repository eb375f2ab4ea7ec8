"""A session exported for the reader: everything about it as JSON, and a readable Markdown report."""
from __future__ import annotations

import bisect
import json

from .storage import Store


def _spans_out(doc: dict, margin: dict) -> list[dict]:
    """A margin's passages for the exports: offsets, pages and the text they cover. A margin that copied none
    is quoted by its whole segment (`whole`: true), as the passage view highlights it."""
    spans = margin["spans"] or []
    whole = not spans
    if whole:
        spans = [(margin["char_start"], margin["char_end"])] if margin["char_end"] is not None else []
    starts = doc.get("page_starts")
    out = []
    for start, end in spans:
        item = {"start": start, "end": end, "text": doc["text"][start:end], "whole_segment": whole}
        if starts:
            item["page_start"] = bisect.bisect_right(starts, start)
            item["page_end"] = bisect.bisect_right(starts, max(start, end - 1))
        out.append(item)
    return out


QUOTE_CHARS = 600  # a whole segment quoted in the Markdown export is cut here


def _quote(margin: dict) -> list[str]:
    """Markdown blockquote of the margin's passage(s), with their pages."""
    lines = []
    for span in margin["spans"]:
        text = " ".join(span["text"].split())
        if span["whole_segment"] and len(text) > QUOTE_CHARS:
            text = text[:QUOTE_CHARS].rsplit(" ", 1)[0] + " …"
        if "page_start" in span:
            pages = span["page_start"] if span["page_end"] == span["page_start"] else \
                f"{span['page_start']}–{span['page_end']}"
            text += f" (p. {pages})"
        if lines:
            lines.append(">")
        lines.append("> " + text)
    return lines


def as_json(store: Store, session_id: str, owner: str | None = None) -> dict:
    """Everything about one session, JSON-serialisable. KeyError if absent (or not owner's)."""
    session = store.get_session(session_id, owner)
    if session is None:
        raise KeyError(session_id)
    doc = store.get_document(session["document_id"])
    return {
        "format": "marginalia/1",
        "document": {k: doc[k] for k in ("title", "name", "kind", "pages", "chars", "sha256")},
        "question": session["question"],
        "model": session["model"],
        "settings": session["settings"].to_dict(),
        "status": session["status"],
        "segments_total": session["segments_total"],
        "segments_read": session["segments_read"],
        "created": session["created"],
        "updated": session["updated"],
        "margins": [
            {**{k: m[k] for k in ("segment_index", "char_start", "char_end", "page_start",
                                  "page_end", "text", "verdict", "score", "mark", "effective")},
             "spans": _spans_out(doc, m)}
            for m in store.margins(session_id)
        ],
        "answers": [
            {k: a[k] for k in ("question", "text", "reasoning", "margins_used", "seconds", "created")}
            for a in store.answers(session_id)
        ],
    }

def markdown(store: Store, session_id: str, owner: str | None = None) -> str:
    """A readable report: answers first, then every margin note with its verdict and pages."""
    data = as_json(store, session_id, owner)
    doc = data["document"]
    out = [f"# {doc['title'] or doc['name']}", ""]
    if data["question"]:
        out += [f"**Question:** {data['question']}", ""]
    out += [f"*{doc['name']} · model {data['model']} · {data['segments_read']}/"
            f"{data['segments_total']} segments read · {data['status']}*", ""]
    if data["answers"]:
        out += ["## Answers", ""]
        for a in data["answers"]:
            out += [f"### {a['question']}", "", a["text"], ""]
            if a["reasoning"]:
                out += [f"*How it was found: {a['reasoning']}*", ""]
            if a["margins_used"]:
                out += [f"*Margins used: segments {', '.join(str(i + 1) for i in a['margins_used'])}*", ""]
    out += ["## Margin notes", ""]
    for m in data["margins"]:
        head = f"### Segment {m['segment_index'] + 1}"
        if m["page_start"] is not None:
            pages = m["page_start"] if m["page_end"] in (None, m["page_start"]) \
                else f"{m['page_start']}–{m['page_end']}"
            head += f" · p. {pages}"
        if m["effective"] is not None:
            head += " · relevant" if m["effective"] else " · not relevant"
            if m["mark"] is not None:
                head += " (reader)"
            elif m["score"] is not None:
                head += f" ({m['score']:.2f})"
        out += [head, "", m["text"], "", *_quote(m), ""]
    out += ["## Settings", "", "```json", json.dumps(data["settings"], indent=2, sort_keys=True),
            "```", ""]
    return "\n".join(out)
