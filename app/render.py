"""HTML for Marginalia's screen, drawn from app/records.py's records: the margin panel (progress, reading map,
cards), the segment being read, the answers, the document card, a margin's passage and page, the library and
notices.

Every piece of text that comes from a document, a model or a user goes through `esc()`: documents and
margins are shown as text, never interpreted as HTML. Numbers and fixed words are formatted here too,
so the Gradio layer only moves strings around.
"""
from __future__ import annotations

import base64
import datetime
import html
import math

from engine.attribution import CITATION, cited

from .records import AnswerView, Card, DocumentCard, LibraryView, PageView, Panel, PassageView, SegmentInfo, \
    SegmentView


# Segment numbers on screen are 1-based (the engine's indexes are 0-based).


def esc(text: object) -> str:
    return html.escape("" if text is None else str(text), quote=True)


def pages_label(pages: tuple[int, int] | list[int] | None) -> str:
    """(3, 3) -> 'p. 3'; (3, 5) -> 'pp. 3–5'; None -> ''."""
    if not pages or pages[0] is None:
        return ""
    first, last = pages[0], pages[1] if len(pages) > 1 and pages[1] is not None else pages[0]
    return f"p. {first}" if first == last else f"pp. {first}–{last}"


def duration(seconds: float | None) -> str:
    """Rough human duration: '8 s', '1 min 20 s', '12 min', '1 h 05 min'."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "—"
    seconds = int(math.ceil(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, secs = divmod(seconds, 60)
    if minutes < 10:
        return f"{minutes} min {secs:02d} s" if secs else f"{minutes} min"
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


# ---------------------------------------------------------------- what the panel shows

def _verdict_label(card: Card, classifier: str) -> str:
    if not card.done:
        return "writing…"
    if card.verdict is None:
        return "no automatic verdict" if classifier == "none" else "auto: —"
    word = "relevant" if card.verdict else "not relevant"
    return f"auto: {word}" + (f" · {card.score:.2f}" if card.score is not None else "")


def _cell_state(panel: Panel, seg: SegmentInfo) -> str:
    card = panel.cards.get(seg.index)
    if card is not None and card.done:
        eff = card.effective
        return "neutral" if eff is None else "relevant" if eff else "irrelevant"
    if seg.index == panel.current and panel.status in ("reading", "stopping", "answering"):
        return "reading"
    if seg.index in panel.read:
        return "read"
    return "unread"


def _bit(value: bool | None) -> str:
    return "" if value is None else "1" if value else "0"


_LINE_END_PUNCT = tuple('.!?:;"”’)]')


def reflow(text: str, start: int, end: int, dehyphenate: bool = False) -> list[str]:
    """How to show each character of text[start:end], one string per character (so offsets stay as they are).

    A line break inside a paragraph becomes a space; it stays a break after a blank line (the paragraph's
    end) and after a short line that ends a sentence (a PDF paragraph's last line, a heading). With
    `dehyphenate`, "exam-\\nple" shows as "example" (a letter, a hyphen at the line's end, a lower-case letter)."""
    piece = text[start:end]
    out = list(piece)
    lines = piece.split("\n")
    lengths = sorted(len(line.strip()) for line in lines if line.strip())
    full = lengths[int(0.9 * (len(lengths) - 1))] if lengths else 0  # a full line's length, near enough
    pos = 0
    for n, line in enumerate(lines[:-1]):
        nl = pos + len(line)  # index of this line's "\n" in piece
        nxt = lines[n + 1]
        stripped = line.rstrip()
        if not stripped or not nxt.strip():
            pos = nl + 1
            continue  # a blank line on either side: a paragraph break, kept
        short = len(stripped.strip()) < 0.7 * full
        if dehyphenate and len(stripped) >= 2 and stripped[-1] == "-" and stripped[-2].isalpha() \
                and nxt.lstrip()[:1].islower() and len(stripped) == len(line):
            out[nl - 1] = ""   # the hyphen
            out[nl] = ""       # the break
        elif short and stripped.endswith(_LINE_END_PUNCT):
            pass               # a paragraph's last line or a heading: keep the break
        elif short and not stripped.endswith((",", "-")) and nxt.lstrip()[:1].isupper() and len(stripped) < 40:
            pass               # a short title line before a capitalised one
        else:
            out[nl] = " "
        pos = nl + 1
    return out


def reflowed(text: str, kind: str | None) -> str:
    """`text` as the screen shows it: a PDF's or a plain text's line ends inside a paragraph joined (a PDF's
    end-of-line hyphens undone too), as in the Passage view; Markdown and EPUB text keep their breaks."""
    if kind not in ("pdf", "txt"):
        return text
    return "".join(reflow(text, 0, len(text), dehyphenate=kind == "pdf"))


def card_html(card: Card, classifier: str, used: bool = False, kind: str | None = None) -> str:
    eff = card.effective
    pages = pages_label(card.pages)
    state = "done" if card.done else "writing"
    disabled = "" if card.done else " disabled"
    if card.text:
        text = esc(reflowed(card.text, kind))
    else:
        text = '<span class="mg-empty">(the model wrote nothing)</span>' if card.done else ""
    used_attr = ' data-used="1"' if used else ""
    pages_span = f'<span class="mg-pages">{esc(pages)}</span>' if pages else ""
    used_badge = '<span class="mg-used-badge">used in answer</span>' if used else ""
    yours = '<span class="mg-yours">your call</span>' if card.mark is not None else ""
    relevant_pressed = "true" if eff is not False else "false"
    irrelevant_pressed = "true" if eff is False else "false"
    return (
        f'<article class="mg-card" id="mg-card-{card.index}" data-index="{card.index}" data-state="{state}" '
        f'data-verdict="{_bit(card.verdict)}" data-mark="{_bit(card.mark)}" data-effective="{_bit(eff)}"'
        f'{used_attr}>'
        f'<header class="mg-card-head"><span class="mg-seg">Segment {card.index + 1}</span>{pages_span}'
        f'<span class="mg-verdict">{esc(_verdict_label(card, classifier))}</span>{used_badge}</header>'
        f'<p class="mg-text">{text}</p>'
        f'<div class="mg-toggle" role="group" aria-label="Your verdict for segment {card.index + 1}">'
        f'<button type="button" class="mg-flip" data-mark="1" aria-pressed="{relevant_pressed}"{disabled}>'
        f'Relevant</button>'
        f'<button type="button" class="mg-flip" data-mark="0" aria-pressed="{irrelevant_pressed}"{disabled}>'
        f'Irrelevant</button>{yours}'
        f'</div></article>'
    )


def panel_html(panel: Panel) -> str:
    total, done = panel.total, panel.done_count
    pct = 0 if not total else round(100 * done / total, 1)
    cells = []
    for seg in panel.segments:
        state = _cell_state(panel, seg)
        card = panel.cards.get(seg.index)
        flipped = card is not None and card.done and card.mark is not None
        label = f"Segment {seg.index + 1}" + (f" · {pages_label(seg.pages)}" if seg.pages else "") + f" · {state}"
        flipped_attr = ' data-flipped="1"' if flipped else ""
        cells.append(
            f'<button type="button" class="mg-cell" data-index="{seg.index}" data-state="{state}"{flipped_attr} '
            f'style="flex:{max(seg.tokens, 1)} 1 0px" title="{esc(label)}" aria-label="{esc(label)}"></button>')
    done_cards = [c for c in panel.cards.values() if c.done]
    kept = sum(1 for c in done_cards if c.effective is not False and c.text)
    meta = [f'<span class="mg-count-read">{done} / {total} segments</span>' if total else ""]
    if panel.tokens_per_s:
        meta.append(f"<span>{panel.tokens_per_s:,.0f} tokens/s</span>")
    if panel.reuse is not None:
        meta.append(f'<span class="mg-reuse" title="Prompt tokens the model server found already computed in its '
                    f'prefix cache, of all it was sent for this reading.">server reuse {panel.reuse:.0%}</span>')
    if panel.status in ("reading", "queued") and panel.eta_s is not None:
        meta.append(f"<span>about {esc(duration(panel.eta_s))} left</span>")
    if panel.window:
        meta.append(f'<span class="mg-window" title="The text read before this window is no longer in the model\'s '
                    f'cache: the answer sees it only through the margin notes.">window {panel.window + 1} · '
                    f'earlier text held only in margins</span>')
    cards = "".join(card_html(panel.cards[i], panel.classifier, i in panel.used, panel.kind) for i in sorted(panel.cards))
    if not cards:
        cards = ('<div class="mg-placeholder">Margin notes appear here, one per segment, as the model writes '
                 'them. Mark each one relevant or not: the answer uses the ones you keep.</div>')
    selection = ""
    if done_cards:
        selection = (f'<div class="mg-selection"><strong class="mg-kept">{kept}</strong> of '
                     f'{len(done_cards)} margins marked relevant — Answer uses these.</div>')
    legend = ('<div class="mg-legend"><span data-state="relevant">relevant</span>'
              '<span data-state="irrelevant">not relevant</span><span data-state="reading">reading</span>'
              '<span data-state="unread">not read yet</span></div>') if total else ""
    return (
        f'<div class="mg-panel" data-session="{esc(panel.session_id)}" data-status="{esc(panel.status)}" '
        f'data-read="{done}" data-total="{total}" data-ready="{1 if panel.ready else 0}">'
        f'<div class="mg-status" role="status" aria-live="polite"><span class="mg-dot"></span>'
        f'<span class="mg-status-text">{esc(panel.message or _default_message(panel))}</span></div>'
        f'<div class="mg-progress" role="progressbar" aria-label="Segments read" aria-valuemin="0" '
        f'aria-valuemax="{total}" aria-valuenow="{done}"><div class="mg-progress-bar" style="width:{pct}%">'
        f'</div></div>'
        f'<div class="mg-progress-meta">{"".join(meta)}</div>'
        f'<div class="mg-map" aria-label="Reading map: one cell per segment">{"".join(cells)}</div>'
        f'{legend}{selection}{KEYS_HELP if done_cards else ""}'
        f'<div class="mg-cards">{cards}</div></div>'
    )


KEYS_HELP = ('<div class="mg-keys">Click a card to see its passage. Keys: <kbd>j</kbd>/<kbd>k</kbd> next/previous '
             'margin · <kbd>r</kbd> relevant · <kbd>x</kbd> irrelevant · <kbd>o</kbd> open passage</div>')


def _default_message(panel: Panel) -> str:
    total, done = panel.total, panel.done_count
    return {
        "idle": "Upload a document, ask a question, press Read." if not total else f"{done} of {total} segments read.",
        "queued": "Waiting for the reader…",
        "reading": f"Reading segment {(panel.current or 0) + 1} of {total}…",
        "stopping": "Stopping…",
        "stopped": f"Stopped after {done} of {total} segments. The margins so far are saved: "
                   "answer from them, or Resume.",
        "interrupted": f"Interrupted after {done} of {total} segments. Resume to continue.",
        "done": f"Read all {total} segments.",
        "answering": "Answering…",
        "error": "Something went wrong.",
    }.get(panel.status, "")


def empty_panel(ready: bool = True) -> str:
    return panel_html(Panel(ready=ready))


# ---------------------------------------------------------------- the segment being read

def segment_html(text: str, start: int, end: int, index: int, total: int, pages=None, tokens: int | None = None,
                 context: int = 240, label: str = "Now reading", kind: str | None = None) -> str:
    """The current segment, with a little of the text around it (dimmed), reflowed as `reflowed` does."""
    lo = max(0, start - context)
    shown = reflow(text, lo, min(len(text), end + context), dehyphenate=kind == "pdf") \
        if kind in ("pdf", "txt") else list(text[lo:end + context])
    before, current, after = ("".join(shown[:start - lo]), "".join(shown[start - lo:end - lo]),
                              "".join(shown[end - lo:]))
    if start - context > 0:
        before = "…" + before.split(" ", 1)[-1] if " " in before else "…" + before
    if end + context < len(text):
        after = (after.rsplit(" ", 1)[0] if " " in after else after) + "…"
    meta = [f"segment {index + 1} of {total}"]
    if pages:
        meta.append(pages_label(pages))
    if tokens:
        meta.append(f"{tokens:,} tokens")
    return (
        f'<div class="mg-segview" data-index="{index}"><div class="mg-segview-head">'
        f'<span class="mg-segview-label">{esc(label)}</span> {esc(" · ".join(meta))}</div>'
        f'<div class="mg-segview-body"><span class="mg-ctx">{esc(before)}</span>'
        f'<mark class="mg-current">{esc(current)}</mark><span class="mg-ctx">{esc(after)}</span></div></div>'
    )


def empty_segment() -> str:
    return ('<div class="mg-segview mg-segview-empty"><div class="mg-segview-head">'
            '<span class="mg-segview-label">Now reading</span></div>'
            '<div class="mg-segview-body">The text of the segment being read shows here.</div></div>')


def segment_view_html(view: SegmentView | None) -> str:
    if view is None:
        return empty_segment()
    return segment_html(view.text, view.start, view.end, view.index, view.total, view.pages, view.tokens,
                        label=view.label, kind=view.kind)


# ---------------------------------------------------------------- answers

def with_citation_chips(text: str, used: list[int], pages: dict) -> str:
    """The answer's text, escaped, with each inline citation ("[segment 12]") as a chip that opens that passage.
    A cited segment whose note the answer did not use (not kept, or not written) is still a chip, marked."""
    out, at = [], 0
    for match in CITATION.finditer(text):
        out.append(esc(text[at:match.start()]))
        chips = []
        for i in cited(match.group(0), 10**6):
            kept = i in used
            label = f"segment {i + 1}" + (f" · {pages_label(pages[i])}" if pages.get(i) else "")
            title = "Open this passage" if kept else "Open this passage (its note was not kept for the answer)"
            chips.append(f'<span class="mg-cite{"" if kept else " mg-cite-unkept"}" data-index="{i}" '
                         f'data-kept="{int(kept)}" title="{esc(title)}">{esc(label)}'
                         f'{"" if kept else " (note not kept)"}</span>')
        out.append("".join(chips) if chips else esc(match.group(0)))
        at = match.end()
    out.append(esc(text[at:]))
    return "".join(out)


def answers_html(answers: list[AnswerView]) -> str:
    """Newest first."""
    if not answers:
        return ('<div class="mg-answers mg-answers-empty">Answers appear here. Answer uses the margins marked '
                'relevant; ask follow-up questions about the same document without reading it again.</div>')
    out = []
    for a in answers:
        state = "done" if a.done else "writing"
        if a.done:
            if a.used:
                chips = "".join(
                    f'<span class="mg-chip" data-index="{i}">Segment {i + 1}'
                    f'{(" · " + esc(pages_label(a.pages.get(i)))) if a.pages.get(i) else ""}</span>'
                    for i in a.used)
                used = f'<div class="mg-used"><span class="mg-used-label">Used margins:</span> {chips}</div>'
            else:
                used = ('<div class="mg-used"><span class="mg-used-label">Used margins:</span> none — no margin '
                        'was marked relevant, so the answer comes from the text alone.</div>')
        else:
            used = ""
        note = f'<div class="mg-answer-note">{esc(a.note)}</div>' if a.note else ""
        body = (with_citation_chips(a.text, a.used, a.pages) if a.done else esc(a.text)) if a.text else \
            ('<span class="mg-empty">(no answer)</span>' if a.done else "")
        took = f' <span class="mg-took">{esc(duration(a.seconds))}</span>' if a.done and a.seconds else ""
        reasoning = (f'<details class="mg-reasoning"><summary>How the answer was found</summary>'
                     f'{with_citation_chips(a.reasoning, a.used, a.pages)}</details>') if a.done and a.reasoning else ""
        out.append(
            f'<section class="mg-answer" data-state="{state}"><div class="mg-q"><span class="mg-q-label">Q</span>'
            f'{esc(a.question)}{took}</div><div class="mg-a">{body}</div>{reasoning}{note}{used}</section>')
    return f'<div class="mg-answers">{"".join(out)}</div>'


# ---------------------------------------------------------------- document, notices, header

def document_html(title: str, kind: str, name: str, pages: int | None, chars: int, tokens: int | None,
                  segments: int | None, segment_tokens: int | None, estimate_s: float | None,
                  problem: str = "", note: str = "", warning: str = "") -> str:
    facts = [kind.upper()]
    if pages:
        facts.append(f"{pages:,} page{'s' if pages != 1 else ''}")
    facts.append(f"{chars:,} characters")
    if tokens is not None:
        facts.append(f"{tokens:,} tokens")
    if segments is not None:
        facts.append(f"{segments} segment{'s' if segments != 1 else ''} of ≤{segment_tokens:,} tokens")
    if estimate_s is not None:
        facts.append(f"about {duration(estimate_s)} to read here")
    warn = f'<div class="mg-doc-problem" role="alert">{esc(problem)}</div>' if problem else ""
    if warning:  # readable, but the reader should know before pressing Read
        warn += f'<div class="mg-doc-warning" role="alert">{esc(warning)}</div>'
    if note:
        warn += f'<div class="mg-doc-note">{esc(note)}</div>'
    return (f'<div class="mg-doc"><div class="mg-doc-title">{esc(title)}</div>'
            f'<div class="mg-doc-name">{esc(name)}</div>'
            f'<div class="mg-doc-meta">{esc(" · ".join(facts))}</div>{warn}</div>')


def no_document() -> str:
    return '<div class="mg-doc mg-doc-empty">No document yet: upload a .txt, .md, .pdf or .epub file.</div>'


def document_card_html(card: DocumentCard | None) -> str:
    if card is None:
        return no_document()
    return document_html(card.title, card.kind, card.name, card.pages, card.chars, card.tokens, card.segments,
                         card.segment_tokens, card.estimate_s, card.problem, card.note, card.warning)


def notice_html(message: str, kind: str = "error") -> str:
    if not message:
        return ""
    role = "alert" if kind == "error" else "status"
    return f'<div class="mg-notice" data-kind="{esc(kind)}" role="{role}">{esc(message)}</div>'


def header_html(info: dict, startup_s: float | None = None, picked: bool = False) -> str:
    """picked: the model was loaded from the model picker, not at start-up."""
    bits = [info.get("name", "?"), info.get("device", "?"), info.get("dtype", "?")]
    if info.get("context_length"):
        bits.append(f"{int(info['context_length']):,}-token window")
    loaded = info.get("load_seconds")
    moment = "when picked" if picked else "at start-up"
    when = f"loaded once {moment} in {loaded:.1f} s" if isinstance(loaded, (int, float)) else f"loaded {moment}"
    return (
        '<div class="mg-header"><div class="mg-brand"><span class="mg-logo" aria-hidden="true">¶</span>'
        '<div><h1>Marginalia</h1><p>Reads your document segment by segment, writes a note in the margin after '
        'each, and answers from the notes you keep.</p></div></div>'
        f'<div class="mg-model" title="{esc(when)}"><span class="mg-model-dot"></span>{esc(" · ".join(bits))}'
        f'<span class="mg-model-when">{esc(when)}</span></div></div>'
    )


def model_choice_label(m: dict) -> str:
    """One line of the model picker: name · size · window · speed (as measured on this machine)."""
    bits = [m["name"]]
    if m.get("parameters"):
        bits.append(f"{m['parameters'] / 1e9:.2f} B parameters" if m["parameters"] >= 1e9
                    else f"{m['parameters'] / 1e6:,.0f} M parameters")
    if m.get("file_bytes"):
        bits.append(f"{m['file_bytes'] / 2**30:.2f} GB" if m["file_bytes"] >= 2**30
                    else f"{m['file_bytes'] / 2**20:,.0f} MB")
    if m.get("context_length"):
        bits.append(f"{m['context_length']:,}-token window")
    rates = m.get("rates")
    if rates:
        bits.append(f"writes ≈ {rates['decode']:,.1f} tok/s, reads ≈ {rates['prefill']:,.0f} tok/s")
    else:
        bits.append("speed not measured yet")
    return " · ".join(bits)


def model_info_html(info: dict, rates: dict | None = None) -> str:
    rows = [("Model", info.get("name")), ("Device", info.get("device")), ("Precision", info.get("dtype")),
            ("Attention", info.get("attention")), ("Decode weights", info.get("decode_weights")),
            ("Prefill weights", info.get("prefill_weights")),
            ("Context window", f"{int(info['context_length']):,} tokens" if info.get("context_length") else None),
            ("Parameters", f"{int(info['parameters']) / 1e6:,.0f} M" if info.get("parameters") else None),
            ("Loaded in", f"{info['load_seconds']:.1f} s" if info.get("load_seconds") is not None
             else None)]
    if rates:
        rows.append(("Measured speed", f"prefill ≈ {rates['prefill']:,.0f} tokens/s, "
                                       f"writing ≈ {rates['decode']:,.1f} tokens/s"))
    body = "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in rows if v is not None)
    return f'<dl class="mg-modelinfo">{body}</dl>'


# ---------------------------------------------------------------- a margin's passage and page

CONTEXT_CHARS = 300          # text shown (dimmed) before and after the passage's segment

def _clip(spans, lo: int, hi: int) -> list[tuple[int, int]]:
    out = []
    for s, e in spans or ():
        s, e = max(int(s), lo), min(int(e), hi)
        if e > s:
            out.append((s, e))
    return sorted(out)


def _window(text: str, seg_start: int, seg_end: int, context: int) -> tuple[int, int]:
    """The shown stretch: the segment and `context` characters either side, cut at whitespace."""
    lo, hi = max(0, seg_start - context), min(len(text), seg_end + context)
    if lo > 0:
        cut = text.find(" ", lo, seg_start)
        lo = cut + 1 if cut != -1 else lo
    if hi < len(text):
        cut = text.rfind(" ", seg_end, hi)
        hi = cut if cut != -1 else hi
    return lo, hi


def passage_html(text: str, kind: str, seg_start: int, seg_end: int, index: int, total: int,
                 pages: tuple[int, int] | None = None, spans=(), margin: str | None = None,
                 context: int = CONTEXT_CHARS) -> str:
    """One segment of the document, with the margin's spans highlighted (the whole segment when it has none).
    `margin`: the margin's text; None when the segment has no margin yet.

    Each highlight is a <mark class="mg-span"> carrying data-start/data-end, the offsets it covers."""
    spans = _clip(spans, seg_start, seg_end)
    whole = not spans
    marks = spans or [(seg_start, seg_end)]
    lo, hi = _window(text, seg_start, seg_end, context)
    shown = reflow(text, lo, hi, dehyphenate=kind == "pdf") if kind in ("pdf", "txt") else list(text[lo:hi])
    cuts = sorted({lo, hi, seg_start, seg_end, *(x for s in marks for x in s)})
    parts = ["…" if lo > 0 else ""]
    for a, b in zip(cuts, cuts[1:]):
        shown_text = esc("".join(shown[a - lo:b - lo]))
        if any(s <= a and b <= e for s, e in marks):
            parts.append(f'<mark class="mg-span" data-start="{a}" data-end="{b}">{shown_text}</mark>')
        elif seg_start <= a and b <= seg_end:
            parts.append(f'<span class="mg-seg-text">{shown_text}</span>')
        else:
            parts.append(f'<span class="mg-ctx">{shown_text}</span>')
    parts.append("…" if hi < len(text) else "")
    meta = [f"segment {index + 1} of {total}"]
    if pages:
        meta.append(pages_label(pages))
    if margin is None:
        meta.append("no margin yet: whole segment highlighted")
    elif whole:
        meta.append("whole segment highlighted: this margin copied no passage")
    else:
        meta.append(f"{len(spans)} passage{'s' if len(spans) != 1 else ''} the margin copied highlighted")
    note = f'<div class="mg-passage-margin"><span>Margin</span> {esc(margin)}</div>' if margin else ""
    return (f'<div class="mg-segview mg-passage" data-index="{index}" data-whole="{1 if whole else 0}" '
            f'data-start="{seg_start}" data-end="{seg_end}"><div class="mg-segview-head">'
            f'<span class="mg-segview-label">Passage</span> {esc(" · ".join(meta))}</div>{note}'
            f'<div class="mg-segview-body mg-reflowed">{"".join(parts)}</div></div>')


def empty_passage() -> str:
    return ('<div class="mg-segview mg-passage mg-segview-empty"><div class="mg-segview-head">'
            '<span class="mg-segview-label">Passage</span></div><div class="mg-segview-body">Click a margin card, '
            'a cell of the reading map or an answer\'s segment chip to see its passage here, highlighted.'
            '</div></div>')


def page_html(result: dict | None, page_no: int | None, pages_total: int | None, message: str = "",
              continues: int | None = None) -> str:
    """The page tab: the rendered page as an inline PNG, or why there is none. `continues`: the last page the
    passage runs on to, when it does not end on this one."""
    if result is None:
        body = esc(message or "Pages show here for PDF documents.")
        return f'<div class="mg-page mg-page-empty">{body}</div>'
    data = base64.b64encode(result["png"]).decode("ascii")
    of = f" of {pages_total}" if pages_total else ""
    w, h = result["width"], result["height"]
    focus = min(b[1] for b in result["boxes"]) / h if result["boxes"] else 0.0
    boxes = "".join(
        f'<span class="mg-box" style="left:{100 * x0 / w:.2f}%;top:{100 * y0 / h:.2f}%;'
        f'width:{100 * (x1 - x0) / w:.2f}%;height:{100 * (y1 - y0) / h:.2f}%"></span>'
        for x0, y0, x1, y1 in result["boxes"])
    n = len(result["boxes"])
    return (f'<div class="mg-page" data-page="{page_no}" data-focus="{focus:.3f}"><div class="mg-segview-head">'
            f'<span class="mg-segview-label">Page {page_no}{of}</span> the passage\'s characters highlighted'
            f'{"" if n else " (none found on this page)"}'
            f'{f" · continues to p. {continues}" if continues and continues > page_no else ""}</div>'
            f'<div class="mg-page-scroll"><div class="mg-page-frame">'
            f'<img class="mg-page-img" data-page="{page_no}" alt="Page {page_no} of the PDF" width="{w}" '
            f'height="{h}" src="data:image/png;base64,{data}">{boxes}</div></div></div>')


def passage_view_html(view: PassageView | None) -> str:
    if view is None:
        return empty_passage()
    return passage_html(view.text, view.kind, view.start, view.end, view.index, view.total, view.pages, view.spans,
                        view.margin)


def page_view_html(view: PageView) -> str:
    return page_html(view.image, view.page_no, view.pages_total, view.message, view.continues)


# ---------------------------------------------------------------- the library

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


def _library_status(row: dict, running: set[str]) -> str:
    if row["id"] in running:
        return "reading"
    if row["segments_total"] and row["segments_read"] >= row["segments_total"]:
        return "read"
    return "stopped" if row["segments_read"] else "not started"


def library_html(library: LibraryView | None = None) -> str:
    """This browser's documents and their readings (or, logged in on a Space, the account's). Each reading row
    carries data-session; its buttons carry data-action (open | continue | delete), which static/library.js sends
    to the server. Documents are grouped in the order of their most recently opened reading. The library says
    whose it is in data-owner: `account` or `browser`."""
    library = library or LibraryView([])
    rows, running, current, account = library.rows, library.running, library.current, library.account
    whose = "" if not library.known else f' data-owner="{"account" if account else "browser"}"'
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
            status = _library_status(r, running)
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
