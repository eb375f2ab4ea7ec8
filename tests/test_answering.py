"""The answer's form (engine/answering.py): citations read from its text, its words without them, an answer cut at
its cap ending at a sentence end, and "not stated" answers recognised."""
from __future__ import annotations

from engine.answering import cited, complete_sentences, note_label, says_not_stated, without_citations
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


def test_not_stated_answers_and_note_labels():
    assert says_not_stated("The document does not say.") and says_not_stated("The date is not stated.")
    assert not says_not_stated("It says the rule takes effect in 2021.")
    assert note_label(Segment(2, 0, 10, 0, 5, (3, 3))) == "segment 3, page 3"
    assert note_label(Segment(2, 0, 10, 0, 5, (3, 4))) == "segment 3, pages 3-4"
    assert note_label(Segment(0, 0, 10, 0, 5)) == "segment 1"
