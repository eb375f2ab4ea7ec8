"""Margins a reader can trust: extractive notes are copied from their own segment, at the spans they record.

Faithfulness is checked on real text read by the real model: a slice of each of the five shared books and both
BABILong files whole. Every note must be empty ("nothing relevant") or the exact text at its spans, joined by
single spaces, each span inside the note's own segment."""
from __future__ import annotations

import json
import re
import threading
from types import SimpleNamespace

import pytest

from engine import Margin, MarginToken, Settings, Stats
from engine.generate import REPEAT_NGRAM, DecodeResult, Runner
from engine.attribution import without_citations
from engine.margins import OPENING_TOKENS, Extractive, pieces_of
from tests.conftest import shared

BOOKS = ["pg1342.txt", "pg1661.txt", "pg84.txt", "pg11.txt", "pg1952_yellow_wallpaper_with_pg_header.txt"]
QUESTIONS = {"pg1342.txt": "Who is Mr. Bingley?", "pg1661.txt": "What does Holmes deduce about Watson?",
             "pg84.txt": "Where is Walton's ship sailing?", "pg11.txt": "Why does Alice follow the White Rabbit?",
             "pg1952_yellow_wallpaper_with_pg_header.txt": "What does the narrator think of the wallpaper?"}


def assert_faithful(reading, margins: list[Margin]) -> int:
    """Each note is empty or the text at its spans, in order, joined by spaces, inside its own segment.
    Returns how many notes copied something."""
    copied = 0
    for m in margins:
        seg = reading.segments[m.index]
        if not m.text:
            assert m.spans == () and m.ending == "nothing"
            continue
        copied += 1
        assert m.spans, m
        for start, end in m.spans:
            assert seg.char_start <= start < end <= seg.char_end, (m.index, m.spans, seg)
        assert m.text == " ".join(reading.doc.text[a:b] for a, b in m.spans)
        assert len(set(m.spans)) == len(m.spans)  # no sentence copied twice: no loop
        assert m.ending in ("end", "limit", "proposed")
    return copied


@pytest.mark.slow
@pytest.mark.parametrize("name", BOOKS)
def test_book_margins_are_copied_from_their_segment(engine, name):
    text = shared("books", name).read_text(encoding="utf-8")
    start = len(text) // 3                        # from inside the book, not its front matter
    reading = engine.open(text[start:start + 9000], Settings(segment_tokens=400, margin_tokens=64, classifier="margin"))
    events = list(reading.read(QUESTIONS[name]))
    margins = [e for e in events if isinstance(e, Margin)]
    assert [m.index for m in margins] == list(range(len(reading.segments)))
    assert_faithful(reading, margins)
    for m in margins:  # what streamed into the panel is the note
        assert "".join(e.text for e in events if isinstance(e, MarginToken) and e.index == m.index) == m.text
        assert m.relevant == bool(m.text) and 0.0 <= m.score <= 1.0   # `margin`: a note that copied something is kept


@pytest.mark.slow
@pytest.mark.parametrize("name", ["babilong_8k.json", "babilong_16k.json"])
def test_babilong_margins_are_copied_from_their_segment(engine, name):
    data = json.loads(shared("babilong", name).read_text())
    reading = engine.open(data["context"], Settings(segment_tokens=1024, margin_tokens=64, answer_tokens=64))
    events = list(reading.read(data["query"])) + list(reading.answer(data["query"]))
    margins = [e for e in events if isinstance(e, Margin)]
    assert [m.index for m in margins] == list(range(len(reading.segments)))
    assert assert_faithful(reading, margins) >= 1
    answer = next(e for e in events if e.kind == "answer")
    # Past the window SmolLM2's look-up answer may copy the re-read passages on to its token cap (babilong_16k:
    # 24 tokens of the song's text); the look-up answer has its own tests (test_engine_windows).
    assert answer.text and (answer.ending != "limit" or reading.multiwindow)
    # Copying needs a step only where the sentence trie branches: far fewer decode steps than tokens copied.
    read = next(e for e in events if isinstance(e, Stats))
    assert read.decode_tokens < sum(m.tokens for m in margins)


