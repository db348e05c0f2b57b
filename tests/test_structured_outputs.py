"""Structured outputs in the engine: grammar masks inside the fixed-shape step.

Neither test model can write JSON on its own (`demo-random`'s weights are random, stories260K only knows
children's stories), so every valid output here is the mask's doing; each is checked by an independent
parser (`json`, `jsonschema`, `re`)."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
from llguidance.numpy import apply_token_bitmask_inplace

from jaxserve import LLM, SamplingParams
from jaxserve.sampling.logits import apply_token_masks
from jaxserve.errors import InvalidParameter
from jaxserve.sampling.grammar import StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["captain", "cook", "pilot"]},
        "pets": {"type": "array", "items": {
            "type": "object",
            "properties": {"kind": {"enum": ["cat", "dog", "bird"]}, "legs": {"type": "integer"}},
            "required": ["kind", "legs"], "additionalProperties": False}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "role", "pets", "address"],
}
PHONE = r"\d{3}-\d{4}"
COLOURS = ["red", "green", "blue", "cyan", "magenta"]


def _valid_person(text: str) -> bool:
    jsonschema.validate(json.loads(text), PERSON)
    return True


CASES = {
    "json_schema": (StructuredOutputsParams(json=PERSON), _valid_person),
    "json_object": (StructuredOutputsParams(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    "regex": (StructuredOutputsParams(regex=PHONE), lambda t: re.fullmatch(PHONE, t, re.ASCII) is not None),
    "choice": (StructuredOutputsParams(choice=COLOURS), lambda t: t in COLOURS),
}


@pytest.fixture(scope="module")
def demo_llm():
    return LLM("demo-random", max_num_seqs=16, max_model_len=256, max_num_batched_tokens=64, token_buckets=(16, 64))


@pytest.fixture(scope="module")
def stories16(stories_dir):
    return LLM(str(stories_dir), max_num_seqs=16, max_num_batched_tokens=64, token_buckets=(16, 64))


@pytest.mark.parametrize("model", ["demo", "stories"])
@pytest.mark.parametrize("case", list(CASES))
def test_fifty_sampled_outputs_all_follow_the_constraint(model, case, request):
    llm = request.getfixturevalue("demo_llm" if model == "demo" else "stories16")
    spec, check = CASES[case]
    outputs = llm.generate(["Once upon a time"] * 50, [SamplingParams(
        temperature=1.0, seed=seed, max_tokens=192, structured_outputs=spec) for seed in range(50)])
    texts = [o.outputs[0].text for o in outputs]
    assert all(check(t) for t in texts), [t for t in texts if not _quiet(check, t)]
    assert len(set(texts)) > 1 or case == "choice" and len(set(texts)) >= 1  # sampled, not one fixed answer


def _quiet(check, text) -> bool:
    try:
        return check(text)
    except Exception:  # noqa: BLE001 - reported by the assertion
        return False


def test_an_output_steered_to_its_end_near_the_budget_parses_and_says_stop(stories16):
    """The closing walk ends the grammar within max_tokens: the output is whole, so "stop" (as vLLM reports a
    grammar that ended), never "length", which clients read as a cut answer."""
    outs = stories16.generate(["Once upon a time"] * 4, [SamplingParams(
        temperature=1.0, seed=seed, max_tokens=80, structured_outputs=StructuredOutputsParams(json=PERSON))
        for seed in range(4)])
    for out in (o.outputs[0] for o in outs):
        assert _valid_person(out.text)
        assert out.finish_reason == "stop" and len(out.token_ids) <= 80


def test_an_output_cut_by_max_tokens_says_length(stories16):
    """Too few tokens for any way to the end of the grammar: max_tokens ends the output, "length"."""
    out = stories16.generate(["Once upon a time"], SamplingParams(
        temperature=1.0, seed=3, max_tokens=6, structured_outputs=StructuredOutputsParams(json=PERSON)))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6
    with pytest.raises(ValueError):
        json.loads(out.text)


# Items of `friends` have two required fields: a draw that opens one lengthens the way out by a dozen tokens.
CLUB = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "mood": {"enum": ["happy", "sad", "calm"]},
        "friends": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "close": {"type": "boolean"}},
            "required": ["name", "close"]}},
    },
    "required": ["name", "mood", "friends"],
}


@pytest.mark.parametrize("max_tokens", [64, 96])
def test_a_draw_that_opens_a_structure_near_the_budget_is_replaced_by_the_way_out(stories16, max_tokens):
    """Near the budget, a free draw that enters an array item with required fields lengthens the way out by
    more than any margin; the guard replaces such a draw with the way out, so every output still parses."""
    spec = StructuredOutputsParams(json=CLUB)
    outputs = stories16.generate([f"Person {i}:" for i in range(48)], [SamplingParams(
        temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=spec) for seed in range(48)])
    for o in outputs:
        jsonschema.validate(json.loads(o.outputs[0].text), CLUB)
        assert len(o.outputs[0].token_ids) <= max_tokens


def test_unconstrained_requests_are_untouched_by_constrained_neighbours(stories16):
    engine = stories16.engine
    plain = [SamplingParams(temperature=0.8, seed=s, max_tokens=40) for s in range(4)]
    prompts = ["Once upon a time", "The dog", "Lily saw", "One day"]
    alone = [o.outputs[0].token_ids for o in stories16.generate(prompts, plain)]
    compiled = engine.compile_events.lowered
    constrained = [SamplingParams(temperature=1.0, max_tokens=160, structured_outputs=spec)
                   for spec, _ in CASES.values()] * 2
    mixed = stories16.generate(prompts + prompts * 2, plain + constrained)
    assert [o.outputs[0].token_ids for o in mixed[:4]] == alone
    assert engine.compile_events.lowered == compiled  # masks are one more input of the same programs
    for out, (spec, check) in zip(mixed[4:], list(CASES.values()) * 2):
        assert _quiet(check, out.outputs[0].text), (spec.kind, out.outputs[0].text)
    assert engine.scheduler.allocator.num_in_use == 0


def test_the_mask_matches_llguidance_reference():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 100)).astype(np.float32)
    masks = rng.integers(-2**31, 2**31, size=(5, 4), dtype=np.int64).astype(np.int32)
    masks[2] = -1  # an unconstrained row
    expected = logits.copy()
    apply_token_bitmask_inplace(expected, masks)
    got = np.asarray(apply_token_masks(logits, masks, np.int32(1)))
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(np.asarray(apply_token_masks(logits, masks, np.int32(0))), logits)


def test_logprobs_see_only_allowed_tokens(stories16):
    out = stories16.generate(["Once upon a time"], SamplingParams(
        temperature=0, max_tokens=8, logprobs=5, structured_outputs=StructuredOutputsParams(regex=r"[0-9]{8}")))
    choice = out[0].outputs[0]
    tokenizer = stories16.engine.tokenizer
    assert re.fullmatch(r"[0-9]{8}", choice.text)
    for position in choice.logprobs:
        finite = [t for t, e in position.items() if e.logprob > -np.inf]
        assert all(tokenizer.decode([t], False).strip().isdigit() for t in finite)


def test_n_choices_each_follow_the_grammar_and_differ(stories16):
    out = stories16.generate(["Once upon a time"], SamplingParams(
        n=4, temperature=1.0, seed=7, max_tokens=160, structured_outputs=StructuredOutputsParams(json=PERSON)))[0]
    texts = [c.text for c in out.outputs]
    assert all(_valid_person(t) for t in texts) and len(set(texts)) == 4


def test_preempted_constrained_requests_resume_in_their_grammar(stories_dir):
    # Its own KV pool (20 pages of 16), so its own programs: one bucket compiles one. Preemption and resuming
    # a grammar are the scheduler's and the sampler's, whatever the step's padded size.
    llm = LLM(str(stories_dir), max_num_seqs=8, max_model_len=192, num_pages=20, page_size=16,
              max_num_batched_tokens=64, token_buckets=(64,))
    outs = llm.generate(["Once upon a time"] * 8, SamplingParams(
        temperature=1.0, max_tokens=160, structured_outputs=StructuredOutputsParams(json=PERSON)))
    assert llm.engine.scheduler.num_preemptions > 0
    assert all(_valid_person(o.outputs[0].text) for o in outs)


@pytest.mark.parametrize("spec, words", [
    (dict(json={"type": "strange"}), "invalid json"),
    (dict(json="{not json"), "invalid json"),
    (dict(regex="(unclosed"), "invalid regex"),
    (dict(grammar="start: missing_rule"), "invalid grammar"),
    (dict(grammar="root ::= \"a\" undefined"), "invalid grammar"),
    (dict(choice=[]), "choice"),
    (dict(regex="a", choice=["b"]), "exactly one"),
    (dict(), "exactly one"),
    (dict(regex="x" * 300_000), "longer than"),
])
def test_bad_specs_are_refused_naming_the_field(stories16, spec, words):
    with pytest.raises(InvalidParameter) as e:
        params = SamplingParams(structured_outputs=StructuredOutputsParams(**spec, field="response_format"))
        stories16.engine.validate([1, 2], params)
    assert e.value.param == "response_format" and words in str(e.value)


def test_a_grammar_past_the_work_limits_is_refused(stories16):
    # Nested optional repetition that makes the lexer's automaton explode.
    spec = StructuredOutputsParams(regex="(" * 200 + "a|b" + ")*" * 200 + "[a-z]{1,1000}" * 50)
    with pytest.raises(InvalidParameter, match="invalid regex"):
        stories16.engine.validate([1, 2], SamplingParams(structured_outputs=spec))


# ---- strict JSON Schemas (jaxserve/sampling/json_schema.py) ---------------------------------------------------------

PET = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name"]}
PAIR = {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]}


def _accepts(llm, text: str, **spec) -> bool:
    """Whether the grammar compiled from the spec takes `text` whole (in llguidance's own tokenization)."""
    grammars = llm.engine.grammars
    matcher = grammars.matcher(StructuredOutputsParams(**spec))
    return all(matcher.consume(t) for t in grammars._ll().tokenize_str(text)) and matcher.done


@pytest.mark.parametrize("schema, text, accepted", [
    # an object without additionalProperties takes only what it lists; saying so loosens it
    (PET, '{"name":"Tom","age":3}', True),
    (PET, '{"name":"Tom","colour":"red"}', False),
    ({**PET, "additionalProperties": True}, '{"name":"Tom","colour":"red"}', True),
    ({**PET, "additionalProperties": {"type": "integer"}}, '{"name":"Tom","legs":4}', True),
    ({**PET, "additionalProperties": {"type": "integer"}}, '{"name":"Tom","legs":"four"}', False),
    ({"type": "object"}, '{}', True),
    ({"type": "object"}, '{"a":1}', False),
    ({"type": "object", "additionalProperties": True}, '{"a":1}', True),
    # at every level: nested objects, $defs / $ref, anyOf branches, array items
    ({"type": "object", "properties": {"pet": PET}}, '{"pet":{"name":"Tom","x":1}}', False),
    ({"$defs": {"P": PET}, "type": "object", "properties": {"pet": {"$ref": "#/$defs/P"}}}, '{"pet":{"name":"T"}}', True),
    ({"$defs": {"P": PET}, "type": "object", "properties": {"pet": {"$ref": "#/$defs/P"}}},
     '{"pet":{"name":"T","x":1}}', False),
    ({"anyOf": [PET, {"type": "boolean"}]}, '{"name":"Tom","x":1}', False),
    ({"anyOf": [PET, {"type": "boolean"}]}, "true", True),
    ({"type": "array", "items": PET}, '[{"name":"Tom"},{"name":"Bo","x":1}]', False),
    # an array with prefixItems and no items takes only the listed items; items (a schema, or true) more
    (PAIR, '[1,"a"]', True),
    (PAIR, '[1,"a",2]', False),
    ({**PAIR, "items": {"type": "integer"}}, '[1,"a",2,3]', True),
    ({**PAIR, "items": True}, '[1,"a",{"x":[true]}]', True),
    ({"type": "array", "items": {"type": "integer"}}, "[1,2,3]", True),
    # a value under enum is data, not a schema to close
    ({"type": "object", "properties": {"e": {"enum": [{"k": 1, "z": 2}]}}}, '{"e":{"k":1,"z":2}}', True),
])
def test_json_schemas_are_strict_by_default(stories16, schema, text, accepted):
    assert _accepts(stories16, text, json=schema) is accepted


def test_vllms_options_keep_working_and_json_object_is_any_object(stories16):
    assert not _accepts(stories16, '{"name":"Tom","x":1}', json=PET, disable_additional_properties=True)
    assert _accepts(stories16, '{"name":"Tom","x":1}', json={**PET, "additionalProperties": True},
                    disable_additional_properties=True)
    assert _accepts(stories16, '{"anything":[1,{"goes":null}]}', json_object=True)
