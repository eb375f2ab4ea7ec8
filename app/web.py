"""Marginalia's screen, in Gradio 6, panel by panel: each panel lays out its components and wires its events to
app/service.py, where the logic lives; what the service returns (app/records.py) is drawn by app/render.py.

Events that run the model (read, resume, answer, switching the model, and the API's read/answer) share one
concurrency group, "engine", limited to `worker.job_slots()`: 1 on a local model, which runs one forward pass
at a time, so everything else queues for it (Gradio tells a waiting browser its place in the queue); several
on a model server (--backend openai), which batches concurrent readings. Each of them is split in two: a
quick step that validates, creates or checks the session and sets up its stop flag (so Stop works even while
the job is queued), then the engine step. Stop sets the session's threading.Event, which the engine checks before every
forward pass; Gradio's `cancels=` would only act between two yields.
"""
from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import gradio as gr

from engine.classify import COMBINED_RELEVANCE

from . import render, worker
from .documents import SAMPLE, SAMPLE_QUESTION
from .records import (Answered, AnswersChanged, JobEnded, JobStarted, Message, Panel, PanelChanged, SessionView,
                      Update)
from .service import Service, UserError
from .sessions import ACCOUNT

log = logging.getLogger(__name__)

STATIC = Path(__file__).resolve().parent.parent / "static"
ENGINE = "engine"  # the concurrency group of everything that runs the model
BROWSER_KEY = "marginalia-browser"
CLASSIFIERS = [("The note itself (copied something or said nothing)", "margin"),
               ("LLM (the reading model says yes/no)", "llm"), ("Embedding similarity (MiniLM)", "embedding"),
               (f"MiniLM, or a note sure of itself (relevance {COMBINED_RELEVANCE} or more)", "combined"),
               ("None (keep every margin)", "none")]


MARGIN_STYLES = [("Copied sentences (each links to its passage)", "extractive"),
                 ("Copied sentences, chosen by scoring every sentence", "scored"),
                 ("Free-form notes (may paraphrase or invent)", "abstractive")]


def static_text(name: str) -> str:
    return (STATIC / name).read_text(encoding="utf-8")


def theme() -> gr.themes.Base:
    # System fonts only: the app must not fetch fonts from the network (it runs offline on a desktop).
    return gr.themes.Soft(primary_hue="indigo", neutral_hue="stone",
                          font=["Inter", "ui-sans-serif", "system-ui", "-apple-system", "Segoe UI", "sans-serif"],
                          font_mono=["ui-monospace", "SFMono-Regular", "Menlo", "Consolas", "monospace"])


def launch_kwargs() -> dict:
    """What goes to launch() in Gradio 6 (not to Blocks())."""
    return {"theme": theme(), "css": static_text("marginalia.css")}


class Viewing:
    """Which session each open tab shows (by Gradio's per-tab session hash). A reading streams into the panel
    of the tab that started it only while that tab still shows its session: if the reader opens another
    session meanwhile, the stream keeps going (and saving) without painting over what they are looking at."""

    def __init__(self):
        self._tabs: dict[str, str | None] = {}

    def show(self, request: gr.Request | None, session_id: str | None) -> None:
        if request is not None and request.session_hash:
            self._tabs[request.session_hash] = session_id

    def showing(self, request: gr.Request | None, session_id: str | None) -> str | None:
        """The session this tab shows; `session_id` itself for a request from no known tab (the API)."""
        if request is None or not request.session_hash:
            return session_id
        return self._tabs.get(request.session_hash, session_id)

    def close(self, request: gr.Request | None) -> None:
        if request is not None and request.session_hash:
            self._tabs.pop(request.session_hash, None)


def model_choices(service: Service) -> list[tuple[str, str]]:
    """(label, spec) for the picker: name, size on disk, context window, measured writing speed."""
    return [(render.model_choice_label(m), m["spec"]) for m in service.models()]


PRIVATE = {"api_visibility": "private"}
QUIET = {"api_visibility": "private", "show_progress": "hidden"}


# ---------------------------------------------------------------- the panels: each lays out its components

