"""The answer's form (engine/answering.py, engine/attribution.py): citations read from its text, its words without
them, citations written after the pieces whose words a note holds, an answer cut at its cap ending at a sentence
end, and "not stated" answers recognised."""
from __future__ import annotations

from engine.answering import complete_sentences, says_not_stated
from engine.prompts import note_label
from engine.attribution import attributed, cited, without_citations
from engine.segment import Segment


def test_citations_are_read_in_every_form_the_answer_writes_them():
    text = ("Sandra went to the garden [segment 3], then the hall [segments 5 and 7]; see also [Segment 9, page 2] "
            "and [segments 11-13] and [segment 40].")
    assert cited(text, 20) == [2, 4, 6, 8, 10, 11, 12]  # segment 40 does not exist in a 20-segment text
    assert cited("no citation here", 20) == [] and cited("[segment 0]", 20) == []
    assert without_citations(text) == "Sandra went to the garden, then the hall; see also and and."


def test_an_answer_cut_at_its_cap_ends_at_its_last_sentence():
    assert complete_sentences("The rule is proposed. It takes effect on Aug", "limit") == "The rule is proposed."
    assert complete_sentences("It moved to the hall [segment 2]. Then it went", "repeat") == \
        "It moved to the hall [segment 2]."
    assert complete_sentences("the bathroom", "limit") == "the bathroom"  # no sentence end at all: kept
    assert complete_sentences("Done. And more", "end") == "Done. And more"  # ended by the model: as it is


def test_a_list_ended_by_its_loop_drops_the_items_it_named_again():
    # As recorded (aggregation, 16k, seed 0): the list's first item came back, cited alike, and the loop stop
    # ended the answer there.
    looped = ("compass [segment 13] [segment 16], violin [segment 3] [segment 12], flagon [segment 6], "
              "trowel [segment 8], compass [segment 13] [segment 16]")
    assert complete_sentences(looped, "repeat") == ("compass [segment 13] [segment 16], violin [segment 3] "
                                                    "[segment 12], flagon [segment 6], trowel [segment 8]")
    assert complete_sentences("- Lamp\n- padlock [segment 11]\n- lamp", "repeat") == "- Lamp\n- padlock [segment 11]"
    assert complete_sentences("Trowel [segment 2], lute [segment 4], trowel [segment 2], pocket watch [segment 14]",
                              "repeat") == "Trowel [segment 2], lute [segment 4], pocket watch [segment 14]"
    assert complete_sentences(looped, "end") == looped  # the model ended it: as it is
    # Taken back at its loop and gone on (recorded on the tuning seed, 24k): an item named again on the way.
    retried = ("padlock [segment 10] [segment 17], compass [segment 8], pocket watch [segment 18], compass "
               "[segment 8], pad lock.")
    assert complete_sentences(retried, "end", retried=2) == ("padlock [segment 10] [segment 17], compass [segment 8], "
                                                             "pocket watch [segment 18], pad lock.")
    distinct = "He went to the hall, then to the kitchen, then to the hall again"
    assert complete_sentences(distinct, "repeat") == distinct  # no item named twice
    dates = "Comments close on October 2, 2020; the notice was issued on August 3, 2020"
    assert complete_sentences(dates, "repeat") == dates  # a year after a date's comma is not an item


def test_not_stated_answers_and_note_labels():
    assert says_not_stated("The document does not say.") and says_not_stated("The date is not stated.")
    assert not says_not_stated("It says the rule takes effect in 2021.")
    assert note_label(Segment(2, 0, 10, 0, 5, (3, 3))) == "segment 3, page 3"
    assert note_label(Segment(2, 0, 10, 0, 5, (3, 4))) == "segment 3, pages 3-4"
    assert note_label(Segment(0, 0, 10, 0, 5)) == "segment 1"


def _label(i: int) -> str:
    return f"segment {i + 1}"


