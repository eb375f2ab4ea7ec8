"""Every way of reading a document that the benchmarks compare, behind one call: `run_mode(engine, mode, ...)`.

- `wim`, `plain`: the engine itself (Settings.mode "wim" / "llm").
- `naive`: the two-pass pattern. Pass 1 reads each segment on its own fresh cache and writes its note; pass 2
  reads the whole text again, then answers with the notes. The document is prefilled twice.
- `reference`: the public writer/writing-in-the-margins pattern, rewritten here from its description with our
  tokens and prompts: transformers' DynamicCache grown with torch.cat, cut back by slicing
  (DynamicCache.crop(-n)), logits computed for every prefilled position, margins classified by the same model
  in a second DynamicCache. Same tokens, same prompts, same greedy choices: its margins and answer must equal
  the engine's; only the cache mechanics differ.
- `margins_only` (quality eval): answer from the margins alone, on a fresh cache, without the document.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace

import torch
from transformers import DynamicCache

from engine import Answer, Margin, Settings, Stats
from engine.answering import complete_sentences
from engine.cache import cache_keyword, make_cache
from engine.classify import Classifier, LLMClassifier
from engine.generate import Meter, Runner, prefill_passes
from engine.margins import Note, Scratch
from engine.prompts import prompt

from .common import fixed_length

MODES = ("wim", "plain", "naive", "reference")


@dataclass
class Run:
    """One read + answer in one mode, with its accounting."""
    mode: str
    seconds: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    margins: list[tuple[int, str, bool | None]] = field(default_factory=list)  # (segment, text, kept?)
    answer: str = ""
    kv_bytes: int = 0            # KV-cache bytes held at once, at most
    followup_seconds: float | None = None
    followup_prefill_tokens: int | None = None
    followup_decode_tokens: int | None = None
    # A server backend: requests sent, prompt tokens sent, of which the server found cached.
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def add(self, stats: "Stats | Meter | Run") -> None:
        self.prefill_tokens += stats.prefill_tokens
        self.decode_tokens += stats.decode_tokens
        self.prefill_seconds += stats.prefill_seconds
        self.decode_seconds += stats.decode_seconds
        self.requests += stats.requests
        self.prompt_tokens += stats.prompt_tokens
        self.cached_tokens += stats.cached_tokens

    def to_dict(self) -> dict:
        return asdict(self)


def run_mode(engine, mode: str, text: str, query: str, settings: Settings, followup: str | None = None,
             fixed: bool = True) -> Run:
    """Read `text`, answer `query` (and `followup`, wim only). `fixed`: decode every answer, and every free-form
    margin, to its full length, so that all modes decode the same number of tokens there. Copied (extractive)
    notes end where the model ends them in every mode: their length is a choice among the text's sentences."""
    if mode in ("wim", "plain"):
        return _engine_run(engine, mode, text, query, settings, followup, fixed)
    if mode == "naive":
        return _naive_two_pass(engine, text, query, settings, fixed)
    if mode == "reference":
        return _reference_pattern(engine, text, query, settings, fixed)
    raise ValueError(f"unknown mode {mode!r}")


def kv_bytes_per_token(model) -> int:
    cfg = model.config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * next(model.parameters()).element_size()


def _classifier_scratch_bytes(engine, reading) -> int:
    """The LLM classifier's own cache (allocated by the engine inside read(), so not reachable afterwards)."""
    if reading.settings.mode != "wim" or reading.settings.classifier != "llm" or engine.lm.model is None:
        return 0  # (no model here: a server backend holds its KV cache itself)
    return LLMClassifier(reading.runner, engine.layout).scratch.capacity * kv_bytes_per_token(engine.lm.model)


def _collect(events, run: Run) -> None:
    for ev in events:
        if isinstance(ev, Margin):
            run.margins.append((ev.index, ev.text, ev.relevant))
        elif isinstance(ev, Answer):
            run.answer = ev.text
        elif isinstance(ev, Stats):
            run.add(ev)


def _fixed(fixed: bool, *runners):
    """fixed_length over `runners` when `fixed`, else nothing."""
    return fixed_length(*runners) if fixed else nullcontext()


def _note(writing) -> Note:
    """Run a margin writer (engine/margins.py) to its end; its Note."""
    while True:
        try:
            next(writing)
        except StopIteration as done:
            return done.value


