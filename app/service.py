"""What Marginalia does for a reader, without any Gradio and without any HTML: one Service made of the app's parts,
one module a job. It hands the screen (app/web.py, drawn by app/render.py) and the API data: app/records.py's
records and events.

- app/models.py: the loaded model: its warm-up, the speeds it measures for reading-time estimates, and the picker.
- app/documents.py: uploads read and stored, what reading one would take, and a margin's passage and page.
- app/sessions.py: the library and its sessions: listing, opening, marks, export and delete, for its owner only.
- app/streams.py: queueing, placing and stopping readings and answers (the job queue itself: app/jobs.py).
- app/reading.py, app/answering.py: the reading and answering streams, which save each margin and answer as it
  is complete.
- app/layouts.py: each document segmented once for the loaded model, shared by all of the above and the engine job.

Every method that takes a session id from outside also takes the `owner` (the browser's id, or an API client's)
and refuses sessions that are not the owner's.

Streams (`read_stream`, `answer_stream`) are generators of app/records.py's events. They run in the single engine
worker slot (see web.py: concurrency_limit=1), save every margin the moment it is complete, and leave the session
in a state a later Resume can continue.
"""
from __future__ import annotations

import os
import threading
from typing import Callable

from engine import Engine

from . import passage as passages
from . import worker
from .answering import AnswerStream
from .documents import LONG_READ_SECONDS, Defaults, Documents
from .errors import UserError
from .jobs import JobQueue
from .layouts import Layouts
from .models import Models
from .reading import ReadStream
from .sessions import Sessions
from .storage import Store
from .streams import Streams

__all__ = ["Defaults", "LONG_READ_SECONDS", "Service", "UserError"]


class Service(Models, Documents, Sessions, Streams, ReadStream, AnswerStream):
    """The whole of what the app does, one part a module (see above); the state they share is made here."""

    def __init__(self, engine: Engine, store: Store, defaults: Defaults | None = None,
                 rates: dict | None = None, load: Callable[[str], Engine] | None = None,
                 data_dir: str | os.PathLike | None = None):
        self.engine, self.store = engine, store
        self.defaults = defaults or Defaults()
        self.model = engine.lm.name
        self.rates = rates or {"prefill": 400.0, "decode": 8.0}
        self.load_engine = load or Engine.load  # spec -> Engine, for the model picker
        self.measured: dict[str, dict] = {}  # model spec -> the speed its warm-up (and readings) measured here
        self.jobs = JobQueue()
        # The reader's marks on the margins of a running reading, which its panel shows as they are set.
        self.live_marks: dict[str, dict[int, bool | None]] = {}
        self.layouts = Layouts(engine)  # each document segmented once for this model
        self.lock = threading.Lock()  # guards live_marks
        # Kept PDFs and finished readings' KV caches (paths stored relative to it): beside the database unless
        # `data_dir` says otherwise (the database kept on local disk, the data on a mount: app.py).
        self.data_dir = os.fspath(data_dir) if data_dir is not None else os.path.dirname(store.path)
        self.pages = passages.PageImages()  # PDF pages, rendered on demand for the passage view
        worker.set_engine(engine)