def test_pieces_tile_the_sentences_and_cap_their_length(engine):
    tok = engine.lm.tokenizer
    text = "Intro.  Mary went to the garden. Then she\nleft!\n\n" + "word " * 300 + "end. Last one"
    pieces = pieces_of(text, 7, len(text), tok, 40)
    assert pieces[0].text == "Mary went to the garden." and pieces[1].text == "Then she\nleft!"
    assert pieces[-1].text == "Last one"
    for p in pieces:
        assert text[p.span[0]:p.span[1]] == p.text and p.text == p.text.strip()
        assert len(p.ids) <= 40 and tok.decode(list(p.ids)) == p.text and tok.decode(list(p.ids_after)) == " " + p.text
    spans = [p.span for p in pieces]
    assert spans == sorted(spans) and all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_a_field_label_starts_a_piece_and_is_not_copied(engine):
    """In notices and forms ("DATES: The FAA must receive comments by ...") the sentence after a line-start
    label is a piece of its own; a colon inside a line ("Mail: U.S.", "note: it") is no label."""
    tok = engine.lm.tokenizer
    text = ("The FAA is proposing this AD.\nDATES: The FAA must receive comments\non this AD by September 21,\n"
            "2020.\nFOR FURTHER INFORMATION CONTACT: Ian Won, FAA.\nSend mail: to the docket.")
    texts = [p.text for p in pieces_of(text, 0, len(text), tok, 64)]
    assert texts == ["The FAA is proposing this AD.",
                     "The FAA must receive comments\non this AD by September 21,\n2020.",
                     "Ian Won, FAA.", "Send mail: to the docket."]


def test_the_federal_register_dates_sentence_is_copyable_on_its_own(engine):
    """The real PDF's page 1: its DATES field is a piece without the label, at the span of that text."""
    from engine.documents import load_document
    doc = load_document(shared("pdf", "federal-register-2020-17221.pdf"))
    pieces = pieces_of(doc.text, 0, doc.page_starts[1], engine.lm.tokenizer, 96)
    dates = [p for p in pieces if "must receive comments" in p.text]
    assert [p.text for p in dates] == ["The FAA must receive comments\non this proposed AD by September 21,\n2020."]
    assert doc.text[dates[0].span[0] - len("DATES: "):dates[0].span[1]].startswith("DATES: The FAA")
    assert not any(p.text in ("DATES:", "SUMMARY:", "ADDRESSES:") for p in pieces)


def test_extractive_note_follows_the_model_within_the_trie(engine):
    """Greedy constrained choice equals the unconstrained argmax whenever that argmax is an allowed token: a
    segment whose sentence the model would copy anyway comes out as that sentence."""
    text = "The key is under the blue flowerpot by the door.\n\n"
    reading = engine.open(text, Settings(segment_tokens=64, margin_tokens=32))
    margins = [e for e in reading.read("Where is the key?") if isinstance(e, Margin)]
    assert margins[0].text == "The key is under the blue flowerpot by the door."
    assert margins[0].spans == ((0, len(text.strip())),) and margins[0].relevant is True


def test_remargin_extractive_equals_a_fresh_read(engine):
    """New-question margins from the cache (masked scratch rows) are the notes a fresh read writes."""
    text = shared("books", "pg11.txt").read_text(encoding="utf-8")
    start = text.index("CHAPTER I.\nDown the Rabbit-Hole")
    text = text[start:start + 5000]
    settings = Settings(segment_tokens=300, margin_tokens=48)
    reading = engine.open(text, settings)
    list(reading.read("Why does Alice follow the White Rabbit?"))
    again = [e for e in reading.remargin("What does Alice find in the hall?") if isinstance(e, Margin)]
    fresh = [e for e in engine.open(text, settings).read("What does Alice find in the hall?") if isinstance(e, Margin)]
    assert [(m.text, m.spans) for m in again] == [(m.text, m.spans) for m in fresh]
    assert [m.score for m in again] == pytest.approx([m.score for m in fresh], abs=1e-3)


def test_scored_margins_are_faithful_too(engine):
    text = shared("books", "pg84.txt").read_text(encoding="utf-8")[20000:26000]
    reading = engine.open(text, Settings(segment_tokens=400, margin_tokens=64, margins="scored"))
    margins = [e for e in reading.read("Where is Walton's ship sailing?") if isinstance(e, Margin)]
    assert_faithful(reading, margins)


