"""Experiment: the question placed before the document (query-aware contextualization, Liu et al. 2023), WiM
reading and answering otherwise as the default. Runs bench.answer_prompts with the document prompt patched."""
import sys
import engine.prompts as P
import engine.wim as W
from bench import answer_prompts as AP

_orig = P.prompt
CURRENT = {"q": None}
DOC = ("Here is a document, given part by part. While you read it, keep this question in mind: {q}\n\n"
       "```\n{{document}}\n```")

def patched(name):
    if name == "document" and CURRENT["q"]:
        return DOC.format(q=CURRENT["q"])
    return _orig(name)
P.prompt = patched

queries = {}
_gen = AP.generate_cases
def gen(*a, **k):
    cases = _gen(*a, **k)
    for c in cases:
        queries[c.text] = c.query
    return cases
AP.generate_cases = gen

_open = W.Engine.open
def open_(self, text, settings=W.Settings(), page_starts=None):
    CURRENT["q"] = queries.get(text)
    self.layout = P.PromptLayout(self.lm.tokenizer)
    return _open(self, text, settings, page_starts)
W.Engine.open = open_

raise SystemExit(AP.main(sys.argv[1:]))