def _engine_run(engine, mode, text, query, settings, followup, fixed) -> Run:
    reading = engine.open(text, replace(settings, mode="llm" if mode == "plain" else "wim"))
    run = Run(mode)
    t = time.perf_counter()
    with _fixed(fixed and settings.margins == "abstractive", reading.runner):
        _collect(reading.read(query), run)
    with _fixed(fixed, reading.runner):
        _collect(reading.answer(query), run)
        run.seconds = time.perf_counter() - t
        if followup and mode == "wim":
            t = time.perf_counter()
            stats = [e for e in reading.answer(followup) if isinstance(e, Stats)][0]
            run.followup_seconds = time.perf_counter() - t
            run.followup_prefill_tokens, run.followup_decode_tokens = stats.prefill_tokens, stats.decode_tokens
    run.kv_bytes = reading.cache.nbytes() + _classifier_scratch_bytes(engine, reading)
    return run


def _naive_two_pass(engine, text, query, settings, fixed) -> Run:
    """Pass 1: one fresh cache per segment holding the prefix, that segment (the same tokens WiM reads), the
    margin instruction and the note, written and judged as the engine writes and judges them (with the
    instruction in the segment's last pass, as the engine feeds it). Pass 2: the engine's reader on a fresh
    cache reads the whole text again, given the pass-1 notes (a resumed reading writes none), then answers with
    the notes the classifier kept. The document is prefilled twice."""
    layout = engine.layout
    whole = engine.open(text, replace(settings, mode="wim"))
    runner = whole.runner
    pass1 = runner.meter = Meter()  # pass 2 (whole.read) meters itself afresh
    classifier = Classifier(settings.classifier, runner, layout, settings.embedding_threshold)
    instruction = whole.notes.instruction(query)
    run = Run("naive")
    t = time.perf_counter()
    with _fixed(fixed and settings.margins == "abstractive", runner):
        for seg in whole.segments:
            # Just big enough for this segment and its note: fresh, and not 8k tokens of zeros each time.
            cache = runner.new_cache(len(layout.prefix) + seg.tokens + len(instruction) + settings.margin_tokens
                                     + 16)
            runner.prefill(layout.prefix, cache)
            if whole.notes.folds_instruction():
                logits = runner.prefill(whole.doc.segment_ids(seg), cache, then=instruction)
                doc_end = cache.length - len(instruction)
                scratch = Scratch(runner, cache, doc_end, None, None, (instruction, logits))
            else:  # a server backend: its own scratch, the instruction sent with the note's request
                runner.prefill(whole.doc.segment_ids(seg), cache)
                scratch = runner.scratch(cache, cache.length)
            writer, pieces = whole.notes.writer_for(seg)
            note = _note(writer.write(scratch, instruction, pieces))
            list(whole.notes.file(seg, note, query, classifier, None, 0.0, whole.keep_margin))
            list(runner.drain())
        pass1_kv = cache.nbytes() + _classifier_scratch_bytes(engine, whole)
        del cache
    notes = {i: m.text for i, m in whole.margins.items()}
    kept = whole.default_selection()
    _collect(whole.read(query, skip=notes), run)
    with _fixed(fixed, whole.runner):
        _collect(whole.answer(query, margins={i: notes[i] for i in kept}), run)
    run.seconds = time.perf_counter() - t
    run.add(pass1)
    run.margins = [(i, notes[i], i in kept) for i in sorted(notes)]
    run.kv_bytes = max(pass1_kv, whole.cache.nbytes())
    return run


# ---- the reference implementation's pattern --------------------------------------------------------------------
def _dynamic_bytes(cache: DynamicCache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers if layer.is_initialized
               for t in (layer.keys, layer.values))