def test_an_answer_is_cited_by_the_notes_that_hold_its_words():
    notes = {2: "Mary went to the office.", 5: "Mary journeyed to the hallway.", 9: "The cook kept a large cat."}
    # The question's own words (Mary) do not choose a note; the answer's (hallway) do.
    assert attributed("Mary is in the hallway.", notes, "Where is Mary?", _label) == \
        "Mary is in the hallway [segment 6]."
    # A list: each item after the note that holds it; an item no note holds stays uncited.
    assert attributed("office, cat, piano", notes, "What is there?", _label) == \
        "office [segment 3], cat [segment 10], piano"
    # Tied notes: the later two (the newer state of a fact); plurals meet their singular.
    tied = {0: "The key was here.", 1: "A key lay there.", 4: "Keys again."}
    assert attributed("The keys.", tied, "What?", _label) == "The keys [segment 2] [segment 5]."
    # No piece shares a word with a note: the notes closest to question and answer together ("Mary"), unless
    # the answer says the document does not say; no note near either: the answer as it is.
    assert attributed("Yes.", notes, "Did Mary go anywhere?", _label) == "Yes [segment 3] [segment 6]."
    assert attributed("Yes.", notes, "Did Mary go anywhere?", _label, fallback=False) == "Yes."
    assert attributed("In 1956.", notes, "When?", _label) == "In 1956."
    # Cited by the model already: left as it is.
    assert attributed("The hallway [segment 2].", notes, "Where is Mary?", _label) == "The hallway [segment 2]."
    assert attributed("The hallway.", {}, "Where is Mary?", _label) == "The hallway."
    assert cited(attributed("Galbor", {12: "The Golden Bell Tannery is in the town of Galbor."},
                            "In which town does Dunithrel Romar work?", _label), 16) == [12]


def test_an_answer_no_kept_note_holds_is_cited_by_the_passages_in_the_cache():
    notes = {4: "The cook kept a large cat.", 8: "The Dormouse slowly opened his eyes."}
    passages = {1: "Daniel took the football there. The Dormouse slept.", 3: "Daniel went to the hallway.",
                6: "Sandra went to the garden.", 8: "The Dormouse slowly opened his eyes."}
    # The notes hold none of the answer's words: the passage holding them beyond the question's (hallway) is cited,
    # a segment whose note was not kept.
    assert attributed("The football is in the hallway.", notes, "Where is the football?", _label,
                      passages=passages) == "The football is in the hallway [segment 4]."
    # A note that holds the words comes first; the passages are not asked.
    assert attributed("The Dormouse.", notes, "Who slept?", _label, passages=passages) == \
        "The Dormouse [segment 9]."
    # Words in neither: the fallback by question and answer together, as without passages.
    assert attributed("In 1956.", notes, "When did the cook buy the cat?", _label, passages=passages) == \
        "In 1956 [segment 5]."
    # No kept note at all, the document in the cache: cited by the passages alone.
    assert attributed("The garden.", {}, "Where is Sandra?", _label, passages=passages) == "The garden [segment 7]."


def test_a_date_is_cited_by_a_note_holding_more_than_its_year():
    # As walked in the app (the Federal Register PDF): "August 3, 2020", the notice's issue date, was cited by
    # the notes that held only "2020" (the comment deadline, a docket number). The date is one piece (not cut at
    # its comma), and a number alone does not tie a piece with words to a note.
    question = "When does this rule take effect, and what does it require?"
    answer = "The rule takes effect on August 3, 2020."
    notes = {0: "The FAA must receive comments on this proposed AD by September 21, 2020.",
             8: "For those procedures, search for Docket No. FAA-2020-0686."}
    assert attributed(answer, notes, question, _label, fallback=False) == answer  # no note holds the date
    issued = {**notes, 16: "Issued in Des Moines, Washington, on August 3, 2020."}
    assert attributed(answer, issued, question, _label) == "The rule takes effect on August 3, 2020 [segment 17]."
    passages = {3: "Issued in Des Moines, Washington, on August 3, 2020. Lance T. Gant, Director."}
    assert attributed(answer, notes, question, _label, passages=passages) == \
        "The rule takes effect on August 3, 2020 [segment 4]."  # the passage in the cache that holds it
    # A piece that is only a number is still cited by the note holding it.
    assert attributed("In 2020.", {4: "The new MMEL was published on April 10, 2020."},
                      "In what year was the new MMEL published?", _label) == "In 2020 [segment 5]."
