"""The data app/'s service hands the screen and the API: records of what a session, a document, a passage and the
library hold, and the typed events a reading or an answer streams. No HTML here: app/render.py draws them."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine import Settings

# ---------------------------------------------------------------- the margin panel


@dataclass
class Card:
    """One margin as the panel shows it."""
    index: int
    pages: tuple[int, int] | None = None
    text: str = ""
    verdict: bool | None = None     # the classifier's
    score: float | None = None
    mark: bool | None = None        # the reader's override
    done: bool = False              # False while the margin is being written

    @property
    def effective(self) -> bool | None:
        return self.mark if self.mark is not None else self.verdict


@dataclass
class SegmentInfo:
    index: int
    tokens: int
    pages: tuple[int, int] | None = None


@dataclass
class Panel:
    """Everything the right-hand panel shows for one session."""
    session_id: str = ""
    status: str = "idle"   # idle | queued | reading | stopping | stopped | interrupted | done | error | answering
    message: str = ""
    segments: list[SegmentInfo] = field(default_factory=list)
    cards: dict[int, Card] = field(default_factory=dict)
    read: set[int] = field(default_factory=set)      # segments in the cache (or skipped on resume)
    current: int | None = None                        # segment being read or written about
    tokens_per_s: float | None = None
    # A server backend: share of the prompt tokens sent that the server found in its prefix cache (None: local).
    reuse: float | None = None
    eta_s: float | None = None
    used: set[int] = field(default_factory=set)      # margins the latest answer used
    window: int = 0        # context window being read (0: the first; a long text is read in several)
    classifier: str = "llm"
    kind: str | None = None  # the document's (pdf, txt, ...): a PDF's and a text's notes are shown reflowed
    ready: bool = True   # False only in the page's initial HTML, before the load event has run

    @property
    def total(self) -> int:
        return len(self.segments)

    @property
    def done_count(self) -> int:
        """Segments finished: read, and their margin written (or kept from before)."""
        return sum(1 for i in self.read if i in self.cards and self.cards[i].done)


@dataclass
class AnswerView:
    question: str
    text: str = ""
    used: list[int] = field(default_factory=list)
    pages: dict[int, tuple[int, int] | None] = field(default_factory=dict)
    done: bool = True
    note: str = ""
    seconds: float | None = None
    reasoning: str = ""  # what the answer said before "Answer:", folded under it


# ---------------------------------------------------------------- the document, its segments and passages


@dataclass
class SegmentView:
    """One segment of a document in its context (the document's whole text, shown around start:end)."""
    text: str
    start: int
    end: int
    index: int
    total: int
    pages: tuple[int, int] | None = None
    tokens: int | None = None
    label: str = "Now reading"
    kind: str | None = None


@dataclass
class DocumentCard:
    """What the document card says of a document under some settings, before it is read."""
    title: str
    kind: str
    name: str
    pages: int | None
    chars: int
    tokens: int | None
    segments: int | None
    segment_tokens: int
    estimate_s: float | None
    problem: str = ""   # why it cannot be read with these settings (then tokens and segments are None)
    note: str = ""      # how it will be read, e.g. "read in 3 windows"
    warning: str = ""   # readable, but the reader should know before pressing Read


@dataclass
class PassageView:
    """A segment with the spans its margin copied (the whole segment when it copied none)."""
    text: str
    kind: str
    start: int
    end: int
    index: int
    total: int
    pages: tuple[int, int] | None = None
    spans: list = field(default_factory=list)
    margin: str | None = None   # the margin's text; None when the segment has no margin yet


@dataclass
class PageView:
    """A PDF page with boxes over the passage's characters, or why there is none (`image` None)."""
    image: dict | None = None    # PageImages.page(): png, width, height, boxes
    page_no: int | None = None
    pages_total: int | None = None
    message: str = ""
    continues: int | None = None  # the last page the passage runs on to


@dataclass
class Passage:
    """A margin's passage as text and as its page (`text` None: no passage chosen)."""
    text: PassageView | None
    page: PageView


# ---------------------------------------------------------------- a session, the library


@dataclass
class SessionView:
    """Everything the screen shows for one stored session."""
    session_id: str
    document_id: int
    question: str
    settings: Settings
    document: DocumentCard | None
    panel: Panel
    answers: list[AnswerView]
    segment: SegmentView | None
    resume: bool
    notice: str
    passage: Passage
    position: int | None


@dataclass
class LibraryView:
    """The owner's readings (Store.library rows, last opened first) and what runs now."""
    rows: list[dict]
    running: set[str] = field(default_factory=set)
    current: str | None = None   # the session on screen
    account: str | None = None   # the logged-in account's name, if the library is an account's
    known: bool = False          # whose library it is is known (False before the page's load event)


# ---------------------------------------------------------------- what a reading or an answer streams


@dataclass
class JobStarted:
    """The engine took the job: Resume does not apply while it runs."""
    panel: Panel


@dataclass
class PanelChanged:
    panel: Panel
    segment: SegmentView | None = None  # the segment now read, when it changed


@dataclass
class AnswersChanged:
    answers: list[AnswerView]  # newest first; the first one may still be written


@dataclass
class Answered:
    answer: AnswerView  # saved


@dataclass
class Message:
    text: str            # "" clears the notice
    kind: str = "error"  # error | info


@dataclass
class JobEnded:
    """The job is over (its session changed in the library), with the panel and answers as it left them: one
    event, so that the screen repaints them and the library at once."""
    resume: bool         # whether Resume applies now
    session: dict        # the stored session after it (Store.get_session)
    panel: Panel | None = None
    answers: list[AnswerView] | None = None


Update = JobStarted | PanelChanged | AnswersChanged | Answered | Message | JobEnded
