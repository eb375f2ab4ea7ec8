"""What Marginalia does for a reader, without any Gradio: one Service made of the app's parts, one module a job.

- app/models.py: the loaded model: its warm-up, the speeds it measures for reading-time estimates, and the picker.
- app/documents.py: uploads read and stored, what reading one would take, and a margin's passage and page.
- app/sessions.py: the library and its sessions: listing, opening, marks, export and delete, for its owner only.
- app/jobs.py: the engine's job queue: which jobs wait and which run, each with the stop flag Stop sets.
- app/streams.py: the reading and answering streams, which save each margin and answer as it is complete.

The Gradio layer (app/web.py) calls these methods and puts the HTML they return on screen; the API
endpoints call the same methods. Every method that takes a session id from outside also takes the
`owner` (the browser's id, or an API client's) and refuses sessions that are not the owner's.

Streams (`read_stream`, `answer_stream`) are generators of `Update`s: dicts naming the parts of the
screen that changed. They run in the single engine worker slot (see web.py: concurrency_limit=1), save
every margin the moment it is complete, and leave the session in a state a later Resume can continue.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Callable

from engine.wim import Engine

from . import passage as passages
from . import worker
from .documents import LONG_READ_SECONDS, Defaults, Documents
from .errors import UserError
from .jobs import JobQueue
from .models import Models
from .sessions import Sessions
from .storage import Store
from .streams import Streams

__all__ = ["Defaults", "LONG_READ_SECONDS", "Service", "UserError"]


class Service(Models, Documents, Sessions, Streams):
    """The whole of what the app does, one part a module: app/models.py, documents.py, sessions.py, streams.py
    and the job queue (app/jobs.py); the state they share is made here."""

    def __init__(self, engine: Engine, store: Store, defaults: Defaults | None = None,
                 rates: dict | None = None, load: Callable[[str], Engine] | None = None,
                 data_dir: str | os.PathLike | None = None):
        self.engine, self.store = engine, store
        self.defaults = defaults or Defaults()
        self.model = engine.lm.name
        self.rates = rates or {"prefill": 400.0, "decode": 8.0}
        self._load = load or Engine.load     # spec -> Engine, for the model picker
        self.measured: dict[str, dict] = {}  # model spec -> the speed its warm-up (and readings) measured here
        self.jobs = JobQueue()
        self._marks: dict[str, dict[int, bool | None]] = {}
        self._segments: OrderedDict[str, list] = OrderedDict()
        # What document_html says of a document under some settings: (tokens, segments, note, problem).
        # Reopening a session shows it again; segmenting a novel costs seconds (3.2 s for pg1342 here).
        self._layouts: OrderedDict[tuple, tuple] = OrderedDict()
        self._lock = threading.Lock()
        # Kept PDFs and finished readings' KV caches (paths stored relative to it): beside the database unless
        # `data_dir` says otherwise (the database kept on local disk, the data on a mount: app.py).
        self.data_dir = os.fspath(data_dir) if data_dir is not None else os.path.dirname(store.path)
        self.pages = passages.PageImages()  # PDF pages, rendered on demand for the passage view
        worker.set_engine(engine)