def test_free_form_decoding_stops_on_a_loop(engine):
    """A prompt that makes the small model repeat itself: decoding stops at the first repeated 4-gram and the
    result keeps the text before the loop began."""
    runner = Runner(engine.lm.model, engine.lm.tokenizer, engine.lm.device)
    from engine.cache import make_cache
    cache = make_cache(engine.lm.model, 512)
    ids = engine.layout.standalone("answer_plain", query="Repeat the word 'banana' forty times.")
    logits = runner.prefill(ids, cache)
    result = DecodeResult()
    list(runner.decode(cache, logits, 120, result=result))
    assert result.reason in ("repeat", "end")
    grams = [tuple(result.ids[i:i + REPEAT_NGRAM]) for i in range(len(result.ids) - REPEAT_NGRAM + 1)]
    assert len(grams) == len(set(grams))  # no 4-gram twice in what is kept
    assert len(result.ids) < 120
    if result.reason == "repeat":  # the loop's first round is kept: the text goes on until the repeat begins
        assert len(result.ids) >= REPEAT_NGRAM


def test_a_barred_first_token_gives_the_next_likeliest_beginning(engine):
    """decode's `barred_first`: the text begins with the likeliest token not barred, and goes on greedily from
    there (checked against a fresh pass over the prompt and that beginning)."""
    import torch
    from engine.cache import make_cache
    runner = Runner(engine.lm.model, engine.lm.tokenizer, engine.lm.device)
    ids = engine.lm.tokenizer.encode("Alice was beginning to get very tired of sitting by her sister on the")
    cache = make_cache(engine.lm.model, 256)
    logits = runner.prefill(ids, cache)
    ranked = logits.float().argsort(descending=True).tolist()
    result = DecodeResult()
    list(runner.decode(cache, logits, 6, result=result, barred_first={ranked[0]}))
    assert result.ids[0] == ranked[1]
    fresh, greedy = make_cache(engine.lm.model, 256), DecodeResult()
    list(runner.decode(fresh, runner.prefill(ids + [ranked[1]], fresh), 5, result=greedy))
    assert result.ids[1:] == greedy.ids


def test_an_answer_run_to_its_cap_without_a_sentence_end_is_begun_again_once(engine):
    """An answer that reaches its token cap without ending a sentence is taken back and begun with its
    next-likeliest first token; when that one runs away too, the first stands (the same answer as without
    take-backs), and the text shown ends as the answer."""
    from dataclasses import replace
    from engine import Answer, AnswerToken, Settings
    book = shared("books", "pg11.txt").read_text(encoding="utf-8")
    text = book[book.index("CHAPTER I.\nDown"):][:1600]
    capped = Settings(segment_tokens=100, margin_tokens=8, answer_tokens=3, classifier="none")
    query = "Where does Alice fall?"
    without = engine.open(text, replace(capped, answer_retries=0))
    list(without.read(query))
    first = next(e for e in without.answer(query) if isinstance(e, Answer))
    assert first.ending == "limit" and not re.search(r"[.!?]", first.text)  # three tokens: no sentence ends
    reading = engine.open(text, capped)
    list(reading.read(query))
    events = list(reading.answer(query))
    answer = next(e for e in events if isinstance(e, Answer))
    shown = ""
    for e in events:
        if isinstance(e, AnswerToken):
            shown = e.text if e.restart else shown + e.text
    restarts = [e for e in events if isinstance(e, AnswerToken) and e.restart]
    assert len(restarts) == 2 and restarts[0].text == ""  # begun again, then the first put back
    assert answer.text == first.text and shown.strip() == without_citations(answer.text).strip()