@dataclass
class ModelPanel:
    """The model picker (above the document) and what the loaded model is (in Settings)."""
    picker: gr.Dropdown

    @classmethod
    def layout(cls, service: Service) -> "ModelPanel":
        local = service.engine.lm.serial  # a model server serves one model: switch it there
        return cls(gr.Dropdown(choices=model_choices(service), value=service.engine.lm.spec, label="Model",
                               elem_id="model-picker", interactive=local,
                               info="Switching loads the new model once; a reading keeps the model that wrote its "
                                    "margins." if local else
                                    "Served by a model server (--backend openai): readings run side by side there."))

    def wire(self, ui: "Screen") -> None:
        service = ui.service

        def on_model(spec):
            try:
                service.switch_model(spec)
            except UserError as e:
                return (gr.update(choices=model_choices(service), value=service.engine.lm.spec), gr.skip(),
                        gr.skip(), render.notice_html(str(e)))
            info = service.engine.lm.info
            return (gr.update(choices=model_choices(service), value=service.engine.lm.spec),
                    render.header_html(info, picked=True), render.model_info_html(info, service.rates),
                    render.notice_html(f"{info['name']} is loaded ({info['load_seconds']:.1f} s); new readings "
                                       "use it.", "info"))

        self.picker.input(on_model, inputs=[self.picker],
                          outputs=[self.picker, ui.header, ui.settings.model_info, ui.document.notice],
                          concurrency_limit=ui.slots, concurrency_id=ENGINE, show_progress="full",
                          show_progress_on=[self.picker], **PRIVATE)


@dataclass
class DocumentPanel:
    """The document to read (upload, what it is, notices) and the question."""
    upload: gr.File
    sample: gr.Button
    info: gr.HTML
    notice: gr.HTML
    question: gr.Textbox

    @classmethod
    def layout(cls) -> "DocumentPanel":
        return cls(gr.File(label="Document (.txt, .md, .pdf, .epub)", type="filepath", elem_id="doc-file",
                           height=120),
                   gr.Button("Try a sample: the first pages of Alice in Wonderland", size="sm",
                             variant="secondary", elem_id="sample-btn"),
                   gr.HTML(render.no_document(), js_on_load=None, elem_id="doc-info"),
                   gr.HTML("", js_on_load=None, elem_id="notice"),
                   gr.Textbox(label="Question", lines=2, max_lines=6, elem_id="question",
                              placeholder="What do you want to know from this document?"))

    def wire(self, ui: "Screen") -> None:
        service = ui.service

        def on_upload(owner, path, *settings):
            try:
                doc_id, notices = service.add_upload(path)
                return (doc_id, render.document_card_html(service.document(doc_id, service.settings(*settings))),
                        render.notice_html(" ".join(notices), "info"))
            except UserError as e:
                return None, render.no_document(), render.notice_html(str(e))

        self.upload.upload(on_upload, inputs=[ui.owner, self.upload, *ui.settings.inputs],
                           outputs=[ui.doc_state, self.info, self.notice], concurrency_limit=4, **PRIVATE)

        def on_sample(owner, segment_tokens, margin_tokens, answer_tokens, classifier_name, margins_name,
                      request: gr.Request):
            """Read the sample with its question at once: margins appear without choosing anything."""
            try:
                doc_id, _ = service.add_upload(SAMPLE)
                settings = service.settings(segment_tokens, margin_tokens, answer_tokens, classifier_name,
                                            margins_name)
                session_id = service.start_read(owner, doc_id, SAMPLE_QUESTION, settings, tab=request.session_hash)
            except UserError as e:
                return (None, gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(),
                        render.notice_html(str(e)), gr.skip())
            ui.viewing.show(request, session_id)
            return ({"kind": "read", "session_id": session_id}, session_id, doc_id,
                    render.document_card_html(service.document(doc_id, settings)), SAMPLE_QUESTION,
                    render.panel_html(service.waiting(owner, session_id)), render.answers_html([]),
                    render.empty_segment(), "",
                    gr.update(visible=False))

        ui.then_read(self.sample.click(
            on_sample, inputs=[ui.owner, *ui.settings.inputs],
            outputs=[ui.job_state, ui.session_state, ui.doc_state, self.info, self.question, ui.margins.panel,
                     ui.answer.answers, ui.now_reading, self.notice, ui.controls.resume],
            concurrency_limit=None, **QUIET).success)


