"""The readiness gate through the engine: a request whose image embeddings have not arrived waits holding
nothing while a text request queued after it runs; once ``provide_images`` delivers them it runs to the
same tokens ``LLM.chat`` gives; an unready request aborts cleanly."""

from __future__ import annotations

import pytest

from services.engine import SamplingParams
from services.engine.images.prompt import expand_images
from tests.services.engine.test_llm_chat import GREEDY, ask, data_url

pytestmark = pytest.mark.usefixtures("pools_checked_after_every_step")  # conftest.py


@pytest.fixture
def llm(chat_llm):
    return chat_llm


def test_a_text_request_after_an_unready_image_request_runs_first(llm):
    url = data_url(90, 70, seed=3)
    expected = llm.chat(ask(url), GREEDY)[0].token_ids
    ids, rows = expand_images(
        llm._chat.render({"messages": ask(url)}).token_ids,
        [url],
        llm.tokenizer.token_to_id("<｜image｜>"),
        llm.source.model,
    )
    engine = llm.engine
    engine.add_request("img", ids, GREEDY, ready=False)
    engine.add_request("txt", [0, 19923, 16, 128803], GREEDY)
    first_token = {}
    for step in range(4):
        for out in engine.step():
            if out.token_ids:
                first_token.setdefault(out.request_id, step)
    assert "txt" in first_token and "img" not in first_token
    assert engine.scheduler.request("img").block_table == []  # waiting, holding nothing
    engine.provide_images("img", rows)
    finals = {}
    while engine.has_unfinished():
        finals.update({out.request_id: out for out in engine.step() if out.finished})
    assert finals["img"].token_ids == expected and finals["img"].finish_reason == "length"
    assert engine.stats().free_blocks == engine.stats().total_blocks


def test_an_unready_request_aborts_and_providing_after_it_is_refused(llm):
    engine = llm.engine
    engine.add_request("gone", [0, 5, 129264, 129264, 129264, 129264, 7], SamplingParams(max_tokens=2), ready=False)
    engine.step()
    final = engine.abort("gone")
    assert final is not None and final.finish_reason == "abort"
    with pytest.raises(ValueError, match="no live request 'gone'"):
        engine.provide_images("gone", None)
    s = engine.stats()
    assert s.free_blocks == s.total_blocks and s.num_waiting == 0
