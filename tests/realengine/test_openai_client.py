"""The official openai client against a real llama-server, streamed and not."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.realengine.llama import MODEL_ALIAS, LlamaServer, user


@pytest.fixture
def client(engine: LlamaServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{engine.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_models_list(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL_ALIAS]


def test_chat_non_stream(client: openai.OpenAI, engine: LlamaServer) -> None:
    out = client.chat.completions.create(model=MODEL_ALIAS, messages=user("hi"), max_tokens=8)
    assert out.object == "chat.completion"
    assert out.model == MODEL_ALIAS
    [choice] = out.choices
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert out.usage is not None
    assert out.usage.completion_tokens == 8
    assert out.usage.prompt_tokens == engine.n_tokens(user("hi"))


def test_chat_stream_with_usage(client: openai.OpenAI, engine: LlamaServer) -> None:
    stream = client.chat.completions.create(
        model=MODEL_ALIAS,
        messages=user("hello there"),
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert 1 <= len(content) <= 8
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "length" and set(finish[:-1]) == {None}
    # The usage chunk comes last, with no choices.
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == engine.n_tokens(user("hello there"))


def test_chat_stream_without_usage_sends_none(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL_ALIAS, messages=user("hi"), max_tokens=4, stream=True
        )
    )
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completions_non_stream_and_stream(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL_ALIAS, prompt="the replica", max_tokens=4)
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 4
    chunks = list(
        client.completions.create(
            model=MODEL_ALIAS, prompt="the replica", max_tokens=4, stream=True
        )
    )
    assert chunks[-1].choices[0].finish_reason == "length"


def test_over_context_raises_bad_request(client: openai.OpenAI, engine: LlamaServer) -> None:
    """The engine refuses before streaming: the client raises at create(), stream or not."""
    messages = user(" ".join(["the"] * engine.slot_ctx()))
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model=MODEL_ALIAS, messages=messages, max_tokens=4, stream=stream
            )
        assert err.value.status_code == 400
        assert isinstance(err.value.body, dict)
        assert err.value.body["type"] == "exceed_context_size_error"