def test_a_loop_taken_back_goes_on_from_where_it_began(engine):
    """With `retries`, a loop is not the end: decoding goes back to where it began, bars the token it began with
    there and goes on. Checked against a fresh pass over the prompt and the kept tokens: every token is that
    pass's greedy choice except at the places a loop was taken back, where it is the next-best one. A cache left
    holding the loop's tokens would have changed the tokens after it. The text shown, with each restart applied,
    begins with the text kept."""
    import torch
    from engine.cache import make_cache
    from engine.generate import Rewound
    runner = Runner(engine.lm.model, engine.lm.tokenizer, engine.lm.device)
    # A list come round to its first item (no chat turn: the small model's answers rarely loop on demand).
    ids = engine.lm.tokenizer.encode("The shopping list: apples, pears, plums, apples, pears, plums, apples,")
    looped = DecodeResult()
    cache = make_cache(engine.lm.model, 512)
    list(runner.decode(cache, runner.prefill(ids, cache), 60, result=looped))
    assert looped.reason == "repeat" and looped.retried == 0  # the prompt loops at once without retries

    cache = make_cache(engine.lm.model, 512)
    result, shown, taken_back = DecodeResult(), "", []
    for token, piece in runner.decode(cache, runner.prefill(ids, cache), 60, result=result, retries=3):
        if isinstance(piece, Rewound):
            shown = piece.text
            taken_back.append(piece.tokens)
        else:
            shown += piece
    assert result.retried == len(taken_back) >= 1
    assert shown.startswith(result.text)  # the last loop, once retries are spent, is dropped from the result only
    grams = [tuple(result.ids[i:i + REPEAT_NGRAM]) for i in range(len(result.ids) - REPEAT_NGRAM + 1)]
    assert len(grams) == len(set(grams))  # no 4-gram twice in what is kept
    assert taken_back[0] == len(looped.ids)  # the first loop is where it ends without retries
    assert result.ids[:min(taken_back)] == looped.ids[:min(taken_back)]

    fresh = make_cache(engine.lm.model, 512)
    runner.prefill(ids[:-1], fresh)
    with torch.inference_mode():
        logits = runner.forward([ids[-1], *result.ids[:-1]], fresh, all_logits=True).float()
    ranked = logits.argsort(dim=-1, descending=True)
    for j, token in enumerate(result.ids):
        if token != ranked[j, 0]:  # only where a loop was taken back: then one of the next-best
            assert j in taken_back, f"token {j} is not the greedy choice after the kept tokens"
            assert token in ranked[j, 1:1 + taken_back.count(j)].tolist()


def test_stop_during_an_extractive_margin(engine):
    text = shared("books", "pg1342.txt").read_text(encoding="utf-8")[50000:56000]
    reading = engine.open(text, Settings(segment_tokens=300, margin_tokens=48))
    stop = threading.Event()
    events = []
    for ev in reading.read("Who is Mr. Darcy?", stop):
        events.append(ev)
        if isinstance(ev, Margin) and ev.index == 1:
            stop.set()
    assert events[-1].kind == "stats" and events[-1].stopped
    assert reading.cache.length == reading.doc_end


def test_extractive_writer_never_copies_outside_the_pieces(engine):
    """Whatever the logits say, the writer's choices stay inside the trie or end the note."""
    import torch
    tok = engine.lm.tokenizer
    text = "Anna keeps the ledger. Bob keeps the keys. Anna keeps the lamp lit."
    pieces = pieces_of(text, 0, len(text), tok, 32)
    writer = Extractive(tok, {tok.convert_tokens_to_ids("<|im_end|>")}, 64)

    class RandomScratch:  # logits from a seeded generator: adversarial, but the constraint must hold
        def __init__(self):
            self.g = torch.Generator().manual_seed(7)

        def feed(self, ids, candidates=None):
            return torch.log_softmax(torch.randn(len(tok), generator=self.g), dim=-1)

    for _ in range(20):
        gen = writer.write(RandomScratch(), [1, 2, 3], pieces)
        while True:
            try:
                next(gen)
            except StopIteration as done:
                note = done.value
                break
        if note.text:
            assert note.text == " ".join(text[a:b] for a, b in note.spans)
            assert all(s in [p.span for p in pieces] for s in note.spans)


def _run_writer(writer, scratch, instruction, pieces):
    gen = writer.write(scratch, instruction, pieces)
    while True:
        try:
            next(gen)
        except StopIteration as done:
            return done.value


