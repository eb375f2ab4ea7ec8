"""The app's API (/read and /answer) through gradio_client, against `python app.py` with the real model."""
from __future__ import annotations

import pytest

from conftest import shared

pytestmark = pytest.mark.server  # left out of `make quick`

SERVER_ARGS = ["--segment-tokens", "128", "--margin-tokens", "16", "--answer-tokens", "24",
               "--classifier", "embedding", "--no-warm-up"]


@pytest.fixture(scope="module")
def client(server):
    from gradio_client import Client
    return Client(server.url, verbose=False)


@pytest.fixture(scope="module")
def opening(tmp_path_factory):
    """The first paragraphs of Pride and Prejudice (after the Gutenberg header): ~350 tokens."""
    text = shared("books", "pg1342.txt").read_text(encoding="utf-8")
    start = text.index("It is a truth universally acknowledged")
    path = tmp_path_factory.mktemp("api-docs") / "pride-opening.txt"
    path.write_text(text[start:start + 1400], encoding="utf-8")
    return path


def test_api_lists_read_and_answer(client):
    endpoints = client.view_api(print_info=False, return_format="dict")["named_endpoints"]
    assert {"/read", "/answer"} <= set(endpoints)
    assert not any(name.startswith(("/on_", "/read_job", "/answer_job")) for name in endpoints), endpoints
    params = [p["parameter_name"] for p in endpoints["/read"]["parameters"]]
    assert params[:2] == ["path", "question"] and "owner" in params


def test_read_then_answer(client, opening):
    from gradio_client import handle_file

    job = client.submit(handle_file(str(opening)), "What does a rich single man want?", 128, 16, 24, "embedding", "",
                        api_name="/read")
    result = job.result(timeout=600)
    assert len(job.outputs()) >= 2  # progress streams while the margins are written
    assert result["status"] == "read" and result["owner"].startswith("api-")
    assert result["segments_total"] >= 2 and result["segments_read"] == result["segments_total"]
    assert [m["segment"] for m in result["margins"]] == list(range(result["segments_total"]))
    assert all(isinstance(m["text"], str) and m["relevant"] in (True, False) for m in result["margins"])

    answer = client.predict(result["owner"], result["session_id"], "Who does the family want to marry?",
                            api_name="/answer")
    assert answer["session_id"] == result["session_id"] and answer["answer"].strip()
    assert isinstance(answer["reasoning"], str)
    kept = [m["segment"] for m in result["margins"] if m["relevant"] and m["text"]]
    assert answer["margins_used"] == kept

    # Someone else's session is not there; bad input gets the reader's message.
    with pytest.raises(Exception, match="No reading is open"):
        client.predict("someone-else", result["session_id"], "Who?", api_name="/answer")


def test_read_rejects_bad_input(client, tmp_path):
    from gradio_client import handle_file

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(Exception, match="is empty"):
        client.predict(handle_file(str(empty)), "Who?", 128, 16, 24, "embedding", "", api_name="/read")
    text = tmp_path / "ok.txt"
    text.write_text("A short text. " * 20)
    with pytest.raises(Exception, match="type a question"):
        client.predict(handle_file(str(text)), "", 128, 16, 24, "embedding", "", api_name="/read")
