"""Experiment: the kept notes listed latest first in the answer prompt (the note nearest the question is the last
one in the text), everything else the default. Runs bench.answer_prompts with engine.answering's note_lines patched
for candidates whose prompt name ends in "-reversed" (the text is the named prompt's without that suffix).
    MARGINALIA_ATTENTION=torch OMP_NUM_THREADS=1 PYTHONPATH=. python run.py [bench.answer_prompts options]
"""
import sys
import engine.answering as A
import engine.prompts as P
from bench import answer_prompts as AP

STATE = {"reverse": False}
_lines = P.note_lines

def note_lines(notes, used, label):
    return _lines(notes, list(reversed(used)) if STATE["reverse"] else used, label)

A.note_lines = note_lines
P.note_lines = note_lines

AP.CANDIDATES["list-reversed"] = AP.CANDIDATES["list"]
_parse = AP.parse

def parse(name):
    prompt_name, selection, style = _parse(name)
    STATE["reverse"] = prompt_name.endswith("-reversed")
    return prompt_name, selection, style

AP.parse = parse
raise SystemExit(AP.main(sys.argv[1:]))
