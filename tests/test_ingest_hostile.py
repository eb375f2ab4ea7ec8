"""The hostile-upload battery (tests/hostile.py): every case read by engine.documents in a probe process that
measures each one's peak RSS on its own. Each case ends in a clear message or a correct text, within the
stated memory bound; text containing markup is escaped when the app shows it."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import hostile

CATCH_ALL = "couldn't be read: it may be damaged"  # the message for the unforeseen: no case should need it


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile")
    paths = hostile.write(folder / "files")
    out = folder / "texts"
    out.mkdir()
    run = subprocess.run([sys.executable, hostile.__file__, "probe", str(out), *map(str, paths.values())],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    records = {r["name"]: r for r in map(json.loads, run.stdout.splitlines())}
    worst = max(records.values(), key=lambda r: r["peak_rss_mib"])
    print(f"\nhostile battery: {len(records)} files, {sum(not r['ok'] for r in records.values())} refused, "
          f"worst peak RSS {worst['peak_rss_mib']} MiB ({worst['name']}), bound {hostile.PEAK_RSS_BOUND_MIB} MiB")
    return records, out


def test_battery_is_big_enough():
    assert len(hostile.CASES) >= 30


@pytest.mark.parametrize("case", hostile.CASES, ids=[c.name for c in hostile.CASES])
def test_hostile_file(case, probed):
    if case.needs is not None and not case.needs.exists():
        pytest.skip(f"fixture {case.needs} is missing")
    records, texts = probed
    r = records[case.name]
    assert r["peak_rss_mib"] <= hostile.PEAK_RSS_BOUND_MIB, r
    if not r["ok"]:
        assert CATCH_ALL not in r["message"] and case.name in r["message"], r["message"]
        assert case.refused or case.either, f"{case.name} was refused: {r['message']}"
        if case.refused:
            assert case.refused in r["message"]
        return
    assert not case.refused, f"{case.name} was read ({r['chars']} characters); expected: {case.refused}"
    text = (texts / (case.name + ".text")).read_text(encoding="utf-8", errors="surrogatepass")
    assert len(text) == r["chars"]
    for phrase in case.text_has:
        assert phrase in text, (phrase, text[:300])
    for phrase in case.text_lacks:
        assert phrase not in text, phrase
    if case.notice:
        assert any(case.notice in n for n in r["notices"]), r["notices"]
    else:
        assert not r["notices"], r["notices"]
    # What the app shows: markup arrives as text, escaped.
    for tag in ("<script", "<iframe", "<img", "<svg", "<a "):
        assert tag not in r["rendered"]
    if "<script" in text[:2000]:
        assert "&lt;script&gt;" in r["rendered"]
