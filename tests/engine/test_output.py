"""Output text: stop strings found across token boundaries and cut, text held back while it
could still become a stop string or an incomplete character."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvconnect.engine.output import OutputProcessor, RequestState
from kvconnect.engine.request import Request, RequestStatus, SamplingParams
from kvconnect.model.tokenizer import ByteTokenizer


def run(tokens: list[int], stop: tuple[str, ...] = ()) -> tuple[RequestState, list[str]]:
    """Feed `tokens` one step at a time; the deltas streamed and the final state."""
    processor = OutputProcessor(ByteTokenizer())
    req = Request("r", [1], SamplingParams(max_tokens=len(tokens), stop=stop), block_size=16)
    state = processor.add(req)
    deltas = []
    for t in tokens:
        req.append_output_token(t)
        if processor.update(state):
            req.status = RequestStatus.FINISHED_STOPPED
        elif (status := req.check_stop()) is not None:
            req.status = status
        delta = state.take_delta()
        assert delta is not None and delta.token_ids == [t]  # every step brings its token
        assert delta.finished == req.status.is_finished
        deltas.append(delta.text)
        if req.status.is_finished:
            break
    return state, deltas


def test_a_stop_string_split_across_tokens_is_cut_and_never_streamed() -> None:
    state, deltas = run(list(b"The end.\n\nMore"), stop=("\n\n",))
    assert state.text == "The end." and state.stop_reason == "\n\n"
    assert "".join(deltas) == "The end."
    assert state.request.status is RequestStatus.FINISHED_STOPPED


def test_the_holdback_streams_everything_once_no_stop_can_start() -> None:
    state, deltas = run(list(b"abcabd"), stop=("abd!",))
    assert state.stop_reason is None and "".join(deltas) == "abcabd"
    assert deltas[:3] == ["", "", ""]  # "abc" could still be the start of "abd!"...
    assert deltas[3] == "a"  # ...until it cannot


def test_an_incomplete_character_waits_for_its_bytes() -> None:
    _, deltas = run(list("a€b".encode()))  # € is three bytes
    assert deltas == ["a", "", "", "€", "b"]
    assert "\ufffd" not in "".join(deltas)


def test_a_stop_string_after_a_character_that_completes_late() -> None:
    state, deltas = run(list("x€y".encode()), stop=("€",))
    assert state.text == "x" and state.stop_reason == "€" and "".join(deltas) == "x"


@settings(max_examples=200, deadline=None)
@given(
    st.text(alphabet="ab\n€", max_size=30),
    st.lists(st.text("ab\n€", min_size=1, max_size=3), max_size=3),
)
def test_streamed_text_is_the_text_cut_at_the_first_stop_to_complete(
    text: str, stops: list[str]
) -> None:
    state, deltas = run(list(text.encode()) or [ord("z")], stop=tuple(stops))
    full = text or "z"
    expected = full
    for end in range(1, len(full) + 1):  # the first stop to be complete wins, as in vLLM
        found = [full.find(s, 0, end) for s in stops if s in full[:end]]
        if found:
            expected = full[: min(found)]
            break
    assert state.text == expected and "".join(deltas) == expected


def test_no_stop_string_ends_the_output_before_min_tokens() -> None:
    processor = OutputProcessor(ByteTokenizer())
    params = SamplingParams(max_tokens=8, stop=("a",), min_tokens=3)
    req = Request("r", [1], params, block_size=16)
    state = processor.add(req)
    for t in b"aaxa":
        req.append_output_token(t)
        if processor.update(state):
            break
    assert len(req.output_token_ids) == 4 and state.stop_reason == "a"  # the 4th, not the 1st
    assert state.text == "aax"