def test_a_copy_is_chosen_by_its_opening_not_its_first_token(engine):
    """A model that begins any answer with "The" puts most of its first step there; token by token the note
    must then copy a sentence that begins with "The". Chosen by opening, the sentence whose first tokens the
    model finds likeliest is copied whole, and the note goes on only where another copy outweighs ending."""
    import torch
    tok = engine.lm.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    text = "The table was a large one. Mary went back to the hallway. The tea was cold."
    pieces = pieces_of(text, 0, len(text), tok, 32)
    the, mary = pieces[0].ids[0], pieces[1].ids[0]
    none = tok.encode("NONE", add_special_tokens=False)[0]

    class ServerScratch:
        """First step: "The" 0.6, "Mary" 0.3, NONE 0.1; after a copy, ending 0.9. No row scoring."""
        def __init__(self):
            self.fed = []
            self.runner = SimpleNamespace(meter=SimpleNamespace(decode_tokens=0))

        def feed(self, ids, candidates=None):
            self.fed.append(list(ids))
            probs = torch.full((len(tok),), 1e-9)
            if len(self.fed) == 1:
                probs[the], probs[mary], probs[none] = 0.6, 0.3, 0.1
            else:
                probs[end] = 0.9
            return torch.log(probs / probs.sum())

    class LocalScratch(ServerScratch):
        """The same, and a row that opens with Mary's sentence scores best."""
        def __init__(self):
            super().__init__()
            self.scored = []

        def score_rows(self, rows, first):
            self.scored.append(rows)
            return [-0.1 if row[0] == mary else -3.0 for row in rows]

    local = LocalScratch()
    note = _run_writer(Extractive(tok, {end}, 64, choice="opening"), local, [1, 2, 3], pieces)
    assert note.text == "Mary went back to the hallway." and note.ending == "end"
    assert len(local.scored) == 1 and len(local.scored[0]) == 3  # every sentence's opening, in one call
    assert all(len(row) <= OPENING_TOKENS for row in local.scored[0])
    assert local.fed[1] == list(pieces[1].ids)  # the chosen sentence fed whole, no step inside it
    by_token = _run_writer(Extractive(tok, {end}, 64, choice="token"), LocalScratch(), [1, 2, 3], pieces)
    assert by_token.text.startswith("The ")
    # Going on: where another copy's opening is likelier than ending, the note copies it too.
    class GoingOn(LocalScratch):
        def feed(self, ids, candidates=None):
            if not self.fed:
                return super().feed(ids, candidates)
            self.fed.append(list(ids))
            probs = torch.full((len(tok),), 1e-9)
            probs[end], probs[pieces[2].ids_after[0]] = 0.3, 0.6  # " The"
            return torch.log(probs / probs.sum())

        def score_rows(self, rows, first):
            self.scored.append(rows)
            return [-0.1 if row[0] == mary else -0.5 if tok.decode(row).startswith(" The tea") else -3.0
                    for row in rows]

    going = GoingOn()
    note = _run_writer(Extractive(tok, {end}, 64), going, [1, 2, 3], pieces)
    assert note.text.startswith("Mary went back to the hallway. The tea was cold.") and len(going.scored) >= 2
    # A scratch that cannot score rows (a server's) chooses token by token.
    assert _run_writer(Extractive(tok, {end}, 64), ServerScratch(), [1, 2, 3], pieces).text.startswith("The ")


def written_through_ending(tokenizer, text: str, paragraph: bool = False, answer_after: str | None = None
                           ) -> DecodeResult:
    """`text` fed token by token through generate.Ending, as a decode would write it: where it ends, and why."""
    from engine.generate import Ending
    result = DecodeResult()
    ending = Ending(tokenizer, result, paragraph, True, answer_after)
    for token in tokenizer.encode(text, add_special_tokens=False):
        if ending.add(token) is None:
            break
    ending.close()
    return result


def test_a_loop_keeps_its_first_round(engine):
    """Text that starts to repeat itself ends right before the repetition: its first round is kept whole."""
    def written(text: str) -> DecodeResult:
        return written_through_ending(engine.lm.tokenizer, text)

    # The second round starts with " Mary" where the first had "Mary" (another token): cut there.
    first = written("Mary went to the garden. Mary went to the garden. Mary went")
    assert first.reason == "repeat" and first.text == "Mary went to the garden. Mary"
    tight = written(" the end of the end of the end of")
    assert tight.reason == "repeat" and tight.text == " the end of"


def test_citations_do_not_count_as_a_loop(engine):
    """A list answer may cite one segment for several items: the repeated tag is not a loop, but the text
    around it still is, and so is the same citation over and over with nothing between."""
    def written(text: str) -> DecodeResult:
        return written_through_ending(engine.lm.tokenizer, text)

    items = ("The lost things are the sextant [segment 3], the whistle [segment 3], the lamp [segments 3, 5], "
             "the rope [segment 5] and the map [segment 3; page 2].")
    listed = written(items)
    assert listed.reason == "limit" and listed.text == items
    looped = written("Mary went to the garden [segment 2]. Mary went to the garden [segment 2]. Mary went")
    assert looped.reason == "repeat" and looped.text.startswith("Mary went to the garden [segment 2].")
    assert looped.text.count("garden") == 1
    stuck = written("The answer is in the notes [segment 4] [segment 4] [segment 4] [segment 4]")
    assert stuck.reason == "repeat" and stuck.text.count("[segment 4]") == 1
    # A bracket that is not a citation is text like any other.
    brackets = written("the list [a, b, c, d] and again [a, b, c, d]")
    assert brackets.reason == "repeat" and brackets.text.count("a, b, c") == 1