@dataclass
class ReadControls:
    """Read, Stop and Resume."""
    read: gr.Button
    stop: gr.Button
    resume: gr.Button

    @classmethod
    def layout(cls) -> "ReadControls":
        with gr.Row(elem_id="read-row"):
            return cls(gr.Button("Read", variant="primary", elem_id="read-btn", scale=2),
                       gr.Button("Stop", variant="stop", elem_id="stop-btn", scale=1),
                       gr.Button("Resume", variant="secondary", elem_id="resume-btn", scale=1, visible=False))

    def wire(self, ui: "Screen") -> None:
        service, viewing, margins = ui.service, ui.viewing, ui.margins.panel

        def on_read(owner, doc_id, text, segment_tokens, margin_tokens, answer_tokens, classifier_name,
                    margins_name, request: gr.Request):
            try:
                settings = service.settings(segment_tokens, margin_tokens, answer_tokens, classifier_name,
                                            margins_name)
                session_id = service.start_read(owner, doc_id, text, settings, tab=request.session_hash)
            except UserError as e:
                return (None, gr.skip(), gr.skip(), gr.skip(), gr.skip(), render.notice_html(str(e)), gr.skip())
            viewing.show(request, session_id)
            job = {"kind": "read", "session_id": session_id}
            return (job, session_id, render.panel_html(service.waiting(owner, session_id)), render.answers_html([]),
                    render.empty_segment(), "", gr.update(visible=False))

        def on_resume(owner, session_id, request: gr.Request):
            try:
                service.start_resume(owner, session_id, tab=request.session_hash)
            except UserError as e:
                return None, gr.skip(), render.notice_html(str(e)), gr.skip()
            viewing.show(request, session_id)
            return ({"kind": "resume", "session_id": session_id},
                    render.panel_html(service.waiting(owner, session_id)), "", gr.update(visible=False))

        ui.then_read(self.read.click(
            on_read, inputs=[ui.owner, ui.doc_state, ui.document.question, *ui.settings.inputs],
            outputs=[ui.job_state, ui.session_state, margins, ui.answer.answers, ui.now_reading, ui.document.notice,
                     self.resume], concurrency_limit=None, **QUIET).success)
        ui.then_read(self.resume.click(on_resume, inputs=[ui.owner, ui.session_state],
                                       outputs=[ui.job_state, margins, ui.document.notice, self.resume],
                                       concurrency_limit=None, **QUIET).success)

        def on_stop(owner, session_id):
            try:
                if not session_id or not service.stop(owner, session_id):
                    return render.notice_html("Nothing is running.", "info")
            except UserError as e:
                return render.notice_html(str(e))
            return ""

        self.stop.click(on_stop, inputs=[ui.owner, ui.session_state], outputs=[ui.document.notice],
                        concurrency_limit=None, concurrency_id="stop", **QUIET)


@dataclass
class SettingsPanel:
    """How a reading is made (segment, margin and answer sizes, classifier, margin style) and the model's facts."""
    segment_tokens: gr.Slider
    margin_tokens: gr.Slider
    answer_tokens: gr.Slider
    classifier: gr.Radio
    margin_style: gr.Radio
    model_info: gr.HTML

    @property
    def inputs(self) -> list:
        return [self.segment_tokens, self.margin_tokens, self.answer_tokens, self.classifier, self.margin_style]

    @classmethod
    def layout(cls, service: Service) -> "SettingsPanel":
        d = service.defaults
        with gr.Accordion("Settings", open=False, elem_id="settings"):
            return cls(
                gr.Slider(64, 2048, value=d.segment_tokens, step=16, label="Segment size (tokens)",
                          info="How much text the model reads before writing a margin note.",
                          elem_id="segment-tokens"),
                gr.Slider(8, 256, value=d.margin_tokens, step=8, label="Margin length (tokens)",
                          info="The longest margin note.", elem_id="margin-tokens"),
                gr.Slider(16, 512, value=d.answer_tokens, step=16, label="Answer length (tokens)",
                          elem_id="answer-tokens"),
                gr.Radio(CLASSIFIERS, value=d.classifier, label="Relevance classifier",
                         info="Decides which margins look relevant; you can flip any of them.", elem_id="classifier"),
                gr.Radio(MARGIN_STYLES, value=d.margins, label="Margin notes",
                         info="Copied notes are quoted from the text, so each one can be checked.",
                         elem_id="margin-style"),
                gr.HTML(render.model_info_html(service.engine.lm.info, service.rates), js_on_load=None,
                        elem_id="model-info"))

    def wire(self, ui: "Screen") -> None:
        service = ui.service

        def on_settings(doc_id, *settings):
            try:
                return render.document_card_html(service.document(doc_id, service.settings(*settings))), ""
            except UserError as e:
                return gr.skip(), render.notice_html(str(e))

        shown = dict(inputs=[ui.doc_state, *self.inputs], outputs=[ui.document.info, ui.document.notice], **QUIET)
        for control in (self.segment_tokens, self.margin_tokens):
            control.release(on_settings, **shown)
        self.classifier.input(on_settings, **shown)