class _ReferenceRunner:
    """Prefill and greedy decode the way the public WiM code does: DynamicCache, an all-ones attention mask
    over cache + new tokens, and the logits of every position (it has no logits_to_keep)."""

    def __init__(self, engine, stop_ids: set[int]):
        self.model, self.tokenizer = engine.lm.model, engine.lm.tokenizer
        self.decoder, self.lm_head = self.model.get_decoder(), self.model.get_output_embeddings()
        self.device = engine.lm.device
        self.stop_ids = stop_ids
        self.cache_keyword = cache_keyword(self.model)
        self.meter = Meter()
        self.peak_kv = 0
        self.caches: list[DynamicCache] = []

    def new_cache(self) -> DynamicCache:
        cache = DynamicCache()
        self.caches.append(cache)
        return cache

    @torch.inference_mode()
    def forward(self, ids: list[int], cache, stop=None, attention_mask: torch.Tensor | None = None,
                positions: list[int] | None = None, all_logits: bool = False) -> torch.Tensor:
        cache = getattr(cache, "dynamic", cache)
        if all_logits:  # rows scored after a note's scratch (margins.score_continuations)
            hidden = self.decoder(input_ids=torch.tensor([ids], dtype=torch.long, device=self.device),
                                  attention_mask=attention_mask,
                                  position_ids=torch.tensor([positions], device=self.device),
                                  use_cache=True, **{self.cache_keyword: cache}).last_hidden_state
            return self.lm_head(hidden)[0].float()
        past = cache.get_seq_length()
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        mask = torch.ones(1, past + len(ids), dtype=torch.long, device=self.device)
        positions = torch.arange(past, past + len(ids), device=self.device).unsqueeze(0)
        hidden = self.decoder(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                              **{self.cache_keyword: cache}).last_hidden_state
        self.peak_kv = max(self.peak_kv, sum(_dynamic_bytes(c) for c in self.caches))
        # Every position's logits, as the public code computes them (its cost), but the last position's on its
        # own: the engine computes only that one, a single row, which goes through the decode copy where the model
        # has one (engine/packed.py: `gguf-q8` rounds its input to int8 blocks), while the same row inside a long
        # pass goes through the full weights. Computed the engine's way, the greedy choices of the two patterns
        # can be compared token for token (a copied margin's first sentence differed on an AMD EPYC otherwise).
        if len(ids) > 1:
            self.lm_head(hidden[:, :-1])
        return self.lm_head(hidden[:, -1:])[0, -1].float()

    def prefill(self, ids: list[int], cache: DynamicCache, then: list[int] = ()) -> torch.Tensor:
        # In the engine's passes (engine/generate.py's prefill_passes): the
        # same work, and the same rounding, so that the margins and answers of the two patterns can be compared
        # token for token (in bf16 a 934-token pass and passes of 512 + 422 round differently, enough to change
        # a greedy token).
        t = time.perf_counter()
        for chunk in prefill_passes(ids, then):
            logits = self.forward(chunk, cache)
        self.meter.prefill_seconds += time.perf_counter() - t
        self.meter.prefill_tokens += len(ids) + len(then)
        return logits

    def decode(self, cache: DynamicCache, logits: torch.Tensor, max_tokens: int) -> tuple[str, str]:
        """Greedy, with the engine's accounting: the last chosen token is never fed back. (text, ending): "limit"
        where it ran to `max_tokens`, "end" where the model ended it."""
        ids: list[int] = []
        for i in range(max_tokens):
            token = int(torch.argmax(logits))
            if token in self.stop_ids:
                break
            ids.append(token)
            self.meter.decode_tokens += 1
            if i + 1 == max_tokens:
                break
            t = time.perf_counter()
            logits = self.forward([token], cache)
            self.meter.decode_seconds += time.perf_counter() - t
        text = self.tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd").strip()
        return text, "limit" if len(ids) == max_tokens else "end"


class _Cropped:
    """A DynamicCache as engine/margins.py's scoring uses a cache: its length, and cut back by cropping."""

    def __init__(self, dynamic: DynamicCache):
        self.dynamic = dynamic

    @property
    def length(self) -> int:
        return self.dynamic.get_seq_length()

    def truncate(self, length: int) -> None:
        extra = self.dynamic.get_seq_length() - length
        if extra > 0:
            self.dynamic.crop(-extra)  # transformers 5 crops by a count from the end


class _ReferenceScratch(Scratch):
    """engine/margins.py's Scratch over the reference's DynamicCache, for the copying writer: the note's tokens
    are fed after the document with the reference's forward pass (and metered as Scratch meters them); rows a
    copy's choice scores are fed in the engine's masked passes and cropped off again."""

    def __init__(self, ref: _ReferenceRunner, cache: DynamicCache, fed: tuple[list[int], torch.Tensor]):
        super().__init__(ref, _Cropped(cache), cache.get_seq_length() - len(fed[0]), None, None, fed)

    def _pass(self, ids: list[int]) -> torch.Tensor:
        return self.runner.forward(ids, self.cache)