def test_a_note_never_copies_a_running_line(engine):
    """The Federal Register's print codes close every page (one glued to a body sentence on page 1): the
    sentences a note may copy leave them out, and keep the body text around them."""
    from engine.documents import load_document
    from engine.segment import segment
    pdf = load_document(shared("pdf", "federal-register-2020-17221.pdf"))
    doc = segment(pdf.text, engine.lm.tokenizer, 512, pdf.page_starts)
    pieces = pieces_of(doc.text, 0, pdf.page_starts[2], engine.lm.tokenizer, 96, doc.running)
    texts = [p.text for p in pieces]
    assert not any("VerDate" in t or "DSKJLSW7X2PROD" in t or "Federal Register / Vol." in t for t in texts)
    assert any(t.endswith("accident after takeoff from Soekarno-") for t in texts)
    assert any("must receive comments" in t for t in texts)
    every = [p.text for p in pieces_of(doc.text, 0, pdf.page_starts[2], engine.lm.tokenizer, 96)]
    assert any("VerDate" in t for t in every)  # without the running lines given, they would be copyable


def test_an_answer_after_its_reasoning_may_repeat_the_reasoning(engine):
    """An answer that reasons first repeats the reasoning's words after "Answer:": no loop. The answer's own
    repeats still are one, and the paragraph stop waits for the answer."""
    def written(text: str, answer_after: str | None = "Answer:") -> DecodeResult:
        return written_through_ending(engine.lm.tokenizer, text, paragraph=True, answer_after=answer_after)

    reasoned = ("The notes say John moved to the bathroom [segment 6] and journeyed to the hallway [segment 16].\n\n"
                "Answer: John journeyed to the hallway [segment 16].")
    assert written(reasoned).text == reasoned and written(reasoned).reason == "limit"
    # The reasoning names the same things again (a multihop case's, at 16k): only a longer repeat is a loop there.
    restated = ("The notes say Marbor Vennetis's sister is called Quatisashe [segment 3]. The document states that "
                "Marbor Vennetis's sister lives in the city of Lenlencal. Answer: Lenlencal")
    assert written(restated).text == restated
    circling = "The notes say the ledger lists a thimble, a compass and a kettle [segment 12], " * 3
    assert written(circling).reason == "repeat" and written(circling).text.count("thimble") == 1
    # Without the answer's words the same text ends at its blank line, as any answer does.
    assert written(reasoned, None).reason == "paragraph"
    looped = written("The notes say Mary went to the garden. Answer: Mary went to the garden. Mary went to the "
                     "garden. Mary went")
    assert looped.reason == "repeat" and looped.text.count("garden") == 2
    after = written("The notes say it. Answer: the garden.\n\nThe notes say")
    assert after.reason == "paragraph" and after.text.rstrip() == "The notes say it. Answer: the garden."


def test_a_segment_of_several_facts_gives_a_note_holding_all_of_them(engine):
    """Five ledger entries in one segment of prose: its note holds all five, verbatim, each at its own span (the
    model's own copy, completed by the sentences the evidence proposes, engine/evidence.py), and the notes on
    the prose around it copy no entry they do not hold."""
    book = shared("books", "pg84.txt").read_text(encoding="utf-8")
    start = book.index("You will rejoice to hear")
    sentences = re.findall(r"[^.!?]+[.!?]", " ".join(book[start:start + 6000].split()))
    entries = ["The ledger records one lantern.", "Item entered in the ledger: a compass.",
               "Ledger entry: one kettle, in good order.", "In the ledger, another line reads: violin.",
               "The ledger records one telescope."]
    parts = [s.strip() for s in sentences[:3]]  # the first segment: three sentences, then the entries among prose
    for k, entry in enumerate(entries):
        parts += [entry, sentences[3 + k].strip()]
    parts += [s.strip() for s in sentences[8:30]]
    text = " ".join(parts)
    reading = engine.open(text, Settings(segment_tokens=400, margin_tokens=96, classifier="margin"))
    margins = [e for e in reading.read("Which items does the ledger record?") if isinstance(e, Margin)]
    assert_faithful(reading, margins)
    spans = [(text.index(e), text.index(e) + len(e)) for e in entries]
    holder = next(s for s in reading.segments if s.char_start <= spans[0][0] < s.char_end)
    assert all(holder.char_start <= a and b <= holder.char_end for a, b in spans)  # one segment holds them all
    note = next(m for m in margins if m.index == holder.index)
    assert all(span in note.spans for span in spans), (note.text, note.spans)
    assert all(entry in note.text for entry in entries) and note.relevant
