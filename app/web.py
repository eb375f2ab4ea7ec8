"""Marginalia's screen, in Gradio 6. The logic lives in app/service.py; this module lays out components and
wires events to it.

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
import threading
import time
import uuid
from pathlib import Path

import gradio as gr

from . import render, worker
from .library import library_html
from .passage import empty_passage, page_html
from .service import Service, UserError

log = logging.getLogger(__name__)

STATIC = Path(__file__).resolve().parent.parent / "static"
ENGINE = "engine"  # the concurrency group of everything that runs the model
BROWSER_KEY = "marginalia-browser"
CLASSIFIERS = [("The note itself (copied something or said nothing)", "margin"),
               ("LLM (the reading model says yes/no)", "llm"), ("Embedding similarity (MiniLM)", "embedding"),
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
    session meanwhile, the stream keeps going (and saving) without painting over what they are looking at.

    It also tells a pick in the sessions list from its echo: Gradio 6's Dropdown fires `input` twice for one
    pick with the mouse (when the option is chosen, then again on the blur that follows), and both requests
    arrive within milliseconds. Only the first opens the session; the echo returns at once, so it neither
    renders the session a second time nor stays pending (a pending `input` event is what a next pick waits
    behind)."""

    ECHO_S = 1.0  # the same session asked for again by the same tab within this long: the pick's echo

    def __init__(self):
        self._tabs: dict[str, str | None] = {}
        self._picks: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()

    def show(self, request: gr.Request | None, session_id: str | None) -> None:
        if request is not None and request.session_hash:
            self._tabs[request.session_hash] = session_id
            with self._lock:  # shown by other means (Read, the library, ...): a pick of it is no echo
                if self._picks.get(request.session_hash, (None,))[0] != session_id:
                    self._picks.pop(request.session_hash, None)

    def showing(self, request: gr.Request | None, session_id: str | None) -> str | None:
        """The session this tab shows; `session_id` itself for a request from no known tab (the API)."""
        if request is None or not request.session_hash:
            return session_id
        return self._tabs.get(request.session_hash, session_id)

    def first_pick(self, request: gr.Request | None, session_id: str) -> bool:
        """False for the echo of a pick this tab just made (see the class docstring)."""
        if request is None or not request.session_hash:
            return True
        now = time.monotonic()
        with self._lock:
            last = self._picks.get(request.session_hash)
            self._picks[request.session_hash] = (session_id, now)
        return not (last and last[0] == session_id and now - last[1] < self.ECHO_S)

    def close(self, request: gr.Request | None) -> None:
        if request is not None and request.session_hash:
            self._tabs.pop(request.session_hash, None)
            with self._lock:
                self._picks.pop(request.session_hash, None)


def model_choices(service: Service) -> list[tuple[str, str]]:
    """(label, spec) for the picker: name, size on disk, context window, measured writing speed."""
    return [(render.model_choice_label(m), m["spec"]) for m in service.models()]


