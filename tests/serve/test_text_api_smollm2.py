"""Where text matters: SmolLM2 behind `kvconnect serve`, through the OpenAI client. Logprob
tokens are decoded text (" four", not the vocabulary's "Ġfour"), `text_offset` indexes the
echoed text, and `bad_words` / `logit_bias` keep a real word out of the answer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.serving import Serve, post

pytestmark = [pytest.mark.slow, pytest.mark.realmodel]

PROMPT = "One, two, three,"
GREEDY: dict[str, Any] = {"model": "smollm2", "temperature": 0, "max_tokens": 6}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    serve = Serve(tmp_path_factory.mktemp("smollm2"), model="smollm2")
    serve.start()
    try:
        yield serve
    finally:
        assert serve.stop() == 0, serve.logs()


@pytest.fixture
def client(server: Serve) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_echoed_tokens_are_text_and_their_offsets_index_it(client: openai.OpenAI) -> None:
    choice = client.completions.create(prompt=PROMPT, echo=True, logprobs=2, **GREEDY).choices[0]
    assert choice.text.startswith(PROMPT + " four")
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.text_offset and lp.token_logprobs
    assert "".join(lp.tokens) == choice.text
    assert all("Ġ" not in t for t in lp.tokens)
    for token, offset in zip(lp.tokens, lp.text_offset, strict=True):
        assert choice.text[offset : offset + len(token)] == token
    assert lp.token_logprobs[0] is None and lp.tokens[0] == "One"
    first_new = len(lp.tokens) - 6
    assert lp.tokens[first_new] == " four"
    assert lp.top_logprobs is not None and " four" in lp.top_logprobs[first_new]


def test_chat_logprob_tokens_are_the_answers_text(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Count: one, two, three,"}]
    reply = client.chat.completions.create(
        messages=messages, logprobs=True, top_logprobs=2, **GREEDY
    )
    content = reply.choices[0].logprobs and reply.choices[0].logprobs.content
    assert content
    assert "".join(c.token for c in content) == reply.choices[0].message.content
    assert all(c.bytes == list(c.token.encode()) for c in content)


def test_bad_words_and_logit_bias_keep_a_word_out(client: openai.OpenAI, server: Serve) -> None:
    plain = client.completions.create(prompt=PROMPT, **GREEDY).choices[0].text
    assert plain.startswith(" four")
    no_four = client.completions.create(
        prompt=PROMPT, extra_body={"bad_words": ["four"]}, **GREEDY
    ).choices[0]
    assert "four" not in no_four.text.lower().replace("fourth", "")
    _, tokenized, _ = post(server.url + "/tokenize", {"prompt": " four"})
    (four,) = tokenized["tokens"]
    biased = client.completions.create(prompt=PROMPT, logit_bias={str(four): -100}, **GREEDY)
    assert not biased.choices[0].text.startswith(" four")


def test_a_json_schema_answer_from_the_real_model_validates(client: openai.OpenAI) -> None:
    """The grammar over SmolLM2's 49,152 byte-level BPE tokens (their bytes, from the GGUF)."""
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "maxLength": 24}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    reply = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        temperature=0,
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )
    answer = json.loads(reply.choices[0].message.content or "", strict=False)
    jsonschema.validate(answer, schema)
    assert reply.choices[0].finish_reason == "stop"
    assert "Paris" in answer["capital"]