def _reference_pattern(engine, text, query, settings, fixed) -> Run:
    if settings.classifier not in ("llm", "margin", "none"):
        raise ValueError("the reference pattern judges notes with the model itself (classifier llm or margin) "
                         "or not at all")
    # The engine's reading of the same text gives the same segments, margin writers and answer prompt; its own
    # cache is allocated on first use, which never comes.
    reading = engine.open(text, replace(settings, mode="wim"))
    layout = engine.layout
    judge = LLMClassifier(reading.runner, layout)  # for its YES/NO token sets and prompt length limit
    ref = _ReferenceRunner(engine, set() if fixed else reading.runner.stop_ids)
    doc, scratch = ref.new_cache(), ref.new_cache()
    instruction = reading.notes.instruction(query)
    run = Run("reference")
    notes: dict[int, str] = {}
    kept: list[int] = []
    t = time.perf_counter()
    ref.prefill(layout.prefix, doc)
    for seg in reading.segments:
        logits = ref.prefill(reading.doc.segment_ids(seg), doc, then=instruction)
        boundary = doc.get_seq_length() - len(instruction)
        if settings.margins == "abstractive":
            notes[seg.index] = ref.decode(doc, logits, settings.margin_tokens)[0]
        else:
            writer, pieces = reading.notes.writer_for(seg)
            notes[seg.index] = _note(writer.write(_ReferenceScratch(ref, doc, (instruction, logits)), instruction,
                                                  pieces)).text
        doc.crop(boundary - doc.get_seq_length())  # slicing back to the segment boundary
        if settings.classifier == "llm" and notes[seg.index]:
            ids = layout.standalone("classify", query=query, margin=notes[seg.index])[-judge.scratch.capacity:]
            probs = torch.softmax(ref.prefill(ids, scratch), dim=-1)
            yes, no = float(probs[list(judge.yes)].sum()), float(probs[list(judge.no)].sum())
            if (yes / (yes + no) if yes + no > 0 else 0.0) >= 0.5:
                kept.append(seg.index)
            scratch.crop(-scratch.get_seq_length())  # the public code empties its classifier cache the same way
        elif settings.classifier != "llm" and notes[seg.index]:
            kept.append(seg.index)  # margin relevance: a note the model chose to write is kept (as the engine)
    reading.doc_end = doc.get_seq_length()  # the engine's reading never read: give it this cache's length
    ids, used, _ = reading.answering.notes_prompt(query, {i: notes[i] for i in kept})
    logits = ref.prefill(ids, doc)
    cap = min(settings.answer_tokens, reading.limit - doc.get_seq_length())
    # Finished as the engine finishes an answer: one cut at its token cap ends at its last complete sentence.
    run.answer = complete_sentences(*ref.decode(doc, logits, cap))
    run.seconds = time.perf_counter() - t
    run.add(ref.meter)
    run.margins = [(i, notes[i], i in kept) for i in sorted(notes)]
    run.kv_bytes = ref.peak_kv
    return run


# ---- margins only (quality eval) -------------------------------------------------------------------------------
MARGINS_ONLY_PROMPT = ("While reading a document, these notes were written in the margins:\n{margins}\n\n"
                       "Using only the notes, answer the question: {query}\nAnswer in a few words.")


def margins_only(engine, query: str, notes: dict[int, str], answer_tokens: int) -> str:
    """Answer from the margins alone: a short conversation (system, notes + question) on a fresh cache."""
    lm = engine.lm
    lines = "\n".join(f"- [segment {i + 1}] {text}" for i, text in sorted(notes.items()) if text) or "(none)"
    messages = [{"role": "system", "content": prompt("system")},
                {"role": "user", "content": MARGINS_ONLY_PROMPT.format(margins=lines, query=query)}]
    ids = engine.layout.encode(lm.tokenizer.apply_chat_template(messages, tokenize=False,
                                                                add_generation_prompt=True))
    runner = Runner(lm.model, lm.tokenizer, lm.device)
    cache = make_cache(lm.model, len(ids) + answer_tokens + 1)
    logits = runner.prefill(ids, cache)
    return "".join(piece for _, piece in runner.decode(cache, logits, answer_tokens)).strip()
