"""The front end's ClientRequest: text, stop strings and stream hold-back, fed as the engine core
and the front end feed them together (an engine Request's deltas, applied)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmserve.engine.request import FinishReason, Request, RequestDelta
from llmserve.output import ClientRequest
from llmserve.sampling_params import SamplingParams

EOS = 2


class Pieces:
    """A detokenizer that gives each token the text the test says."""

    def __init__(self) -> None:
        self.next = ""

    def step(self, token_id: int) -> str:
        return self.next

    def flush(self) -> str:
        return ""


class Pair:
    """An engine ``Request`` and its ``ClientRequest``: a token goes through the engine's rules,
    its delta through the front end's, and a request the front end ends is aborted in the
    engine, as ``LLM.generate`` and the server's engine client do. Reads go to the client's side."""

    def __init__(self, **params) -> None:
        p = SamplingParams(**params)
        self.engine_request = Request(req_id=0, prompt_token_ids=[5, 6, 7], params=p)
        self._pieces = Pieces()
        self.client = ClientRequest(0, [5, 6, 7], p, self._pieces)
        self.aborted_in_engine = False

    def append_token(self, token_id: int, text: str, *, eos_token_ids=frozenset(), logprob=None, top_logprobs=None):
        self.engine_request.append_token(token_id, eos_token_ids=eos_token_ids, logprob=logprob, top_logprobs=top_logprobs)
        self._pieces.next = text
        if self.client.apply(RequestDelta.of(self.engine_request)):
            assert not self.engine_request.is_finished, "asked to abort a request the engine had finished"
            self.engine_request.finish(FinishReason.ABORT)
            self.aborted_in_engine = True
        return self.client.finish_reason

    def __getattr__(self, name: str):
        return getattr(self.client, name)


def make_request(**params) -> Pair:
    return Pair(**params)


def feed(req: Pair, pieces: list[str], eos_token_ids: set[int] = frozenset({EOS})) -> None:
    """Append one token per text piece (token ids 100, 101, ...) until the request stops."""
    for n, piece in enumerate(pieces):
        if req.append_token(100 + n, piece, eos_token_ids=eos_token_ids) is not None:
            return


def test_token_counts_and_text():
    req = make_request(max_new_tokens=10)
    req.append_token(11, "a")
    req.append_token(12, "b")
    assert req.output_token_ids == [11, 12]
    assert (req.num_prompt_tokens, req.num_output_tokens) == (3, 2)
    assert req.output_text == "ab"
    assert not req.is_finished and req.finish_reason is None


def test_length():
    req = make_request(max_new_tokens=3)
    feed(req, ["a", "b", "c", "d"])
    assert req.finish_reason is FinishReason.LENGTH
    assert req.is_finished and not req.aborted_in_engine
    assert req.output_text == "abc"
    assert req.num_output_tokens == 3


def test_eos_text_is_not_shown():
    req = make_request(max_new_tokens=10)
    req.append_token(11, "hi")
    assert req.append_token(EOS, "</s>", eos_token_ids={EOS}) is FinishReason.EOS_TOKEN
    assert req.output_text == "hi"
    assert req.output_token_ids == [11, EOS]


def test_ignore_eos():
    req = make_request(max_new_tokens=2, ignore_eos=True)
    req.append_token(EOS, "", eos_token_ids={EOS})
    assert not req.is_finished
    assert req.append_token(EOS, "", eos_token_ids={EOS}) is FinishReason.LENGTH


def test_stop_token_id_wins_and_is_not_shown():
    # The stop token is also an EOS and the last allowed token: stop_token_ids is checked first.
    req = make_request(max_new_tokens=2, stop_token_ids=[EOS])
    req.append_token(11, "x")
    assert req.append_token(EOS, "STOP", eos_token_ids={EOS}) is FinishReason.STOP_SEQUENCE
    assert req.output_text == "x"
    assert not req.aborted_in_engine       # the engine ended it itself


def test_stop_string_within_one_delta():
    req = make_request(max_new_tokens=10, stop=["END"])
    feed(req, ["Hello", " world", "ENDmore"])
    assert req.finish_reason is FinishReason.STOP_SEQUENCE
    assert req.output_text == "Hello world"
    assert req.aborted_in_engine


def test_stop_string_split_over_deltas():
    req = make_request(max_new_tokens=10, stop=["</answer>"])
    feed(req, ["42", "</", "ans", "wer", ">", "junk"])
    assert req.finish_reason is FinishReason.STOP_SEQUENCE
    assert req.output_text == "42"
    assert req.num_output_tokens == 5


def test_earliest_stop_string_wins():
    req = make_request(max_new_tokens=10, stop=["cd", "b"])
    feed(req, ["a", "xbcd"])
    assert req.output_text == "ax"


def test_stop_string_beats_length():
    req = make_request(max_new_tokens=2, stop=["!"])
    feed(req, ["a", "b!"])
    assert req.finish_reason is FinishReason.STOP_SEQUENCE
    assert req.output_text == "ab"
    assert not req.aborted_in_engine       # the engine had ended it (length): nothing to abort


def test_logprobs_recorded_only_when_asked():
    req = make_request(max_new_tokens=5)
    req.append_token(11, "a", logprob=-0.5, top_logprobs=[(11, -0.5)])
    assert req.output_logprobs == [] and req.output_top_logprobs == []

    req = make_request(max_new_tokens=5, logprobs=1)
    req.append_token(11, "a", logprob=-0.5, top_logprobs=[(11, -0.5)])
    req.append_token(12, "b", logprob=-1.5, top_logprobs=[(13, -0.1)])
    assert req.output_logprobs == [-0.5, -1.5]
    assert req.output_top_logprobs == [[(11, -0.5)], [(13, -0.1)]]


def test_stream_holds_back_possible_stop_prefix():
    req = make_request(max_new_tokens=10, stop=["STOP"])
    req.append_token(11, "Hello S")
    assert req.take_stream_delta() == "Hell"  # "o S" could still become "STOP"
    req.append_token(12, "T")
    assert req.take_stream_delta() == "o"
    req.append_token(13, "OP tail")
    assert req.is_finished
    assert req.take_stream_delta() == " "
    assert req.output_text == "Hello "


def test_stream_without_stop_strings_sends_everything():
    req = make_request(max_new_tokens=10)
    req.append_token(11, "ab")
    assert req.take_stream_delta() == "ab"
    assert req.take_stream_delta() == ""


def test_short_text_is_held_back_entirely():
    req = make_request(max_new_tokens=10, stop=["abcdef"])
    req.append_token(11, "ab")
    assert req.streamable_text == ""
    assert req.take_stream_delta() == ""


@given(
    pieces=st.lists(st.text(alphabet="abc", max_size=4), min_size=1, max_size=30),
    stop=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=3),
)
def test_streamed_text_is_final_text_without_stop_strings(pieces: list[str], stop: list[str]):
    req = make_request(max_new_tokens=len(pieces), stop=stop)
    streamed = ""
    for n, piece in enumerate(pieces):
        req.append_token(100 + n, piece)
        streamed += req.take_stream_delta()
        if req.is_finished:
            break
    assert req.is_finished
    assert streamed == req.output_text
    # The text is cut before the first occurrence of any stop string, and only there.
    full_text = "".join(pieces[: req.num_output_tokens])
    assert full_text.startswith(req.output_text)
    assert not any(s in req.output_text for s in stop)
    if req.finish_reason is FinishReason.STOP_SEQUENCE:
        assert any(full_text[len(req.output_text) :].startswith(s) for s in stop)
    else:
        assert req.output_text == full_text


def test_min_tokens_lets_no_stop_rule_but_length_end_the_first_tokens():
    req = make_request(max_new_tokens=10, min_tokens=3, stop=["x"], stop_token_ids=[50])
    assert req.append_token(EOS, "", eos_token_ids={EOS}) is None
    assert req.append_token(50, "") is None
    assert req.append_token(12, "x", eos_token_ids={EOS}) is None     # the 3rd token: still inside
    assert req.output_text == "x"
    assert req.append_token(13, "ax") is FinishReason.STOP_SEQUENCE   # past min_tokens: stop rules again
    assert req.output_text == "xa"


@pytest.mark.parametrize(("token_id", "reason"), [(EOS, FinishReason.EOS_TOKEN), (50, FinishReason.STOP_SEQUENCE)])
def test_min_tokens_then_eos_or_stop_id(token_id: int, reason: FinishReason):
    req = make_request(max_new_tokens=10, min_tokens=1, stop_token_ids=[50])
    req.append_token(11, "a", eos_token_ids={EOS})
    assert req.append_token(token_id, "!", eos_token_ids={EOS}) is reason
    assert req.output_text == "a"


def test_min_tokens_equal_to_max_new_tokens_stops_on_length():
    req = make_request(max_new_tokens=2, min_tokens=2)
    feed(req, ["a", "b", "c"])
    assert req.finish_reason is FinishReason.LENGTH and req.output_text == "ab"


def test_a_failed_request_takes_the_engines_error():
    p = SamplingParams(max_new_tokens=4)
    client = ClientRequest(0, [5], p, Pieces())
    assert client.apply(RequestDelta(0, None, finish_reason=FinishReason.ERROR, error="sampler: bad top_k")) is False
    assert (client.finish_reason, client.error, client.output_token_ids) == (FinishReason.ERROR, "sampler: bad top_k", [])


def test_a_detokenizer_error_fails_the_request_without_its_token():
    class Broken:
        def step(self, token_id: int) -> str:
            if token_id == 13:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
            return "t"

    client = ClientRequest(0, [5], SamplingParams(max_new_tokens=4), Broken())
    assert client.apply(RequestDelta(0, 12)) is False
    assert client.apply(RequestDelta(0, 13)) is True           # the engine still runs it: abort it
    assert client.finish_reason is FinishReason.ERROR and "UnicodeDecodeError" in client.error
    assert (client.output_token_ids, client.output_text) == ([12], "t")


def test_a_start_request_decodes_its_first_token_in_the_prompts_context(smollm2_tokenizer):
    ids = smollm2_tokenizer("Hello world, said the").input_ids
    client = ClientRequest.start(0, ids[:-2], SamplingParams(max_new_tokens=2), smollm2_tokenizer)
    for token_id in ids[-2:]:
        client.apply(RequestDelta(0, token_id))
    assert client.output_text == smollm2_tokenizer.decode(ids)[len(smollm2_tokenizer.decode(ids[:-2])):]


@pytest.mark.parametrize("reason", [FinishReason.LENGTH, FinishReason.EOS_TOKEN])
def test_an_output_ending_inside_a_character_keeps_its_end(smollm2_tokenizer, reason: FinishReason):
    """A length limit (or an EOS) right after the first bytes of a character: the held-back
    bytes are in the output as a full decode shows them, not dropped."""
    tok = smollm2_tokenizer
    prompt = tok("Party time").input_ids
    ids = tok(" 🎉🎉").input_ids
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    client = ClientRequest.start(0, prompt, SamplingParams(max_new_tokens=cut), tok)
    for n, token_id in enumerate(ids[:cut], start=1):
        client.apply(RequestDelta(0, token_id, finish_reason=FinishReason.LENGTH if n == cut and reason is FinishReason.LENGTH else None))
    if reason is FinishReason.EOS_TOKEN:
        client.apply(RequestDelta(0, tok.eos_token_id, finish_reason=FinishReason.EOS_TOKEN))
    assert client.finish_reason is reason
    assert client.output_text == tok.decode(ids[:cut]) and client.output_text.endswith("\ufffd")
    assert "".join(client.output_token_texts) == client.output_text
    assert client.take_stream_delta() == client.output_text


def test_each_tokens_own_text_is_kept_whatever_the_stop_string_does():
    """output_token_texts is the detokenizer's text of each token: a stop string's hold-back and
    cut change what is streamed and output_text, never which token a text belongs to."""
    req = make_request(max_new_tokens=10, stop=["of Fr"])
    feed(req, ["The", " cap", "ital", " of", " Fr", "ance"])
    assert req.finish_reason is FinishReason.STOP_SEQUENCE
    assert req.output_token_texts == ["The", " cap", "ital", " of", " Fr"]
    assert req.output_text == "The capital "
    req = make_request(max_new_tokens=3)
    req.append_token(11, "a")
    req.append_token(EOS, "</s>", eos_token_ids={EOS})
    assert req.output_token_texts == ["a", ""]             # an EOS token's text is never shown