def build(service: Service, secret: str) -> gr.Blocks:
    info = service.engine.lm.info
    d = service.defaults
    viewing = Viewing()
    slots = worker.job_slots(service.engine)  # 1 on a local model; several on a model server
    with gr.Blocks(title="Marginalia") as demo:
        browser = gr.BrowserState(None, storage_key=BROWSER_KEY, secret=secret)
        session_state = gr.State(None)   # the open session's id
        doc_state = gr.State(None)       # the document a new Read would read
        job_state = gr.State(None)       # what the engine step should do: {"kind", "session_id", ...}

        header = gr.HTML(render.header_html(info), js_on_load=None, elem_id="mg-header")
        with gr.Row(equal_height=False):
            with gr.Column(scale=5, min_width=360):
                local = service.engine.lm.serial  # a model server serves one model: switch it there
                model_picker = gr.Dropdown(choices=model_choices(service), value=service.engine.lm.spec,
                                           label="Model", elem_id="model-picker", interactive=local,
                                           info="Switching loads the new model once; a reading keeps the model "
                                                "that wrote its margins." if local else
                                                "Served by a model server (--backend openai): readings run side by "
                                                "side there.")
                upload = gr.File(label="Document (.txt, .md, .pdf, .epub)", type="filepath", elem_id="doc-file",
                                 height=120)
                doc_info = gr.HTML(render.no_document(), js_on_load=None, elem_id="doc-info")
                notice = gr.HTML("", js_on_load=None, elem_id="notice")
                question = gr.Textbox(label="Question", lines=2, max_lines=6, elem_id="question",
                                      placeholder="What do you want to know from this document?")
                with gr.Row(elem_id="read-row"):
                    read_btn = gr.Button("Read", variant="primary", elem_id="read-btn", scale=2)
                    stop_btn = gr.Button("Stop", variant="stop", elem_id="stop-btn", scale=1)
                    resume_btn = gr.Button("Resume", variant="secondary", elem_id="resume-btn", scale=1,
                                           visible=False)
                with gr.Accordion("Settings", open=False, elem_id="settings"):
                    seg_size = gr.Slider(64, 2048, value=d.segment_tokens, step=16, label="Segment size (tokens)",
                                         info="How much text the model reads before writing a margin note.",
                                         elem_id="segment-tokens")
                    margin_len = gr.Slider(8, 256, value=d.margin_tokens, step=8, label="Margin length (tokens)",
                                           info="The longest margin note.", elem_id="margin-tokens")
                    answer_len = gr.Slider(16, 512, value=d.answer_tokens, step=16, label="Answer length (tokens)",
                                           elem_id="answer-tokens")
                    classifier = gr.Radio(CLASSIFIERS, value=d.classifier, label="Relevance classifier",
                                          info="Decides which margins look relevant; you can flip any of them.",
                                          elem_id="classifier")
                    margin_style = gr.Radio(MARGIN_STYLES, value=d.margins, label="Margin notes",
                                            info="Copied notes are quoted from the text, so each one can be checked.",
                                            elem_id="margin-style")
                    model_info = gr.HTML(render.model_info_html(info, service.rates), js_on_load=None,
                                         elem_id="model-info")
                with gr.Accordion("Library", open=True, elem_id="sessions-box"):
                    library = gr.HTML(library_html([]), js_on_load=static_text("library.js"), elem_id="library")
                    sessions = gr.Dropdown(choices=[], value=None, label="Reopen an earlier reading",
                                           elem_id="sessions", interactive=True)
                    with gr.Row():
                        delete_btn = gr.Button("Delete this session", size="sm", variant="secondary",
                                               elem_id="delete-btn")
                segment_view = gr.HTML(render.empty_segment(), js_on_load=static_text("segment.js"),
                                       elem_id="segment-view")
            with gr.Column(scale=7, min_width=420):
                panel = gr.HTML(render.empty_panel(ready=False), js_on_load=static_text("panel.js"), elem_id="margin-panel")
                with gr.Tabs(elem_id="passage-tabs"):
                    with gr.Tab("Passage", id="passage-text-tab", elem_id="passage-text-tab"):
                        passage_text = gr.HTML(empty_passage(), js_on_load=static_text("passage.js"),
                                               elem_id="passage-text")
                    with gr.Tab("Page", id="passage-page-tab", elem_id="passage-page-tab"):
                        passage_page = gr.HTML(page_html(None, None, None), js_on_load=static_text("page.js"),
                                               elem_id="passage-page")
                with gr.Row(elem_id="answer-row"):
                    answer_btn = gr.Button("Answer", variant="primary", elem_id="answer-btn", scale=2)
                    export_btn = gr.Button("Export", elem_id="export-btn", scale=1)
                answers = gr.HTML(render.answers_html([]), js_on_load=static_text("answers.js"), elem_id="answers")
                downloads = gr.File(label="Downloads", file_count="multiple", visible=False, interactive=False,
                                    elem_id="downloads")

        settings_inputs = [seg_size, margin_len, answer_len, classifier, margin_style]
        view_outputs = [session_state, doc_state, doc_info, question, seg_size, margin_len, answer_len, classifier,
                        margin_style,
                        panel, answers, segment_view, resume_btn, notice, passage_text, passage_page]

        # ---------------------------------------------------------- helpers

        def blank_view():
            return (None, None, render.no_document(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(),
                    gr.skip(), render.empty_panel(), render.answers_html([]), render.empty_segment(),
                    gr.update(visible=False), "", empty_passage(), page_html(None, None, None))

        def view_values(v: dict):
            s = v["settings"]
            return (v["session_id"], v["document_id"], v["document"], v["question"], s.segment_tokens,
                    s.margin_tokens, s.answer_tokens, s.classifier, s.margins, v["panel"], v["answers"], v["segment"],
                    gr.update(visible=v["resume"]), render.notice_html(v["notice"], "info") if v["notice"] else "",
                    v["passage"], v["page"])

        def notice_only(message: str) -> tuple:
            """view_outputs left as they are, but for the notice."""
            return tuple(render.notice_html(message) if c is notice else gr.skip() for c in view_outputs)

        def session_choices(owner, selected=None):
            return gr.update(choices=service.sessions(owner), value=selected)

        def listed(owner):
            """The sessions list's entries, with its selection left alone. A job's update of the list must not
            set the selection: one computed just before the reader picked another session can reach the page
            after that pick's own answer (Gradio keeps the order of one event's messages, not across events)."""
            return gr.update(choices=service.sessions(owner))

        def shown_now(owner, showing: str | None) -> dict:
            """What the tab shows of its session now, for a job's repaint (see to_tab)."""
            if showing is None:
                return {"panel": render.empty_panel(), "segment": render.empty_segment(),
                        "answers": render.answers_html([]), "resume": False}
            try:
                v = service.view(owner, showing)
            except UserError:
                return {}
            return {k: v[k] for k in ("panel", "segment", "answers", "resume")}

        def to_tab(updates, owner: str, session_id: str, request: gr.Request):
            """A job's updates for the tab that started it: all of them while the tab shows the job's session,
            only the sessions list and notices once it shows another. At that switch the job repaints what the
            tab shows, once: its last update, painted just before the switch, may reach the page after the
            opened session's own answer and would otherwise stay on screen."""
            painted = False
            try:
                for update in updates:
                    showing = viewing.showing(request, session_id)
                    if showing != session_id:
                        if painted:
                            painted = False
                            yield shown_now(owner, showing)
                        update = {k: v for k, v in update.items() if k in ("sessions", "notice")}
                    else:
                        painted = True
                    yield update
            finally:
                updates.close()  # the page went away: the job's own clean-up runs now
            showing = viewing.showing(request, session_id)
            if painted and showing != session_id:
                yield shown_now(owner, showing)

        # ---------------------------------------------------------- page load and sessions

        def on_load(owner, request: gr.Request):
            owner = owner or uuid.uuid4().hex
            choices = service.sessions(owner)
            if not choices:
                viewing.show(request, None)
                return (owner, gr.update(choices=[], value=None), *blank_view())
            newest = service.last_opened(owner) or choices[0][1]  # where the reader left off
            viewing.show(request, newest)
            return (owner, gr.update(choices=choices, value=newest), *view_values(service.view(owner, newest)))

        def refresh_library(owner, session_id):
            return service.library_html(owner, session_id)

        demo.load(on_load, inputs=[browser], outputs=[browser, sessions, *view_outputs], api_visibility="private",
                  show_progress="hidden"
                  ).then(refresh_library, inputs=[browser, session_state], outputs=[library], api_visibility="private",
                         show_progress="hidden")

        def on_open(owner, session_id, request: gr.Request):
            if not session_id or not viewing.first_pick(request, session_id):
                return tuple(gr.skip() for _ in view_outputs)
            try:
                values = view_values(service.view(owner, session_id))
                viewing.show(request, session_id)
                return values
            except UserError as e:
                return notice_only(str(e))

        # always_last: a pick made while the previous one is still pending runs once that one is done (Gradio's
        # default, "once", would drop it: the list would show the new pick and the panel the old one).
        # The library follows through session_state.change (below): no .then here, which would run for the
        # pick's echo too.
        sessions.input(on_open, inputs=[browser, sessions], outputs=view_outputs, api_visibility="private",
                       concurrency_limit=None, show_progress="hidden", trigger_mode="always_last")

        def on_delete(owner, session_id, request: gr.Request):
            try:
                if not session_id:
                    raise UserError("No session is open.")
                service.delete(owner, session_id)
            except UserError as e:
                return (gr.skip(), *notice_only(str(e)))
            choices = service.sessions(owner)
            if not choices:
                viewing.show(request, None)
                return (gr.update(choices=[], value=None), *blank_view())
            newest = choices[0][1]
            viewing.show(request, newest)
            return (gr.update(choices=choices, value=newest), *view_values(service.view(owner, newest)))

        delete_btn.click(on_delete, inputs=[browser, session_state], outputs=[sessions, *view_outputs],
                         api_visibility="private", concurrency_limit=None, show_progress="hidden"
                         ).then(refresh_library, inputs=[browser, session_state], outputs=[library],
                                api_visibility="private", show_progress="hidden")

        # ---------------------------------------------------------- the document

        def on_upload(owner, path, *settings):
            try:
                doc_id, notices = service.add_upload(path)
                return (doc_id, service.document_html(doc_id, service.settings(*settings)),
                        render.notice_html(" ".join(notices), "info"))
            except UserError as e:
                return None, render.no_document(), render.notice_html(str(e))

        upload.upload(on_upload, inputs=[browser, upload, *settings_inputs], outputs=[doc_state, doc_info, notice],
                      api_visibility="private", concurrency_limit=4)

        def on_settings(doc_id, *settings):
            try:
                return service.document_html(doc_id, service.settings(*settings)), ""
            except UserError as e:
                return gr.skip(), render.notice_html(str(e))

        for control in (seg_size, margin_len):
            control.release(on_settings, inputs=[doc_state, *settings_inputs], outputs=[doc_info, notice],
                            api_visibility="private", show_progress="hidden")
        classifier.input(on_settings, inputs=[doc_state, *settings_inputs], outputs=[doc_info, notice],
                         api_visibility="private", show_progress="hidden")

        # ---------------------------------------------------------- read, resume, stop

        def on_read(owner, doc_id, text, segment_tokens, margin_tokens, answer_tokens, classifier_name, margins_name,
                    request: gr.Request):
            try:
                settings = service.settings(segment_tokens, margin_tokens, answer_tokens, classifier_name,
                                            margins_name)
                session_id = service.start_read(owner, doc_id, text, settings, tab=request.session_hash)
            except UserError as e:
                return (None, gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), render.notice_html(str(e)),
                        gr.skip())
            viewing.show(request, session_id)
            job = {"kind": "read", "session_id": session_id}
            return (job, session_id, service.waiting_panel(owner, session_id), render.answers_html([]),
                    render.empty_segment(), session_choices(owner, session_id), "", gr.update(visible=False))

        def on_resume(owner, session_id, request: gr.Request):
            try:
                service.start_resume(owner, session_id, tab=request.session_hash)
            except UserError as e:
                return None, gr.skip(), render.notice_html(str(e)), gr.skip()
            viewing.show(request, session_id)
            return ({"kind": "resume", "session_id": session_id}, service.waiting_panel(owner, session_id), "",
                    gr.update(visible=False))

        def read_job(owner, job, request: gr.Request):
            if not job or job.get("kind") not in ("read", "resume"):
                yield tuple(gr.skip() for _ in range(5))
                return
            sid = job["session_id"]
            try:
                for u in to_tab(service.read_stream(owner, sid, resume=job["kind"] == "resume"), owner, sid, request):
                    yield (u.get("panel", gr.skip()), u.get("segment", gr.skip()),
                           listed(owner) if u.get("sessions") else gr.skip(),
                           gr.update(visible=u["resume"]) if "resume" in u else gr.skip(), u.get("notice", gr.skip()))
            except UserError as e:
                yield (gr.skip(), gr.skip(), gr.skip(), gr.skip(), render.notice_html(str(e)))

        stream_out = [panel, segment_view, sessions, resume_btn, notice]
        read_btn.click(on_read, inputs=[browser, doc_state, question, *settings_inputs],
                       outputs=[job_state, session_state, panel, answers, segment_view, sessions, notice, resume_btn],
                       api_visibility="private", concurrency_limit=None, show_progress="hidden"
                       ).success(read_job, inputs=[browser, job_state], outputs=stream_out, api_visibility="private",
                                 concurrency_limit=slots, concurrency_id=ENGINE, show_progress="minimal",
                                 show_progress_on=[panel]
                                 ).then(refresh_library, inputs=[browser, session_state], outputs=[library],
                                        api_visibility="private", show_progress="hidden")
        resume_btn.click(on_resume, inputs=[browser, session_state], outputs=[job_state, panel, notice, resume_btn],
                         api_visibility="private", concurrency_limit=None, show_progress="hidden"
                         ).success(read_job, inputs=[browser, job_state], outputs=stream_out, api_visibility="private",
                                   concurrency_limit=slots, concurrency_id=ENGINE, show_progress="minimal",
                                   show_progress_on=[panel]
                                   ).then(refresh_library, inputs=[browser, session_state], outputs=[library],
                                          api_visibility="private", show_progress="hidden")

        def on_stop(owner, session_id):
            try:
                if not session_id or not service.stop(owner, session_id):
                    return render.notice_html("Nothing is running.", "info")
            except UserError as e:
                return render.notice_html(str(e))
            return ""

        stop_btn.click(on_stop, inputs=[browser, session_state], outputs=[notice], api_visibility="private",
                       concurrency_limit=None, concurrency_id="stop", show_progress="hidden")

        # ---------------------------------------------------------- marks

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

        panel.click(on_flip, inputs=[browser], outputs=None, api_visibility="private", concurrency_limit=1,
                    concurrency_id="marks", trigger_mode="multiple", show_progress="hidden")

        # ---------------------------------------------------------- answer and export

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
                for u in to_tab(service.answer_stream(owner, sid, job["question"]), owner, sid, request):
                    yield (u.get("answers", gr.skip()), u.get("panel", gr.skip()),
                           listed(owner) if u.get("sessions") else gr.skip(),
                           gr.update(visible=u["resume"]) if "resume" in u else gr.skip(), u.get("notice", gr.skip()))
            except UserError as e:
                yield (gr.skip(), gr.skip(), gr.skip(), gr.skip(), render.notice_html(str(e)))

        answer_btn.click(on_answer, inputs=[browser, session_state, question], outputs=[job_state, notice],
                         api_visibility="private", concurrency_limit=None, show_progress="hidden"
                         ).success(answer_job, inputs=[browser, job_state],
                                   outputs=[answers, panel, sessions, resume_btn, notice], api_visibility="private",
                                   concurrency_limit=slots, concurrency_id=ENGINE, show_progress="minimal",
                                   show_progress_on=[answers]
                                   ).then(refresh_library, inputs=[browser, session_state], outputs=[library],
                                          api_visibility="private", show_progress="hidden")

        # ---------------------------------------------------------- the model picker

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

        model_picker.input(on_model, inputs=[model_picker], outputs=[model_picker, header, model_info, notice],
                           api_visibility="private", concurrency_limit=slots, concurrency_id=ENGINE,
                           show_progress="full", show_progress_on=[model_picker])

        def on_export(owner, session_id):
            try:
                return gr.update(value=service.export(owner, session_id), visible=True), ""
            except UserError as e:
                return gr.skip(), render.notice_html(str(e))

        export_btn.click(on_export, inputs=[browser, session_state], outputs=[downloads, notice],
                         api_visibility="private", concurrency_limit=None, show_progress="hidden")

        # ---------------------------------------------------------- passages and the library

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
            return shown["text"], shown["page"], ""

        for source in (panel, answers):
            source.select(on_passage, inputs=[browser, session_state], outputs=[passage_text, passage_page, notice],
                          api_visibility="private", concurrency_limit=4, show_progress="hidden",
                          trigger_mode="always_last")

        # A new reading (or another one opened) shows in the library at once; the job's end refreshes it again.
        session_state.change(refresh_library, inputs=[browser, session_state], outputs=[library],
                             api_visibility="private", show_progress="hidden")

        def on_library(owner, evt: gr.EventData, request: gr.Request):
            """Open, continue (resume) or delete a reading from the library."""
            data = getattr(evt, "_data", None) or {}
            action, sid = data.get("action"), str(data.get("session") or "")
            nothing = (None, gr.skip(), *(gr.skip() for _ in view_outputs))
            try:
                if action == "delete":
                    service.delete(owner, sid)
                    latest = service.last_opened(owner)
                    if latest is None:
                        viewing.show(request, None)
                        return (None, gr.update(choices=[], value=None), *blank_view())
                    sid, job = latest, None
                elif action == "continue":
                    service.start_resume(owner, sid, tab=request.session_hash)
                    job = {"kind": "resume", "session_id": sid}
                elif action == "open":
                    job = None
                else:
                    return nothing
                values = list(view_values(service.view(owner, sid)))
            except UserError as e:
                return (*nothing[:-len(view_outputs)], *notice_only(str(e)))
            viewing.show(request, sid)
            if job:  # the panel waits for the engine; Resume is hidden while it runs
                values[view_outputs.index(panel)] = service.waiting_panel(owner, sid)
                values[view_outputs.index(resume_btn)] = gr.update(visible=False)
            return (job, session_choices(owner, sid), *values)

        library.click(on_library, inputs=[browser], outputs=[job_state, sessions, *view_outputs],
                      api_visibility="private", concurrency_limit=None, show_progress="hidden"
                      ).then(refresh_library, inputs=[browser, session_state], outputs=[library],
                             api_visibility="private", show_progress="hidden"
                             ).then(read_job, inputs=[browser, job_state], outputs=stream_out,
                                    api_visibility="private", concurrency_limit=slots, concurrency_id=ENGINE,
                                    show_progress="minimal", show_progress_on=[panel]
                                    ).then(refresh_library, inputs=[browser, session_state], outputs=[library],
                                           api_visibility="private", show_progress="hidden")

        def on_unload(request: gr.Request):
            viewing.close(request)
            if request is not None and request.session_hash:
                service.release_tab(request.session_hash)  # its queued events are gone with it

        demo.unload(on_unload)

        # ---------------------------------------------------------- the API (gradio_client)
        add_api(service)
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

    def session_summary(owner: str, session_id: str) -> dict:
        s = service.store.get_session(session_id, owner)
        return {
            "session_id": session_id, "owner": owner, "status": s["status"], "question": s["question"],
            "segments_total": s["segments_total"], "segments_read": s["segments_read"],
            # Through a model server: prompt tokens sent for the reading, and the share found in its prefix cache.
            "server_prompt_tokens": s.get("server_prompt_tokens"),
            "server_cached_tokens": s.get("server_cached_tokens"),
            "reuse": s["server_cached_tokens"] / s["server_prompt_tokens"] if s.get("server_prompt_tokens") else None,
            "margins": [{"segment": m["segment_index"], "pages": [m["page_start"], m["page_end"]]
                         if m["page_start"] is not None else None, "text": m["text"], "relevant": m["verdict"],
                         "score": m["score"], "mark": m["mark"]} for m in service.store.margins(session_id)],
        }

    def api_read(path, question, segment_tokens, margin_tokens, answer_tokens, classifier, owner):
        """Read a document with a question: writes a margin note per segment. Streams progress; the last
        result has every margin. Returns {session_id, owner, status, margins: [...]}."""
        owner = (owner or "").strip() or f"api-{uuid.uuid4().hex}"
        try:
            doc_id, _ = service.add_upload(path)
            settings = service.settings(segment_tokens, margin_tokens, answer_tokens, classifier)
            session_id = service.start_read(owner, doc_id, question, settings)
            seen = 0
            for update in service.read_stream(owner, session_id):
                if "segment" in update or "sessions" in update:
                    summary = session_summary(owner, session_id)
                    if summary["segments_read"] != seen or "sessions" in update:
                        seen = summary["segments_read"]
                        yield summary
        except UserError as e:
            raise gr.Error(str(e)) from e

    def api_answer(owner, session_id, question):
        """Answer a question about a session read before, from the margins kept (the reader's marks, else the
        classifier's verdicts). Returns {session_id, question, answer, margins_used (segment indexes, from 0)}."""
        try:
            job = service.start_answer(owner, session_id, question)
            for update in service.answer_stream(owner, session_id, job["question"]):
                if "notice" in update and update["notice"] and "answers" not in update:
                    raise UserError(_plain(update["notice"]))
            answers = service.store.answers(session_id)
            if not answers or answers[-1]["question"] != job["question"]:
                raise UserError("No answer was written.")
            a = answers[-1]
            return {"session_id": session_id, "question": a["question"], "answer": a["text"],
                    "margins_used": a["margins_used"], "seconds": a["seconds"]}
        except UserError as e:
            raise gr.Error(str(e)) from e

    a_read.click(api_read, inputs=[a_file, a_question, a_seg, a_margin, a_answer, a_clf, a_owner], outputs=a_out,
                 api_name="read", concurrency_limit=slots, concurrency_id=ENGINE)
    a_ask.click(api_answer, inputs=[a_owner, a_session, a_question], outputs=a_out, api_name="answer",
                concurrency_limit=slots, concurrency_id=ENGINE)


def _plain(html_text: str) -> str:
    import html as _html
    import re
    return _html.unescape(re.sub(r"<[^>]+>", "", html_text or "")).strip()
