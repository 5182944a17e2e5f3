"""vLLM's /tokenize, /detokenize and /version on a real `kvconnect serve --model tiny`.

The tiny model's tokenizer is its UTF-8 bytes (ids 0..255, BOS 256, EOS 257), and its chat
template is a plain "role: content" transcript, so every expected token list below is the
bytes of a text written out in full.
"""

from __future__ import annotations

from typing import Any

import pytest

import kvconnect
from tests.serving import RouterProcess, Serve, get, post

pytestmark = pytest.mark.slow

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi é"},
]
RENDERED = "system: Be brief.\nuser: Hi é\nassistant: "


@pytest.fixture(scope="module")
def server(tiny_api: tuple[Serve, RouterProcess]) -> Serve:
    return tiny_api[0]  # tests/serve/conftest.py


@pytest.fixture(scope="module")
def max_model_len(server: Serve) -> int:
    status, models = get(server.url + "/v1/models")
    assert status == 200, models
    limit: int = models["data"][0]["max_model_len"]
    return limit


def tokenize(server: Serve, **body: Any) -> dict[str, Any]:
    status, answer, _ = post(server.url + "/tokenize", body)
    assert status == 200, answer
    return dict(answer)


def detokenize(server: Serve, tokens: list[int]) -> str:
    status, answer, _ = post(server.url + "/detokenize", {"tokens": tokens})
    assert status == 200, answer
    assert list(answer) == ["prompt"]
    text: str = answer["prompt"]
    return text


def test_a_prompt_is_its_bytes_and_comes_back_from_detokenize(
    server: Serve, max_model_len: int
) -> None:
    answer = tokenize(server, prompt="Hello, wörld ✓")
    expected = list("Hello, wörld ✓".encode())
    assert answer == {
        "count": len(expected),
        "max_model_len": max_model_len,
        "tokens": expected,
        "token_strs": None,
    }
    assert list(answer) == ["count", "max_model_len", "tokens", "token_strs"]  # vLLM's order
    assert detokenize(server, answer["tokens"]) == "Hello, wörld ✓"
    assert tokenize(server, model="tiny", prompt="")["tokens"] == []
    assert detokenize(server, []) == ""


def test_the_prompt_form_gives_the_tokens_completions_runs_and_adds_no_special_tokens(
    server: Serve,
) -> None:
    status, completion, _ = post(
        server.url + "/v1/completions",
        {"prompt": "same tokens", "max_tokens": 1, "return_token_ids": True},
    )
    assert status == 200, completion
    runs = completion["choices"][0]["prompt_token_ids"]
    assert runs == list(b"same tokens")
    assert tokenize(server, prompt="same tokens")["tokens"] == runs  # add_special_tokens: true
    assert tokenize(server, prompt="same tokens", add_special_tokens=False)["tokens"] == runs


def test_the_chat_form_is_rendered_as_chat_completions_renders_it(server: Serve) -> None:
    status, chat, _ = post(
        server.url + "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 1, "return_token_ids": True},
    )
    assert status == 200, chat
    answer = tokenize(server, messages=CHAT)
    assert answer["tokens"] == chat["choices"][0]["prompt_token_ids"] == list(RENDERED.encode())
    assert answer["count"] == chat["usage"]["prompt_tokens"]
    assert detokenize(server, answer["tokens"]) == RENDERED
    # add_special_tokens (false by default here) adds nothing on top of the template either.
    assert tokenize(server, messages=CHAT, add_special_tokens=True)["tokens"] == answer["tokens"]


def test_the_chat_form_without_a_generation_prompt_or_continuing_the_last_message(
    server: Serve,
) -> None:
    plain = tokenize(server, messages=CHAT, add_generation_prompt=False)
    assert detokenize(server, plain["tokens"]) == "system: Be brief.\nuser: Hi é\n"
    prefill = [*CHAT, {"role": "assistant", "content": "The answer is "}]
    # The template writes "assistant: The answer is \n": the cut keeps the trailing space the
    # template kept and drops the end of the turn, so the model continues the message.
    cont = tokenize(
        server, messages=prefill, add_generation_prompt=False, continue_final_message=True
    )
    assert detokenize(server, cont["tokens"]) == RENDERED + "The answer is "


def test_token_strs_name_each_token(server: Serve) -> None:
    answer = tokenize(server, prompt="Hi é\n", return_token_strs=True)
    assert answer["tokens"] == [72, 105, 32, 0xC3, 0xA9, 10]
    assert answer["token_strs"] == ["H", "i", " ", "<0xC3>", "<0xA9>", "<0x0A>"]


def test_detokenize_drops_the_byte_models_special_tokens(server: Serve) -> None:
    assert detokenize(server, [256, 72, 105, 257]) == "Hi"


def test_a_prompt_of_max_model_len_tokens_is_counted_and_one_more_is_refused(
    server: Serve, max_model_len: int
) -> None:
    assert tokenize(server, prompt="x" * max_model_len)["count"] == max_model_len
    status, answer, _ = post(server.url + "/tokenize", {"prompt": "x" * (max_model_len + 1)})
    assert status == 400 and answer["error"]["param"] == "prompt", answer
    assert f"context of {max_model_len} tokens" in answer["error"]["message"]
    status, answer, _ = post(server.url + "/detokenize", {"tokens": [120] * (max_model_len + 1)})
    assert status == 400 and answer["error"]["param"] == "tokens", answer


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": 1}, "prompt"),
        ("/tokenize", {"prompt": ["a"]}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "x", "messages": CHAT}, "prompt"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/tokenize", {"prompt": "x", "return_token_strs": 1}, "return_token_strs"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ("/tokenize", {"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
        ("/tokenize", {"messages": CHAT, "chat_template": "{{ 1 }}"}, "chat_template"),
        ("/tokenize", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools[0]"),
        ("/detokenize", {"tokens": [72, 258]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": [2**70]}, "tokens"),
        ("/detokenize", {"tokens": ["a"]}, "tokens[0]"),
        ("/detokenize", {"tokens": [True]}, "tokens[0]"),
        ("/detokenize", {}, "tokens"),
        ("/detokenize", {"prompt": "x"}, "tokens"),
    ],
)
def test_a_bad_body_is_a_400_naming_the_field(
    server: Serve, path: str, body: dict[str, Any], param: str
) -> None:
    status, answer, _ = post(server.url + path, body)
    assert status == 400, answer
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert (answer["error"]["type"], answer["error"]["param"]) == ("invalid_request_error", param)


def test_not_json_and_a_wrong_model_are_refused_as_elsewhere(server: Serve) -> None:
    for path in ("/tokenize", "/detokenize"):
        status, answer, _ = post(server.url + path, b"{not json")
        assert status == 400 and "not valid JSON" in answer["error"]["message"], answer
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [72]})):
        status, answer, _ = post(server.url + path, {**body, "model": "gpt-4"})
        assert status == 404, answer
        assert (answer["error"]["param"], answer["error"]["code"]) == ("model", "model_not_found")


def test_version_is_kvconnects(server: Serve) -> None:
    assert get(server.url + "/version") == (200, {"version": kvconnect.__version__})