@dataclass
class LibraryPanel:
    """The library: this browser's documents and readings, to open, continue or delete."""
    library: gr.HTML
    # The job a Continue starts: its own state, not the Screen's job_state, which a Read queued behind the
    # engine still has to read when its turn comes (an Open meanwhile must not turn that Read into nothing).
    job: gr.State

    @classmethod
    def layout(cls) -> "LibraryPanel":
        with gr.Accordion("Library", open=True, elem_id="sessions-box"):
            return cls(gr.HTML(render.library_html(), js_on_load=static_text("library.js"), elem_id="library"),
                       gr.State(None))

    def wire(self, ui: "Screen") -> None:
        service, viewing = ui.service, ui.viewing
        # A new reading (or another one opened) shows in the library at once; the job's end refreshes it again.
        ui.session_state.change(ui.refresh_library, inputs=[ui.owner, ui.session_state], outputs=[self.library],
                                **QUIET)

        def on_library(owner, evt: gr.EventData, request: gr.Request):
            """Open, continue (resume) or delete a reading from the library."""
            data = getattr(evt, "_data", None) or {}
            action, sid = data.get("action"), str(data.get("session") or "")
            nothing = (None, *(gr.skip() for _ in ui.view_outputs))
            try:
                if action == "delete":
                    service.delete(owner, sid)
                    latest = service.last_opened(owner)
                    if latest is None:
                        viewing.show(request, None)
                        return (None, *ui.blank_view())
                    sid, job = latest, None
                elif action == "continue":
                    service.start_resume(owner, sid, tab=request.session_hash)
                    job = {"kind": "resume", "session_id": sid}
                elif action == "open":
                    job = None
                else:
                    return nothing
                values = list(ui.view_values(service.view(owner, sid)))
            except UserError as e:
                return (None, *ui.notice_only(str(e)))
            viewing.show(request, sid)
            if job:  # the panel waits for the engine; Resume is hidden while it runs
                values[ui.view_outputs.index(ui.margins.panel)] = render.panel_html(service.waiting(owner, sid))
                values[ui.view_outputs.index(ui.controls.resume)] = gr.update(visible=False)
            return (job, *values)

        # always_last: an Open pressed while the previous one is still pending runs once that one is done
        # (Gradio's default for a click, "once", would drop it: the library would say one reading, the panel
        # show another).
        ui.then_read(self.library.click(on_library, inputs=[ui.owner], outputs=[self.job, *ui.view_outputs],
                                        concurrency_limit=None, trigger_mode="always_last", **QUIET
                                        ).then(ui.refresh_library, inputs=[ui.owner, ui.session_state],
                                               outputs=[self.library], **QUIET).then, job=self.job)


@dataclass
class MarginPanel:
    """The margin cards as they are written, with the reader's marks (relevant / irrelevant) on them."""
    panel: gr.HTML

    @classmethod
    def layout(cls) -> "MarginPanel":
        return cls(gr.HTML(render.empty_panel(ready=False), js_on_load=static_text("panel.js"),
                           elem_id="margin-panel"))

    def wire(self, ui: "Screen") -> None:
        service = ui.service

        def on_flip(owner, evt: gr.EventData):
            data = getattr(evt, "_data", None) or {}
            try:
                index, mark, session_id = int(data["index"]), bool(data["mark"]), str(data["session"])
            except (KeyError, TypeError, ValueError):
                return
            try:
                if not service.set_mark(owner, session_id, index, mark):
                    gr.Warning("That margin isn't finished yet, so it can't be marked.")
            except UserError as e:
                gr.Warning(str(e))

        self.panel.click(on_flip, inputs=[ui.owner], outputs=None, concurrency_limit=1, concurrency_id="marks",
                         trigger_mode="multiple", **QUIET)


@dataclass
class PassagePanel:
    """The passage behind a margin (or an answer's chip), as text and, for a PDF, as its page."""
    text: gr.HTML
    page: gr.HTML

    @classmethod
    def layout(cls) -> "PassagePanel":
        with gr.Tabs(elem_id="passage-tabs"):
            with gr.Tab("Passage", id="passage-text-tab", elem_id="passage-text-tab"):
                text = gr.HTML(render.empty_passage(), js_on_load=static_text("passage.js"),
                               elem_id="passage-text")
            with gr.Tab("Page", id="passage-page-tab", elem_id="passage-page-tab"):
                page = gr.HTML(render.page_html(None, None, None), js_on_load=static_text("page.js"),
                               elem_id="passage-page")
        return cls(text, page)

    def wire(self, ui: "Screen") -> None:
        service = ui.service

        def on_passage(owner, session_id, evt: gr.EventData):
            """A margin card, a map cell or an answer chip was clicked (or the open-passage key pressed)."""
            data = getattr(evt, "_data", None) or {}
            try:
                index = int(data["index"])
            except (KeyError, TypeError, ValueError):
                return gr.skip(), gr.skip(), gr.skip()
            if data.get("session") and data["session"] != session_id:
                return gr.skip(), gr.skip(), gr.skip()  # a click on a panel that is being replaced
            try:
                shown = service.passage(owner, session_id, index)
            except UserError as e:
                return gr.skip(), gr.skip(), render.notice_html(str(e))
            return render.passage_view_html(shown.text), render.page_view_html(shown.page), ""

        for source in (ui.margins.panel, ui.answer.answers):
            source.select(on_passage, inputs=[ui.owner, ui.session_state],
                          outputs=[self.text, self.page, ui.document.notice], concurrency_limit=4,
                          trigger_mode="always_last", **QUIET)


