"""PromptAligner: canonical tokenization of chat and completion prompts, with the plan's
segments mapped onto the tokens.

The property that matters most: a plan never changes a prompt's token ids (they are the
ids of the same prompt without a plan). Then: a segment whose edges are token edges is
placed, and its ids are those of its text, so a text shared by two prompts in the same
surroundings gets the same ids in both, wherever it sits; one whose edge falls inside
a token is not placed."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.wire.plan import Segment, SegmentPlan
from engine_ext.reuse.aligner import AlignedPrompt, PromptAligner, token_edges
from engine_ext.reuse.segments import TokenSegment
from engine_ext.tokenizer import Tokenizer

DOC = "the capital of France is Paris and Berlin is the capital of Germany."
ANSWER = "The engine schedules requests in batches; every step decodes one token."

Span = tuple[int, int, int, str, "str | None"]  # message, start, end, kind, name


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def make_plan(contents: list[str], spans: list[Span]) -> SegmentPlan:
    segments = [Segment(message_index=m, char_start=s, char_end=e, kind=kind, name=name,  # type: ignore[arg-type]
                        content_hash=sha(contents[m][s:e]) if m < len(contents) else sha("x"))
                for m, s, e, kind, name in spans]
    return SegmentPlan(session_id="s", agent_id="a", request_id="r", segments=segments)


def around(content: str, needle: str, message: int, kind: str = "shared_block",
           name: str | None = None) -> list[Span]:
    """Spans covering `content` with `needle` as its own segment, private text around it."""
    start = content.index(needle)
    end = start + len(needle)
    spans: list[Span] = []
    if start:
        spans.append((message, 0, start, "private", None))
    spans.append((message, start, end, kind, name))
    if end < len(content):
        spans.append((message, end, len(content), "private", None))
    return spans


def chat_aligned(aligner: PromptAligner, messages: list[dict], spans: list[Span]) -> AlignedPrompt:
    return aligner.chat(messages, None, make_plan([m["content"] for m in messages], spans))


def ids_of(result: AlignedPrompt, seg: TokenSegment) -> list[int]:
    return result.token_ids[seg.start:seg.end]


def by_kind(result: AlignedPrompt, kind: str) -> list[TokenSegment]:
    return [s for s in result.segments if s.kind == kind]


def with_template(src: Path, dst: Path, template: str) -> Tokenizer:
    dst.mkdir()
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer(dst)


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir) -> Tokenizer:
    tokenizer = Tokenizer(tiny_tokenizer_dir[0])
    assert tokenizer.chat_template is not None  # the fixture writes a ChatML template
    return tokenizer


@pytest.fixture(scope="module")
def aligner(tok) -> PromptAligner:
    return PromptAligner(tok)


def two_prompts() -> tuple[list[dict], list[dict]]:
    first = [{"role": "system", "content": "You are the critic."},
             {"role": "user", "content": f"Read this:\n{DOC}\nIs it right?"}]
    second = [{"role": "system", "content": "You are the planner, a long private prefix here."},
              {"role": "user", "content": "Question one?"},
              {"role": "assistant", "content": "Answer one."},
              {"role": "user", "content": f"Now:\n{DOC}\nand then more words"}]
    return first, second


def test_shared_text_gets_identical_ids_at_different_offsets(aligner, tok):
    first, second = two_prompts()
    a = chat_aligned(aligner, first, around(first[1]["content"], DOC, 1))
    b = chat_aligned(aligner, second, around(second[3]["content"], DOC, 3))
    (sa,), (sb,) = by_kind(a, "shared_block"), by_kind(b, "shared_block")
    assert sa.start != sb.start
    assert ids_of(a, sa) == ids_of(b, sb) == tok.encode(DOC)
    assert a.note is None and b.note is None


def test_a_segment_whose_edge_falls_inside_a_token_is_trimmed_to_the_tokens_inside_it(aligner, tok):
    """" the" after a space is one token: cutting there would change the prompt's ids
    (the old segment-aligned tokenization did, and changed greedy answers). The segment
    keeps the whole tokens inside it; the straddling one is computed with its neighbours."""
    content = f"Now {DOC} and then more"
    messages = [{"role": "user", "content": content}]
    whole = tok.encode(content)
    assert not any(whole[i:i + len(tok.encode(DOC))] == tok.encode(DOC) for i in range(len(whole)))
    result = chat_aligned(aligner, messages, around(content, DOC, 0))
    assert result.token_ids == tok.encode(tok.render_chat(messages))
    (seg,) = by_kind(result, "shared_block")
    inner = tok.decode(ids_of(result, seg))
    assert inner and inner in DOC and len(inner) >= len(DOC) - len(DOC.split()[0]) - 1
    assert ids_of(result, seg) == tok.encode(DOC)[len(tok.encode(DOC)) - len(ids_of(result, seg)):]  # DOC's tail
    assert result.note is not None and "1 of 3 segments trimmed" in result.note


def test_a_segment_with_no_whole_token_inside_is_not_placed(aligner, tok):
    content = "Now the end"
    messages = [{"role": "user", "content": content}]
    plan_content = "he"  # inside the one token " the": nothing whole inside
    result = chat_aligned(aligner, messages, around(content, plan_content, 0))
    assert result.token_ids == tok.encode(tok.render_chat(messages))
    assert by_kind(result, "shared_block") == []
    assert result.note is not None and "an edge falls inside a token" in result.note


def test_token_edges_skip_positions_inside_tokens_and_shared_characters():
    # "ab" | "c" | two byte tokens of one character | "d"
    offsets = [(0, 2), (2, 3), (3, 4), (3, 4), (4, 5)]
    assert token_edges(offsets, 5) == {0: 0, 2: 1, 3: 2, 4: 4, 5: 5}
    assert 1 not in token_edges(offsets, 5)
    # A gap (offsets trimmed of a space) is no edge at either side of the gap.
    assert token_edges([(0, 2), (3, 5)], 5) == {0: 0, 5: 2}


@settings(max_examples=150, deadline=None)
@given(words=st.lists(st.sampled_from(["the", " the", "capital", " of", "\n", " ", "é", "日本", ".", "42",
                                        "Paris", "  ", "\n\n", "is"]), min_size=1, max_size=30),
       cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=6))
def test_a_plan_never_changes_the_token_ids(aligner, tok, words, cuts):
    """Any cut of any text: the ids are the whole text's, and every placed segment's ids
    decode to exactly its text, or (trimmed: an edge fell inside a token) to a piece of it."""
    content = "".join(words)
    edges = sorted({min(c, len(content)) for c in cuts} | {0, len(content)})
    spans: list[Span] = [(0, a, b, "shared_block", None) for a, b in zip(edges, edges[1:]) if b > a]
    messages = [{"role": "user", "content": content}]
    result = chat_aligned(aligner, messages, spans)
    assert result.token_ids == tok.encode(tok.render_chat(messages))
    trimmed = 0
    for seg in result.segments:
        _, start, end, _, _ = spans[seg.plan_index]
        decoded = tok.decode(ids_of(result, seg), skip_special_tokens=False)
        assert decoded in content[start:end]
        trimmed += decoded != content[start:end]
    assert (trimmed == 0) == (result.note is None or "trimmed" not in result.note)


def test_tokens_decode_back_to_the_rendered_prompt(aligner, tok):
    for messages, index in zip(two_prompts(), (1, 3)):
        result = chat_aligned(aligner, messages, around(messages[index]["content"], DOC, index))
        rendered = tok.render_chat(messages)
        assert tok.decode(result.token_ids, skip_special_tokens=False) == rendered


def test_segment_boundaries(aligner, tok):
    _, messages = two_prompts()
    content = messages[3]["content"]
    spans = around(content, DOC, 3, kind="placeholder", name="agent_x_current")
    result = chat_aligned(aligner, messages, spans)
    assert [s.plan_index for s in result.segments] == [0, 1, 2]
    assert [s.kind for s in result.segments] == ["private", "placeholder", "private"]
    assert result.segments[1].name == "agent_x_current"
    for seg, (_, start, end, _, _) in zip(result.segments, spans):
        assert tok.decode(ids_of(result, seg), skip_special_tokens=False) == content[start:end]
    # Segments of one message are contiguous in token space, and the message ends before <|im_end|>.
    assert [s.end for s in result.segments[:-1]] == [s.start for s in result.segments[1:]]
    assert result.token_ids[result.segments[-1].end] == tok.token_id("<|im_end|>")
    prefix = tok.render_chat(messages)[:tok.render_chat(messages).index(content)]
    assert tok.decode(result.token_ids[:result.segments[0].start], skip_special_tokens=False) == prefix


def test_segments_in_several_messages(aligner, tok):
    messages = [{"role": "system", "content": "You are agent B."},
                {"role": "user", "content": DOC},
                {"role": "assistant", "content": ANSWER},
                {"role": "user", "content": f"Agent A said:\n{ANSWER}\nAgree?"}]
    spans: list[Span] = [(0, 0, 9, "fixed_prefix", "b"), (0, 9, 16, "private", None),
                         (1, 0, len(DOC), "placeholder", "user_question"),
                         (2, 0, len(ANSWER), "placeholder", "agent_b_history_0"),
                         *around(messages[3]["content"], ANSWER, 3, "placeholder", "agent_a_current")]
    result = chat_aligned(aligner, messages, spans)
    assert result.note is None
    assert [s.plan_index for s in result.segments] == list(range(len(spans)))
    assert all(a.end <= b.start for a, b in zip(result.segments, result.segments[1:]))
    history, current = result.segments[3], result.segments[5]
    assert ids_of(result, history) == ids_of(result, current) == tok.encode(ANSWER)
    assert tok.decode(result.token_ids, skip_special_tokens=False) == tok.render_chat(messages)


def test_text_before_a_segment_is_tokenized_as_without_a_plan(aligner, tok):
    messages = [{"role": "system", "content": "Be brief and kind."},
                {"role": "user", "content": f"x:\n{DOC}"}]
    result = chat_aligned(aligner, messages, [(1, 3, len(DOC) + 3, "shared_block", None)])
    rendered = tok.render_chat(messages)
    cut = rendered.index(DOC)
    assert result.token_ids[:result.segments[0].start] == tok.encode(rendered[:cut])


def test_hash_mismatch_skips_that_segment(aligner, tok):
    first, _ = two_prompts()
    content = first[1]["content"]
    spans = around(content, DOC, 1)
    plan = make_plan([m["content"] for m in first], spans)
    stale = plan.segments[1].model_copy(update={"content_hash": sha("another text")})
    plan = plan.model_copy(update={"segments": [plan.segments[0], stale, plan.segments[2]]})
    result = aligner.chat(first, None, plan)
    assert [s.plan_index for s in result.segments] == [0, 2]
    assert result.note == "1 of 3 segments skipped: content differs from the plan"
    assert tok.decode(result.token_ids, skip_special_tokens=False) == tok.render_chat(first)


def test_out_of_range_segments_are_skipped(aligner, tok):
    messages = [{"role": "user", "content": DOC}]
    spans: list[Span] = [(0, 0, 3, "private", None), (0, 3, len(DOC), "shared_block", None),
                         (3, 0, 4, "private", None)]
    plan = make_plan([DOC + "tail"], spans[:2]).model_copy()  # hashes of a longer content
    plan = plan.model_copy(update={"segments": [
        plan.segments[0],
        plan.segments[1].model_copy(update={"char_end": len(DOC) + 4}),
        make_plan([DOC], spans[2:]).segments[0],
    ]})
    result = aligner.chat(messages, None, plan)
    assert [s.plan_index for s in result.segments] == [0]
    assert result.note is not None and result.note.startswith("2 of 3 segments skipped: ")
    assert "char range beyond the message (1)" in result.note and "no such message (1)" in result.note


def test_no_placeable_segment_tokenizes_as_without_a_plan(aligner, tok):
    messages = [{"role": "user", "content": DOC}]
    plan = make_plan(["something else entirely, longer than the doc is........................"],
                     [(0, 0, 10, "private", None)])
    result = aligner.chat(messages, None, plan)
    assert result.segments == [] and result.note is not None
    assert result.token_ids == tok.encode(tok.render_chat(messages))


def test_template_that_strips_content_falls_back(tiny_tokenizer_dir, tmp_path):
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = with_template(tiny_tokenizer_dir[0], tmp_path / "strip", template)
    messages = [{"role": "user", "content": f"  {DOC}\n"}]
    result = chat_aligned(PromptAligner(tok), messages, around(messages[0]["content"], DOC, 0))
    assert result.segments == []
    assert result.note is not None and "transforms message content" in result.note
    assert result.token_ids == tok.encode(tok.render_chat(messages))
    # Content the template leaves as it is still aligns under the same template.
    clean = [{"role": "user", "content": DOC}]
    assert PromptAligner(tok).chat(clean, None, make_plan([DOC], around(DOC, DOC, 0))).segments


def test_template_that_repeats_content_falls_back(tiny_tokenizer_dir, tmp_path):
    template = "{% for m in messages %}{{ m['content'] }}|{{ m['content'] }}\n{% endfor %}"
    tok = with_template(tiny_tokenizer_dir[0], tmp_path / "twice", template)
    messages = [{"role": "user", "content": DOC}]
    result = chat_aligned(PromptAligner(tok), messages, around(DOC, DOC, 0))
    assert result.segments == [] and "2 times" in (result.note or "")
    assert result.token_ids == tok.encode(tok.render_chat(messages))


def test_list_content_is_joined(aligner, tok):
    parts = [{"type": "text", "text": "Read:\n"}, {"type": "text", "text": DOC}]
    messages = [{"role": "user", "content": parts}]
    result = aligner.chat(messages, None, make_plan(["Read:\n" + DOC], around("Read:\n" + DOC, DOC, 0)))
    assert ids_of(result, result.segments[1]) == tok.encode(DOC)
    assert messages[0]["content"] is parts  # the caller's messages are left alone


def test_completion_text(aligner, tok):
    a_prompt, b_prompt = f"Context:\n{DOC}\nQ: why?", f"Other words first.\n{DOC}!"
    a = aligner.text(a_prompt, make_plan([a_prompt], around(a_prompt, DOC, 0)))
    b = aligner.text(b_prompt, make_plan([b_prompt], around(b_prompt, DOC, 0)))
    (sa,), (sb,) = by_kind(a, "shared_block"), by_kind(b, "shared_block")
    assert ids_of(a, sa) == ids_of(b, sb) == tok.encode(DOC)
    assert tok.decode(a.token_ids, skip_special_tokens=False) == a_prompt
    assert [s.plan_index for s in a.segments] == [0, 1, 2] and a.note is None
    # Message 1 does not exist for a completion.
    c = aligner.text(a_prompt, make_plan([a_prompt, DOC], [(1, 0, 5, "private", None)]))
    assert c.segments == [] and c.token_ids == tok.encode(a_prompt)
    assert c.note == "1 of 1 segments skipped: no such message"


def test_method_is_taken_from_the_plan_segment(aligner):
    prompt = f"x\n{DOC}"
    plan = make_plan([prompt], around(prompt, DOC, 0))
    shifted = [s.model_copy(update={"method": "shift" if s.kind == "shared_block" else None}) for s in plan.segments]
    result = aligner.text(prompt, plan.model_copy(update={"segments": shifted}))
    assert [s.method for s in result.segments] == [None, "shift"]


def test_smollm2_shared_text(smollm2_dir):
    tok = Tokenizer(smollm2_dir)
    aligner = PromptAligner(tok)
    # No system message: the template adds its default one, outside every message.
    first = [{"role": "user", "content": f"Summarize:\n{DOC}"}]
    second = [{"role": "system", "content": "You are the reviewer."},
              {"role": "user", "content": f"Check this claim:\n{DOC}\nThanks"}]
    a = chat_aligned(aligner, first, around(first[0]["content"], DOC, 0))
    b = chat_aligned(aligner, second, around(second[1]["content"], DOC, 1))
    (sa,), (sb,) = by_kind(a, "shared_block"), by_kind(b, "shared_block")
    assert ids_of(a, sa) == ids_of(b, sb) == tok.encode(DOC)
    for result, messages in ((a, first), (b, second)):
        assert result.note is None
        assert tok.decode(result.token_ids, skip_special_tokens=False) == tok.render_chat(messages)


def test_method_from_a_real_plan_segment(aligner):
    prompt = f"x\n{DOC}"
    plan = make_plan([prompt], around(prompt, DOC, 0))
    blended = plan.segments[1].model_copy(update={"method": "blend"})
    plan = plan.model_copy(update={"segments": [plan.segments[0], blended]})
    assert [s.method for s in aligner.text(prompt, plan).segments] == [None, "blend"]


def test_tokenizer_that_prefixes_its_input_keeps_canonical_ids(tiny_tokenizer_dir, tmp_path):
    src, dst = tiny_tokenizer_dir[0], tmp_path / "prefixed"
    dst.mkdir()
    shutil.copy(src / "tokenizer_config.json", dst / "tokenizer_config.json")
    spec = json.loads((src / "tokenizer.json").read_text())
    spec["pre_tokenizer"]["add_prefix_space"] = True  # every encode() call gains a leading space
    (dst / "tokenizer.json").write_text(json.dumps(spec))
    tok = Tokenizer(dst)
    prompt = f"x {DOC}"
    result = PromptAligner(tok).text(prompt, make_plan([prompt], around(prompt, DOC, 0)))
    assert result.token_ids == tok.encode(prompt)  # the added leading space included
