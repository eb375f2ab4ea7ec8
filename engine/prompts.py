"""Prompt texts live in engine/prompts/*.txt; this module reads them and lays them into the chat template.

The document sits inside one user turn: `prefix` (system + user turn start + document opening) is prefilled
once, then the segments, raw. Every instruction (margin, answer) is a `suffix` that closes the document and the
user turn and opens the assistant turn, so it can be appended after any segment and cut off again.
"""
from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Callable

PROMPT_DIR = Path(__file__).with_name("prompts")
_SLOT = "\x00SLOT\x00"


@cache
def prompt(name: str) -> str:
    return (PROMPT_DIR / f"{name}.txt").read_text(encoding="utf-8").removesuffix("\n")


def chat_parts(tokenizer, user_text: str) -> tuple[str, str]:
    """Render [system, user: user_text] through the chat template and split it at user_text's {document} slot."""
    messages = [{"role": "system", "content": prompt("system")},
                {"role": "user", "content": user_text.replace("{document}", _SLOT)}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    before, after = rendered.split(_SLOT)
    return before, after


class PromptLayout:
    """Token ids of the fixed pieces around a document, for one tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.prefix_text, tail = chat_parts(tokenizer, prompt("document"))
        # tail = the document's closing (what follows {document} in document.txt) + the template's end of the
        # user turn and start of the assistant's; instructions go between the two.
        self.closing = prompt("document").split("{document}", 1)[1]
        if not tail.startswith(self.closing):
            raise RuntimeError("the chat template altered the document prompt; cannot place instructions")
        self.turn_end = tail[len(self.closing):]
        self.prefix = self.encode(self.prefix_text)

    def window_prefix(self, notes: str) -> list[int]:
        """The prefix of a later window: the earlier parts survive only as margin notes, placed before the
        document opening in the same user turn."""
        before, _ = chat_parts(self.tokenizer, prompt("window").format(margins=notes) + prompt("document"))
        return self.encode(before)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def suffix(self, name: str, **fields) -> list[int]:
        """Close the document, add instruction `name`, end the turn, open the assistant's."""
        return self.encode(self.closing + prompt(name).format(**fields) + self.turn_end)

    def standalone(self, name: str, **fields) -> list[int]:
        """A whole conversation with no document (the classifier's scratch prompt)."""
        messages = [{"role": "system", "content": prompt("system")},
                    {"role": "user", "content": prompt(name).format(**fields)}]
        return self.encode(self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def note_label(segment) -> str:
    """How a note names where it came from: its segment, and its pages when the text has pages."""
    pages = segment.pages
    where = f"segment {segment.index + 1}"
    if pages:
        where += f", page {pages[0]}" if pages[0] == pages[1] else f", pages {pages[0]}-{pages[1]}"
    return where


def note_lines(notes: dict[int, str], used: list[int], label: Callable[[int], str]) -> str:
    """The `used` notes as the answer prompt lists them: one line each, tagged with where it came from."""
    return "\n".join(f"- [{label(i)}] {notes[i]}" for i in used)


def fit_notes(notes: dict[int, str], scores: dict[int, float], build: Callable[[str], list[int]], room: int,
              in_cache: set[int], label: Callable[[int], str] = lambda i: f"segment {i + 1}"
              ) -> tuple[list[int], list[int], list[int]]:
    """(ids, used, dropped): the prompt `build(lines)` made with as many of `notes` (segment index -> text, in
    text order) as fit in `room` tokens. Given up first, when not all fit: notes on segments whose text is in
    the cache anyway (the prompt follows that text), then the lowest `scores` (1.0 where missing), then the
    earliest. A whole novel has ~130 kept margins and room for ~25: keeping the first 25 would lose every late
    chapter. Each note is one line, in text order, tagged with `label(index)` (where it came from), so that
    an answer can cite it."""
    give_up = iter(sorted(notes, key=lambda i: (i not in in_cache, scores.get(i, 1.0), i)))
    used, dropped = list(notes), []
    while True:
        ids = build(note_lines(notes, used, label))
        if len(ids) <= room or not used:
            return ids, used, sorted(dropped)
        victim = next(give_up)
        used.remove(victim)
        dropped.append(victim)