@dataclass
class AnswerPanel:
    """Answer (and follow-up questions) from the margins kept, and Export of the whole session."""
    answers: gr.HTML     # the answers, newest first, each with the margins it used
    answer: gr.Button
    export: gr.Button
    downloads: gr.File   # the exported Markdown and JSON

    @classmethod
    def layout(cls) -> "AnswerPanel":
        with gr.Row(elem_id="answer-row"):
            answer = gr.Button("Answer", variant="primary", elem_id="answer-btn", scale=2)
            export = gr.Button("Export", elem_id="export-btn", scale=1)
        answers = gr.HTML(render.answers_html([]), js_on_load=static_text("answers.js"), elem_id="answers")
        return cls(answers=answers, answer=answer, export=export,
                   downloads=gr.File(label="Downloads", file_count="multiple", visible=False, interactive=False,
                                     elem_id="downloads"))

    def wire(self, ui: "Screen") -> None:
        service, notice = ui.service, ui.document.notice

        def on_answer(owner, session_id, text, request: gr.Request):
            try:
                job = service.start_answer(owner, session_id, text, tab=request.session_hash)
            except UserError as e:
                return None, render.notice_html(str(e))
            return {"kind": "answer", **job}, ""

        def answer_job(owner, job, request: gr.Request):
            if not job or job.get("kind") != "answer":
                yield tuple(gr.skip() for _ in range(5))
                return
            sid = job["session_id"]
            try:
                for u in ui.to_tab(on_screen(service.answer_stream(owner, sid, job["question"])), owner, sid,
                                   request):
                    yield (u.get("answers", gr.skip()), u.get("panel", gr.skip()),
                           ui.library_now(owner, sid, request) if u.get("sessions") else gr.skip(),
                           gr.update(visible=u["resume"]) if "resume" in u else gr.skip(), u.get("notice", gr.skip()))
            except UserError as e:
                yield (gr.skip(), gr.skip(), gr.skip(), gr.skip(), render.notice_html(str(e)))

        self.answer.click(on_answer, inputs=[ui.owner, ui.session_state, ui.document.question],
                          outputs=[ui.job_state, notice], concurrency_limit=None, **QUIET
                          ).success(answer_job, inputs=[ui.owner, ui.job_state],
                                    outputs=[self.answers, ui.margins.panel, ui.library.library, ui.controls.resume,
                                             notice],
                                    concurrency_limit=ui.slots, concurrency_id=ENGINE, show_progress="minimal",
                                    show_progress_on=[self.answers], **PRIVATE
                                    ).then(ui.refresh_library, inputs=[ui.owner, ui.session_state],
                                           outputs=[ui.library.library], **QUIET)

        def on_export(owner, session_id):
            try:
                return gr.update(value=service.export(owner, session_id), visible=True), ""
            except UserError as e:
                return gr.skip(), render.notice_html(str(e))

        self.export.click(on_export, inputs=[ui.owner, ui.session_state], outputs=[self.downloads, notice],
                          concurrency_limit=None, **QUIET)


# ---------------------------------------------------------------- the screen: the panels and what they share

