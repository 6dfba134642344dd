"""DRY, the penalty on extending a repeat of the context (kvshelf.runtime.repetition).

On a tiny random-weight model, ``logit_bias`` makes the model's wish plain (``a`` first,
``b`` a close second): without DRY it writes ``a`` after ``a`` forever, copying the
repeat its prompt ends with; with DRY the token that would extend a repeat is pushed
down, so the reply is made of what the context has not said yet. The penalty's amounts
are checked against their definition on hand-made contexts.
"""

from __future__ import annotations

import pytest

from kvshelf.runtime.engine import Engine
from kvshelf.runtime.params import GenerationParams
from kvshelf.runtime.repetition import Breakers, DryPenalty

A, B = ord("a"), ord("b")  # the tiny byte tokenizer's ids are byte values
FAVOUR_A_THEN_B = ((A, 50.0), (B, 49.0))  # far above the random logits, far below a DRY penalty of 100


def _ngrams(text: str, n: int) -> list[str]:
    return [text[i : i + n] for i in range(len(text) - n + 1)]


@pytest.fixture(scope="module")
def engine(tiny_dirs, tmp_path_factory):
    with Engine(model=str(tiny_dirs["llama"]), cache_dir=tmp_path_factory.mktemp("dry"), progress=False) as e:
        yield e


def _continue(engine: Engine, text: str, **dry) -> str:
    """The greedy continuation of an open assistant message ``text``."""
    params = GenerationParams(max_tokens=8, logit_bias=FAVOUR_A_THEN_B, **dry)
    return engine.chat(None, [{"role": "assistant", "content": text, "prefix": True}], params).text


def test_without_dry_the_model_extends_the_repeat_its_prompt_ends_with(engine):
    assert _continue(engine, "xyz aaaa") == "aaaaaaaa"


def test_dry_forbids_extending_a_repeat_of_the_prompt(engine):
    text = "xyz aaaa"
    reply = _continue(engine, text, dry_multiplier=100.0, dry_base=2.0, dry_allowed_length=2, dry_sequence_breakers=())
    # "a" after "aa" would repeat the prompt's "aaa": the close second comes instead
    assert reply.startswith("b"), reply
    # and no 3-token run of the reply (allowed length 2, plus the chosen token) repeats the context before it
    context = text
    for ch in reply:
        context += ch
        assert context[-3:] not in context[:-1], (reply, context)
    assert len(reply) == 8


def test_dry_forbids_copying_a_longer_phrase_of_the_prompt(engine):
    """The prompt says "qaaab" once; told "qaa" again, the biased model goes on "qaaa", a
    repeat of 4 tokens: DRY stops the copy at its allowed length of 3."""
    plain = _continue(engine, "qaaab\nqaa")
    assert plain.startswith("a"), plain  # the biased model copies "qaa" -> "qaaa..."
    reply = _continue(engine, "qaaab\nqaa", dry_multiplier=100.0, dry_allowed_length=3)
    assert reply.startswith("b"), reply  # "qaaa" would be a 4-token repeat of "qaaab"; "qaab" is one of 3


def test_a_repeat_shorter_than_the_allowed_length_is_not_penalized(engine):
    assert _continue(engine, "xyz aaaa", dry_multiplier=100.0, dry_allowed_length=20) == "aaaaaaaa"


def test_the_penalty_grows_with_the_repeat_and_stops_at_breakers():
    # context 5 6 7 9 5 6: token 7 would extend the repeat "5 6" (length 2)
    dry = DryPenalty([5, 6, 7, 9, 5, 6], multiplier=0.8, base=1.75, allowed_length=2)
    assert dry.penalties() == ([7], [pytest.approx(0.8)])
    dry.append(7)  # now "5 6 7" repeats: 9 would make it 4 long
    assert dry.penalties() == ([9], [pytest.approx(0.8 * 1.75)])
    # the longest repeat decides: 3 follows "1 2" once and "0 1 2" once
    dry = DryPenalty([0, 1, 2, 3, 1, 2, 4, 0, 1, 2], multiplier=1.0, base=2.0, allowed_length=2)
    ids, amounts = dry.penalties()
    assert dict(zip(ids, amounts, strict=True)) == {3: pytest.approx(2.0), 4: pytest.approx(1.0)}
    # a breaker (5) cuts the match: "5 6" no longer counts, "6" alone is under the allowed length
    assert DryPenalty([5, 6, 7, 9, 5, 6], multiplier=0.8, breakers=frozenset({5})).penalties() == ([], [])
    # penalty_last_n: the earlier occurrence is out of the window
    assert DryPenalty([5, 6, 7, 9, 9, 5, 6], multiplier=0.8, penalty_last_n=4).penalties() == ([], [])


def test_breakers_are_the_tokens_whose_text_holds_one():
    texts = ["a", "b:", "\n\n", "x*y", "c"]
    decoded: list[int] = []

    def decode(token: int) -> str:
        decoded.append(token)
        return texts[token]

    breakers = Breakers(decode, ["\n", ":", "*"])
    assert [t for t in range(5) if t in breakers] == [1, 2, 3]
    assert [t in breakers for t in (1, 4)] == [True, False] and decoded == [0, 1, 2, 3, 4]  # each decoded once
    assert 1 not in Breakers(lambda t: texts[t], [])


@pytest.mark.parametrize(
    "fields",
    [
        {"dry_multiplier": -1.0},
        {"dry_base": 0.5},
        {"dry_allowed_length": 0},
        {"dry_penalty_last_n": -2},
        {"dry_sequence_breakers": ("",)},
    ],
)
def test_bad_dry_settings_are_refused(fields):
    with pytest.raises(ValueError, match=next(iter(fields))):
        GenerationParams(**fields)


def test_the_server_takes_dry_as_llama_cpp_names_it(engine):
    from starlette.testclient import TestClient

    from kvshelf.serving.server import create_app

    client = TestClient(create_app(engine, close_engine=False), raise_server_exceptions=False)
    body = {
        "messages": [{"role": "assistant", "content": "xyz aaaa", "prefix": True}],
        "max_tokens": 4,
        "logit_bias": {str(A): 50, str(B): 49},
    }

    def content(**fields) -> str:
        r = client.post("/v1/chat/completions", json={**body, **fields})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    assert content() == "aaaa"
    assert content(dry_multiplier=100, dry_allowed_length=2, dry_sequence_breakers=["\n"]).startswith("b")
    for field, value in (("dry_multiplier", -1), ("dry_allowed_length", 0), ("dry_sequence_breakers", [""])):
        r = client.post("/v1/chat/completions", json={**body, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