class Screen:
    """Every panel, the per-browser state, and what several panels' events share: a session's view, a job's
    stream to the tab that started it, the reading job and the library's refresh."""

    def __init__(self, service: Service, secret: str, login: bool = False):
        self.service, self.viewing = service, Viewing()
        self.slots = worker.job_slots(service.engine)  # 1 on a local model; several on a model server
        self.browser = gr.BrowserState(None, storage_key=BROWSER_KEY, secret=secret)
        # Whose library this tab shows, set by the load event: the logged-in account's (`hf:<username>`), else
        # the browser's id. Kept on the server (a gr.State), so a page cannot claim another owner.
        self.owner = gr.State(None)
        self.session_state = gr.State(None)   # the open session's id
        self.doc_state = gr.State(None)       # the document a new Read would read
        self.job_state = gr.State(None)       # what the engine step should do: {"kind", "session_id", ...}
        self.header = gr.HTML(render.header_html(service.engine.lm.info), js_on_load=None, elem_id="mg-header")
        with gr.Row(equal_height=False):
            with gr.Column(scale=5, min_width=360):
                # Only where it logs in for real (a Space with hf_oauth) or in the test mode: Gradio adds its login
                # routes as soon as a LoginButton exists, and off a Space they would ask the Hub who is logged in.
                self.login = gr.LoginButton(size="sm", elem_id="login-btn") if login else None
                self.model = ModelPanel.layout(service)
                self.document = DocumentPanel.layout()
                self.controls = ReadControls.layout()
                self.settings = SettingsPanel.layout(service)
                self.library = LibraryPanel.layout()
                self.now_reading = gr.HTML(render.empty_segment(), js_on_load=static_text("segment.js"),
                                           elem_id="segment-view")
            with gr.Column(scale=7, min_width=420):
                self.margins = MarginPanel.layout()
                self.passage = PassagePanel.layout()
                self.answer = AnswerPanel.layout()
        s, d = self.settings, self.document
        self.view_outputs = [self.session_state, self.doc_state, d.info, d.question, *s.inputs, self.margins.panel,
                             self.answer.answers, self.now_reading, self.controls.resume, d.notice, self.passage.text,
                             self.passage.page]

    def wire(self, demo: gr.Blocks) -> None:
        for panel in (self.model, self.document, self.controls, self.settings, self.library, self.margins,
                      self.passage, self.answer):
            panel.wire(self)
        service, viewing = self.service, self.viewing

        def on_load(browser, request: gr.Request, profile: gr.OAuthProfile | None):
            """The tab's owner (see owner_of) and where its reader left off. Gradio passes the profile of the
            account logged in with the LoginButton, else None (always None where there is no LoginButton)."""
            browser = browser or uuid.uuid4().hex
            owner = owner_of(browser, profile)
            newest = service.last_opened(owner)  # where the reader left off
            viewing.show(request, newest)
            if newest is None:
                return (browser, owner, *self.blank_view())
            return (browser, owner, *self.view_values(service.view(owner, newest)))

        demo.load(on_load, inputs=[self.browser], outputs=[self.browser, self.owner, *self.view_outputs], **QUIET
                  ).then(self.refresh_library, inputs=[self.owner, self.session_state],
                         outputs=[self.library.library], **QUIET)

        def on_unload(request: gr.Request):
            viewing.close(request)
            if request is not None and request.session_hash:
                service.release_tab(request.session_hash)  # its queued events are gone with it

        demo.unload(on_unload)

    # ---------------------------------------------------------- a session's view

    def blank_view(self) -> tuple:
        return (None, None, render.no_document(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(),
                gr.skip(), render.empty_panel(), render.answers_html([]), render.empty_segment(),
                gr.update(visible=False), "", render.empty_passage(), render.page_html(None, None, None))

    def view_values(self, v: SessionView) -> tuple:
        s = v.settings
        return (v.session_id, v.document_id, render.document_card_html(v.document), v.question, s.segment_tokens,
                s.margin_tokens, s.answer_tokens, s.classifier, s.margins, render.panel_html(v.panel),
                render.answers_html(v.answers), render.segment_view_html(v.segment), gr.update(visible=v.resume),
                render.notice_html(v.notice, "info") if v.notice else "", render.passage_view_html(v.passage.text),
                render.page_view_html(v.passage.page))

    def notice_only(self, message: str) -> tuple:
        """view_outputs left as they are, but for the notice."""
        return tuple(render.notice_html(message) if c is self.document.notice else gr.skip()
                     for c in self.view_outputs)

    def refresh_library(self, owner, session_id):
        return render.library_html(self.service.library(owner, session_id))

    def library_now(self, owner, session_id: str, request: gr.Request) -> str:
        """The library as a job changes it (a reading ended), marking the session this tab shows."""
        return render.library_html(self.service.library(owner, self.viewing.showing(request, session_id)))

    # ---------------------------------------------------------- jobs

    def shown_now(self, owner, showing: str | None) -> dict:
        """What the tab shows of its session now, for a job's repaint (see to_tab)."""
        if showing is None:
            return {"panel": render.empty_panel(), "segment": render.empty_segment(),
                    "answers": render.answers_html([]), "resume": False}
        try:
            v = self.service.view(owner, showing)
        except UserError:
            return {}
        return {"panel": render.panel_html(v.panel), "segment": render.segment_view_html(v.segment),
                "answers": render.answers_html(v.answers), "resume": v.resume}

    def to_tab(self, updates, owner: str, session_id: str, request: gr.Request):
        """A job's updates for the tab that started it: all of them while the tab shows the job's session,
        only the library and notices once it shows another. At that switch the job repaints what the
        tab shows, once: its last update, painted just before the switch, may reach the page after the
        opened session's own answer and would otherwise stay on screen."""
        painted = False
        try:
            for update in updates:
                showing = self.viewing.showing(request, session_id)
                if showing != session_id:
                    if painted:
                        painted = False
                        yield self.shown_now(owner, showing)
                    update = {k: v for k, v in update.items() if k in ("sessions", "notice")}
                else:
                    painted = True
                yield update
        finally:
            updates.close()  # the page went away: the job's own clean-up runs now
        showing = self.viewing.showing(request, session_id)
        if painted and showing != session_id:
            yield self.shown_now(owner, showing)

    def read_job(self, owner, job, request: gr.Request):
        """The engine step of Read, Resume and the library's Continue."""
        if not job or job.get("kind") not in ("read", "resume"):
            yield tuple(gr.skip() for _ in range(5))
            return
        sid = job["session_id"]
        try:
            for u in self.to_tab(on_screen(self.service.read_stream(owner, sid, resume=job["kind"] == "resume")),
                                 owner, sid, request):
                yield (u.get("panel", gr.skip()), u.get("segment", gr.skip()),
                       self.library_now(owner, sid, request) if u.get("sessions") else gr.skip(),
                       gr.update(visible=u["resume"]) if "resume" in u else gr.skip(), u.get("notice", gr.skip()))
        except UserError as e:
            yield (gr.skip(), gr.skip(), gr.skip(), gr.skip(), render.notice_html(str(e)))

    def then_read(self, then, job: gr.State | None = None) -> None:
        """After `then` (an event's .success or .then): the reading job (`job`, else job_state) in the engine
        slot, then the library."""
        then(self.read_job, inputs=[self.owner, self.job_state if job is None else job],
             outputs=[self.margins.panel, self.now_reading, self.library.library, self.controls.resume,
                      self.document.notice],
             concurrency_limit=self.slots, concurrency_id=ENGINE, show_progress="minimal",
             show_progress_on=[self.margins.panel], **PRIVATE
             ).then(self.refresh_library, inputs=[self.owner, self.session_state],
                    outputs=[self.library.library], **QUIET)


def owner_of(browser: str, profile: "gr.OAuthProfile | None") -> str:
    """Whose library a tab shows: a logged-in account's (`hf:<username>`: it follows the account from browser to
    browser), else this browser's (its id, kept in its localStorage), as without a login."""
    return ACCOUNT + profile.username if profile is not None and profile.username else browser


def login_available() -> bool:
    """A Space with `hf_oauth: true` in its front matter: Gradio's LoginButton logs in with Hugging Face there
    (the platform sets OAUTH_CLIENT_ID and the rest). Off a Space there is no login."""
    from gradio.utils import get_space
    return get_space() is not None and bool(os.environ.get("OAUTH_CLIENT_ID"))


def fake_login(username: str) -> None:
    """The test mode's login (app.py --test-login): Gradio's own login routes off a Space, which put a profile in
    the session cookie without asking Hugging Face, here `username`'s instead of the machine's Hub account."""
    import gradio.oauth
    if os.environ.get("SPACE_ID"):
        raise RuntimeError("--test-login is refused on a Space: there the login is Hugging Face's")

    def info() -> dict:
        return {"access_token": "test-login", "token_type": "bearer", "scope": "openid profile",
                "expires_at": int(time.time()) + 8 * 3600,
                "userinfo": {"name": username.title(), "preferred_username": username,
                             "profile": f"https://huggingface.co/{username}", "picture": ""}}

    gradio.oauth._get_mocked_oauth_info = info


def build(service: Service, secret: str, login: bool = False) -> gr.Blocks:
    """The screen, panel by panel: each panel lays out its components, then wires its own events. `login`: show
    Hugging Face's login (login_available(), or the test mode), which makes the library follow the account."""
    with gr.Blocks(title="Marginalia") as demo:
        screen = Screen(service, secret, login)
        screen.wire(demo)
        add_api(service)  # the API (gradio_client)
    return demo


def add_api(service: Service) -> None:
    """/read and /answer for gradio_client. `owner` is any string the client keeps (sessions created with it
    belong to it); left empty, /read makes one up and returns it."""
    slots = worker.job_slots(service.engine)
    with gr.Column(visible=False):
        a_file = gr.File(label="document", type="filepath")
        a_question = gr.Textbox(label="question")
        a_seg = gr.Number(label="segment_tokens", value=service.defaults.segment_tokens, precision=0)
        a_margin = gr.Number(label="margin_tokens", value=service.defaults.margin_tokens, precision=0)
        a_answer = gr.Number(label="answer_tokens", value=service.defaults.answer_tokens, precision=0)
        a_clf = gr.Textbox(label="classifier", value=service.defaults.classifier)
        a_owner = gr.Textbox(label="owner", value="")
        a_session = gr.Textbox(label="session_id", value="")
        a_out = gr.JSON(label="result")
        a_read = gr.Button("read")
        a_ask = gr.Button("answer")

    def api_read(path, question, segment_tokens, margin_tokens, answer_tokens, classifier, owner):
        """Read a document with a question: writes a margin note per segment. Streams progress; the last
        result has every margin. Returns {session_id, owner, status, margins: [...]}."""
        try:
            owner = api_owner(owner) or f"api-{uuid.uuid4().hex}"
            doc_id, _ = service.add_upload(path)
            settings = service.settings(segment_tokens, margin_tokens, answer_tokens, classifier)
            session_id = service.start_read(owner, doc_id, question, settings)
            panel, seen = Panel(session_id), 0
            for event in service.read_stream(owner, session_id):
                if isinstance(event, PanelChanged):
                    panel = event.panel
                    if event.segment is not None and panel.done_count != seen:
                        seen = panel.done_count
                        yield read_summary(owner, question.strip(), panel)
                elif isinstance(event, JobEnded):
                    yield read_summary(owner, question.strip(), event.panel or panel, event.session)
        except UserError as e:
            raise gr.Error(str(e)) from e

    def api_answer(owner, session_id, question):
        """Answer a question about a session read before, from the margins kept (the reader's marks, else the
        classifier's verdicts). Returns {session_id, question, answer, reasoning (what the answer said before it;
        "" for none), margins_used (segment indexes, from 0), seconds}."""
        try:
            owner = api_owner(owner)
            job = service.start_answer(owner, session_id, question)
            answer = None
            events = service.answer_stream(owner, session_id, job["question"])
            try:
                for event in events:
                    if isinstance(event, Message) and event.text and event.kind == "error":
                        raise UserError(event.text)
                    if isinstance(event, Answered):
                        answer = event.answer
            finally:
                events.close()
            if answer is None:
                raise UserError("No answer was written.")
            return {"session_id": session_id, "question": answer.question, "answer": answer.text,
                    "reasoning": answer.reasoning, "margins_used": answer.used, "seconds": answer.seconds}
        except UserError as e:
            raise gr.Error(str(e)) from e

    a_read.click(api_read, inputs=[a_file, a_question, a_seg, a_margin, a_answer, a_clf, a_owner], outputs=a_out,
                 api_name="read", concurrency_limit=slots, concurrency_id=ENGINE)
    a_ask.click(api_answer, inputs=[a_owner, a_session, a_question], outputs=a_out, api_name="answer",
                concurrency_limit=slots, concurrency_id=ENGINE)


def api_owner(owner: str | None) -> str:
    """An API client's owner string. An account's library (`hf:<username>`) is only for a tab logged in as it:
    the API has no login, and a username is no secret."""
    owner = (owner or "").strip()
    if owner.startswith(ACCOUNT):
        raise UserError("An account's library is only open to its login in the app, not through the API.")
    return owner


def read_summary(owner: str, question: str, panel: Panel, session: dict | None = None) -> dict:
    """What /read returns of a reading: its margins so far (the panel's finished cards) and, once it has ended,
    the stored session's status and counts."""
    margins = [{"segment": c.index, "pages": list(c.pages) if c.pages else None, "text": c.text,
                "relevant": c.verdict, "score": c.score, "mark": c.mark}
               for _, c in sorted(panel.cards.items()) if c.done]
    summary = {"session_id": panel.session_id, "owner": owner, "status": "reading", "question": question,
               "segments_total": panel.total, "segments_read": len(margins),
               "server_prompt_tokens": None, "server_cached_tokens": None, "reuse": None, "margins": margins}
    if session is not None:
        sent, cached = session.get("server_prompt_tokens"), session.get("server_cached_tokens")
        summary.update(status=session["status"], question=session["question"],
                       segments_total=session["segments_total"], segments_read=session["segments_read"],
                       # Through a model server: prompt tokens sent for the reading, and the share found in its
                       # prefix cache.
                       server_prompt_tokens=sent, server_cached_tokens=cached, reuse=cached / sent if sent else None)
    return summary


def on_screen(events: Iterator[Update]) -> Iterator[dict]:
    """A job's events as what changes on screen: HTML for the panel, the segment, the answers and the notice;
    `resume` (Resume's visibility) and `sessions` (the library changed). Closing it closes the job's stream."""
    try:
        for event in events:
            update = screen_update(event)
            if update:
                yield update
    finally:
        events.close()


def screen_update(event: Update) -> dict:
    if isinstance(event, JobStarted):
        return {"panel": render.panel_html(event.panel), "resume": False}
    if isinstance(event, PanelChanged):
        shown = {"panel": render.panel_html(event.panel)}
        if event.segment is not None:
            shown["segment"] = render.segment_view_html(event.segment)
        return shown
    if isinstance(event, AnswersChanged):
        return {"answers": render.answers_html(event.answers)}
    if isinstance(event, Message):
        return {"notice": render.notice_html(event.text, event.kind)}
    if isinstance(event, JobEnded):
        shown = {"resume": event.resume, "sessions": True}
        if event.panel is not None:
            shown["panel"] = render.panel_html(event.panel)
        if event.answers is not None:
            shown["answers"] = render.answers_html(event.answers)
        return shown
    return {}  # Answered: the answers that follow show it
