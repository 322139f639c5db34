"""Chatting through the chat template: messages checked, prompts rendered exactly, replies streamed,
stopped by a stop token or a button, the history kept; and what each transformers release does with a
plain-string message. Runs on every transformers release of the matrix (make test-matrix)."""

import ast
import importlib.util
import json
import os
import threading

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import LogitsProcessor, LogitsProcessorList

from helpers import chat, loading, synthetic
from helpers.errors import ChatMessageError, CourseError, InvalidChoiceError
from helpers.paths import CHAT_DIR

QUESTION = "Where does the PLE table live?"
FIRST_ACCEPTING = Version("5.7.0")  # tools/probe_plain_strings.py: 5.6.2 crashes, 5.7.0 accepts


def user(text):
    return {"role": "user", "content": [{"type": "text", "text": text}]}


@pytest.fixture(scope="module")
def tiny_model(tiny_path):
    return loading.load_model(tiny_path, quant="bf16", ple="cpu", device="cpu")


@pytest.fixture(scope="module")
def processor(tiny_path):
    return loading.load_processor(tiny_path)


@pytest.fixture(scope="module")
def ids(tiny_tokenizer):
    config = synthetic.gemma4_config("tiny")
    turn_end = config.eos_token_id[-1]
    return {"bos": config.get_text_config().bos_token_id, "turn": turn_end - 1, "turn_end": turn_end,
            "think": tiny_tokenizer.convert_tokens_to_ids("<|think|>"),
            "text": lambda text: tiny_tokenizer(text, add_special_tokens=False)["input_ids"]}


def test_a_plain_string_content_is_kept_a_string_because_the_published_templates_render_strings():
    assert chat.check_messages([{"role": "user", "content": "Hello"}]) == [{"role": "user", "content": "Hello"}]
    assert chat.check_messages([{"role": "user", "content": "Hello"}], plain_strings="convert") == [user("Hello")]


def test_a_system_prompt_in_parts_is_sent_as_one_string_which_aprils_template_would_print_as_python():
    checked = chat.check_messages([{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, user("Hi")])
    assert checked[0]["content"] == "Be brief."


def test_a_plain_string_content_is_refused_in_one_sentence_that_names_the_fix_when_asked_to():
    with pytest.raises(ChatMessageError) as refused:
        chat.check_messages([{"role": "user", "content": "Hello"}], plain_strings="refuse")
    message = str(refused.value)
    assert "[{'type': 'text', 'text': 'Hello'}]" in message and message.count(". ") == 0 and message.endswith(".")


@pytest.mark.parametrize("messages, names", [
    ([{"role": "bot", "content": "hi"}], "'assistant'"),
    ([{"role": "tool", "content": "sunny"}], "right after the model turn"),
    ([user("hi"), {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}], "json.loads"),
    ([{"role": "user", "content": [{"type": "text"}]}], "'text': '...'"),
    ([{"role": "user", "content": [{"type": "picture", "url": "x"}]}], "'image'"),
    ([{"role": "user", "content": [{"type": "image"}]}], "'path'"),
    ([{"role": "assistant", "content": [{"type": "image", "path": "x.png"}]}], "only come from the user"),
    ([{"role": "user", "content": []}], "non-empty list of parts"),
    ("hello", "non-empty list"),
    ([], "non-empty list"),
])
def test_bad_messages_are_refused_with_one_chat_message_error_naming_the_fix(messages, names):
    with pytest.raises(ChatMessageError) as refused:
        chat.check_messages(messages)
    assert names in str(refused.value)


def test_the_processor_chat_template_crashes_on_a_plain_string_only_before_transformers_5_7(tiny_tokenizer):
    processor = chat.processor_route(tiny_tokenizer)
    outcome = chat.plain_string_outcome(processor)
    if Version(transformers.__version__) < FIRST_ACCEPTING:
        assert outcome == "TypeError: string indices must be integers, not 'str'"
    else:
        assert outcome == "accepted"
    # the control: a list of typed parts is accepted on every release
    assert processor.apply_chat_template([user("Hello")], tokenize=True, return_dict=True)["input_ids"]


def test_the_tokenizer_alone_accepts_a_plain_string_on_every_release(tiny_tokenizer):
    assert chat.plain_string_outcome(tiny_tokenizer) == "accepted"


def test_gemma4s_processor_inherits_apply_chat_template_so_the_text_processor_runs_the_same_code():
    source = importlib.util.find_spec("transformers.models.gemma4.processing_gemma4").origin
    tree = ast.parse(open(source).read())
    gemma4 = next(node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name == "Gemma4Processor")
    assert "apply_chat_template" not in {node.name for node in gemma4.body if isinstance(node, ast.FunctionDef)}
    assert chat.TextProcessor.apply_chat_template is transformers.ProcessorMixin.apply_chat_template


@pytest.mark.skipif(not synthetic.torchvision_available(), reason="Gemma 4's processor needs torchvision")
def test_the_real_gemma4_processor_does_what_the_text_processor_does_with_a_plain_string(processor, tiny_tokenizer):
    assert type(processor).__name__ == "Gemma4Processor"
    assert chat.plain_string_outcome(processor) == chat.plain_string_outcome(chat.TextProcessor(tiny_tokenizer))


def test_the_synthetic_template_renders_gemma4_turns_with_the_special_tokens_at_the_config_ids(tiny_tokenizer, ids):
    prompt = chat.render(tiny_tokenizer, [user(QUESTION)])
    assert prompt.text == f"<bos><|turn>user\n{QUESTION}<turn|>\n<|turn>model\n"
    assert prompt.ids == [ids["bos"], ids["turn"], *ids["text"](f"user\n{QUESTION}"), ids["turn_end"],
                          *ids["text"]("\n"), ids["turn"], *ids["text"]("model\n")]


def test_enable_thinking_opens_a_system_turn_with_the_think_switch(tiny_tokenizer, ids):
    prompt = chat.render(tiny_tokenizer, [user(QUESTION)], enable_thinking=True)
    assert prompt.text == f"<bos><|turn>system\n<|think|>\n<turn|>\n<|turn>user\n{QUESTION}<turn|>\n<|turn>model\n"
    opening = [ids["bos"], ids["turn"], *ids["text"]("system\n"), ids["think"]]
    assert prompt.ids[:len(opening)] == opening


def test_a_template_that_does_not_read_enable_thinking_ignores_it_silently(tiny_tokenizer):
    old = chat.describe_template(tiny_tokenizer, synthetic.TURNS_ONLY_TEMPLATE)
    new = chat.describe_template(tiny_tokenizer)
    assert new["thinking switch"] == "<|think|>" and new["enable_thinking changes the prompt"]
    assert old["thinking switch"] is None and not old["enable_thinking changes the prompt"]
    assert old["sha256"] != new["sha256"]


def test_an_earlier_thought_is_not_replayed_but_the_earlier_answer_is(tiny_tokenizer):
    earlier = {"role": "assistant", "content": "<|channel>thought\nthe table is big<channel|>On the CPU."}
    text = chat.render(tiny_tokenizer, [user("Where?"), earlier, user("Why?")]).text
    assert "On the CPU.<turn|>" in text and "the table is big" not in text
    assert chat.describe_template(tiny_tokenizer, synthetic.TURNS_ONLY_TEMPLATE)["earlier thoughts replayed"]


def test_the_generation_prompt_ends_at_the_model_turn_as_e4bs_template_does(tiny_tokenizer):
    assert chat.describe_template(tiny_tokenizer)["generation prompt"] == "<|turn>model\n"


def test_a_system_message_becomes_the_system_turn(tiny_tokenizer):
    text = chat.render(tiny_tokenizer, [{"role": "system", "content": " Be brief. "}, user("Hi")]).text
    assert text == "<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n"


def test_an_image_part_renders_the_image_placeholder_beside_the_text(tiny_tokenizer):
    message = {"role": "user", "content": [{"type": "image", "url": "cat.png"}, {"type": "text", "text": "What is it?"}]}
    text = chat.render(tiny_tokenizer, [message]).text
    assert text == "<bos><|turn>user\n<|image|>What is it?<turn|>\n<|turn>model\n"


def test_byte_pieces_that_are_not_utf8_may_stream_differently_but_the_widget_ends_on_the_whole_decode(
        tiny_model, processor, monkeypatch):
    import html

    pieces = byte_piece_ids(processor)
    allowed = set(pieces) | {chat.text_of(processor).convert_tokens_to_ids("\n")}
    vocabulary = tiny_model.get_output_embeddings().weight.shape[0]
    monkeypatch.setattr(tiny_model.generation_config, "suppress_tokens", [i for i in range(vocabulary) if i not in allowed])
    turn = greedy_chat(tiny_model, processor, max_new_tokens=24).ask(QUESTION, display=False)
    reply = turn.wait()
    assert set(reply.new_ids) <= allowed and len(set(reply.new_ids)) > 4
    assert "\ufffd" in reply.text  # the bytes are not UTF-8: this is the case the test is about
    assert html.escape(reply.text) in turn.text_area.value  # what stays on screen is the whole decode


def test_a_reply_stopped_mid_thought_has_a_thought_and_no_answer():
    assert chat.split_thought("<|channel>thought\nA<channel|>B") == ("A", "B")
    assert chat.split_thought("<|channel>thought\nstill thinking") == ("still thinking", "")
    assert chat.split_thought("just an answer") == ("", "just an answer")


def greedy_chat(model, processor, **options):
    return chat.Chat(model, processor, sampling=chat.Sampling.greedy(), **options)


def byte_piece_ids(processor) -> list:
    return sorted(i for piece, i in chat.text_of(processor).get_vocab().items() if piece.startswith("<0x"))


def test_streamed_pieces_join_to_the_decoded_new_tokens_without_the_prompt(tiny_model, processor, monkeypatch):
    # random weights string byte pieces into runs that are not UTF-8, which the streamer and a whole
    # decode spell differently (the next test); text a trained model writes is UTF-8
    monkeypatch.setattr(tiny_model.generation_config, "suppress_tokens",
                        byte_piece_ids(processor) + sorted(chat.stop_token_ids(tiny_model)))  # and a long reply
    reply = greedy_chat(tiny_model, processor, max_new_tokens=24).ask(QUESTION, display=False).wait()
    assert reply.stopped_by in ("max_new_tokens", "stop token") and len(reply.new_ids) <= 24
    assert len(set(reply.new_ids)) > 4  # random weights can collapse to one token: this reply varies
    assert "".join(reply.streamed) == processor.decode(reply.new_ids, skip_special_tokens=False)
    kept = reply.new_ids[:-1] if reply.stopped_by == "stop token" else reply.new_ids  # the stop token is not text
    assert reply.text == processor.decode(kept, skip_special_tokens=False)
    assert QUESTION not in reply.text and len(reply.streamed) > 1


def test_the_stop_button_ends_generation_long_before_max_new_tokens(tiny_model, processor):
    session = greedy_chat(tiny_model, processor, max_new_tokens=5000)
    turn = session.ask(QUESTION, display=False)
    while not turn.done and not turn.text_area.value:
        threading.Event().wait(0.01)
    turn.stop_button.click()
    reply = turn.wait(timeout=120)
    assert reply.stopped_by == "stop button" and 0 < len(reply.new_ids) < 5000
    assert turn.stop_button.disabled


@pytest.mark.parametrize("timeout", [-1, "8", True, float("nan")])
def test_waiting_for_a_reply_with_a_timeout_that_is_no_time_is_refused_in_one_sentence(tiny_model, processor, timeout):
    turn = greedy_chat(tiny_model, processor, max_new_tokens=4).ask(QUESTION, display=False)
    with pytest.raises(InvalidChoiceError, match="timeout="):
        turn.wait(timeout)
    assert turn.wait(timeout=120).new_ids  # the control: a real timeout waits for the reply


def test_a_stop_token_from_the_generation_config_ends_the_reply_and_is_not_part_of_it(tiny_path, processor):
    model = loading.load_model(tiny_path, quant="bf16", ple="cpu", device="cpu")
    free_run = greedy_chat(model, processor, max_new_tokens=16).ask(QUESTION, display=False).wait()
    stop_at = next(i for i, token in enumerate(free_run.new_ids) if i > 0 and token not in free_run.new_ids[:i])
    model.generation_config.eos_token_id = [*chat.stop_token_ids(model), free_run.new_ids[stop_at]]
    reply = greedy_chat(model, processor, max_new_tokens=16).ask(QUESTION, display=False).wait()
    assert reply.stopped_by == "stop token" and reply.new_ids == free_run.new_ids[:stop_at + 1]
    assert reply.text == processor.decode(free_run.new_ids[:stop_at], skip_special_tokens=False)


def test_the_history_keeps_both_turns_and_the_next_prompt_replays_the_previous_reply(tiny_model, processor):
    session = greedy_chat(tiny_model, processor, max_new_tokens=8, system="Be brief.")
    first = session.ask(QUESTION, display=False).wait()
    assert [m["role"] for m in session.history] == ["system", "user", "assistant"]
    second = session.ask("And the KV cache?", display=False).wait()
    assert [m["role"] for m in session.history] == ["system", "user", "assistant", "user", "assistant"]
    assert f"<|turn>model\n{first.text.strip()}<turn|>\n<|turn>user\nAnd the KV cache?" in second.prompt.text
    assert len(second.prompt) > len(first.prompt) + len(first.new_ids)


def test_a_second_question_while_a_reply_is_streaming_is_refused(tiny_model, processor):
    session = greedy_chat(tiny_model, processor, max_new_tokens=5000)
    turn = session.ask(QUESTION, display=False)
    try:
        with pytest.raises(CourseError, match="Stop button"):
            session.ask("another", display=False)
    finally:
        turn.stop()
        turn.wait(timeout=120)


def test_greedy_is_reproducible_and_sampling_with_a_seed_is_too_but_differs_across_seeds(tiny_model, processor):
    def reply(sampling):
        return chat.Chat(tiny_model, processor, sampling=sampling, max_new_tokens=12).ask(QUESTION, display=False).wait().new_ids

    assert reply(chat.Sampling.greedy()) == reply(chat.Sampling.greedy())
    hot = [reply(chat.Sampling(temperature=2.0, top_k=200, seed=seed)) for seed in (1, 1, 2)]
    assert hot[0] == hot[1] and hot[0] != hot[2]


@pytest.mark.parametrize("options, fix", [
    (dict(temperature=0), "Sampling.greedy()"), (dict(top_p=1.5), "(0, 1]"), (dict(top_k=0), "at least 1")])
def test_impossible_sampling_settings_are_refused_with_the_fix(options, fix):
    with pytest.raises(CourseError, match=fix.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        chat.Sampling(**options)


def test_sampling_defaults_come_from_the_checkpoints_generation_config(tiny_model):
    assert chat.Sampling.from_checkpoint(tiny_model).generate_kwargs() == {"do_sample": True}
    assert chat.Sampling.greedy().generate_kwargs() == {"do_sample": False}


def test_the_gpu_cache_is_freed_after_a_turn(tiny_model, processor):
    reply = greedy_chat(tiny_model, processor, max_new_tokens=4).ask(QUESTION, display=False).wait()
    if torch.cuda.is_available():
        assert reply.reserved_bytes_after == torch.cuda.memory_reserved()
    else:
        assert reply.reserved_bytes_after == 0


def test_an_image_without_the_full_processor_is_refused_before_generating(tiny_model, tiny_tokenizer):
    session = greedy_chat(tiny_model, tiny_tokenizer)
    picture = [{"type": "image", "url": "cat.png"}, {"type": "text", "text": "What is it?"}]
    with pytest.raises(CourseError, match="pip install torchvision"):
        session.ask(picture, display=False)
    assert session.history == []


def test_running_out_of_gpu_memory_mid_reply_says_how_to_fit(tiny_model, processor, monkeypatch):
    from helpers.errors import InsufficientGPUMemoryError

    def out_of_memory(**kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    session = greedy_chat(tiny_model, processor)
    monkeypatch.setattr(tiny_model, "generate", out_of_memory)
    turn = session.ask(QUESTION, display=False)
    with pytest.raises(InsufficientGPUMemoryError, match="ple='cpu'"):
        turn.wait(timeout=60)
    assert turn.status.value.startswith("failed: InsufficientGPUMemoryError") and session.history == []


@pytest.mark.parametrize("make, message", [
    (lambda tokenizer: chat.render(tokenizer, [{"role": "user", "content": "hi"}], enable_thinking="no"), "enable_thinking"),
    (lambda tokenizer: chat.render(tokenizer, [{"role": "user", "content": "hi"}], add_generation_prompt="no"),
     "add_generation_prompt"),
    (lambda tokenizer: chat.Sampling(do_sample="no"), "do_sample"),
    (lambda tokenizer: chat.Sampling(temperature=float("inf")), "temperature"),
    (lambda tokenizer: chat.Sampling(temperature=True), "temperature"),
    (lambda tokenizer: chat.Sampling(seed=1.5), "seed"),
], ids=["thinking-no", "generation-prompt-no", "do-sample-no", "temperature-inf", "temperature-true", "seed-1.5"])
def test_a_string_or_number_taken_for_a_yes_is_refused_in_one_sentence_not_obeyed(tiny_tokenizer, make, message):
    with pytest.raises(CourseError, match=message):
        make(tiny_tokenizer)


def test_the_chat_box_sends_what_the_learner_types_and_streams_each_reply_under_it(tiny_model, processor):
    session = chat.Chat(tiny_model, processor, sampling=chat.Sampling.greedy(), max_new_tokens=6)
    box = session.box()
    box.text.value = "Where does the PLE table live?"  # what pressing Enter after typing does
    assert box.text.value == "" and len(box.transcript.children) == 2
    first = session._current.wait()
    assert [m["role"] for m in session.history] == ["user", "assistant"] and first.new_ids
    box.text.unobserve_all("value")  # so that only the button sends the next one
    box.text.value = "And the KV cache?"
    assert len(session.history) == 2
    box.send.click()
    session._current.wait()
    assert len(box.transcript.children) == 4 and len(session.history) == 4
    box.text.value = "   "  # nothing typed: nothing sent
    box.send.click()
    assert len(session.history) == 4 and len(box.transcript.children) == 4


def test_a_chat_box_and_its_finished_turns_do_not_keep_a_deleted_model_alive(tiny_path, processor):
    import gc
    import weakref

    model = loading.load_model(tiny_path, quant="bf16", ple="cpu", device="cpu")
    session = chat.Chat(model, processor, sampling=chat.Sampling.greedy(), max_new_tokens=4)
    box, gone = session.box(), weakref.ref(model)
    box.text.value = "Hello"
    turn = session._current
    turn.wait()
    del session, model  # what notebook 07's last cell does; `turn` and the widgets are still alive
    gc.collect()
    assert gone() is None, "the chat's widgets or its finished turn hold the model: its GPU memory is not given back"
    box.text.value = "Still there?"
    assert "ended" in box.children[-1].value and turn.done


PUBLISHED = json.loads((CHAT_DIR / "published-templates.json").read_text())
CASES = PUBLISHED["cases"]


def render_case(tokenizer, case, chat_template=None):
    spec = CASES[case]
    return chat.render(tokenizer, spec["messages"], tools=spec["tools"], enable_thinking=spec["enable_thinking"],
                       add_generation_prompt=spec["add_generation_prompt"], chat_template=chat_template).text


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_courses_template_renders_each_recorded_case_as_googles_july_template_does(tiny_tokenizer, case):
    assert render_case(tiny_tokenizer, case) == PUBLISHED["versions"]["july"]["helpers.chat renders"][case]


def test_the_recorded_cases_differ_between_versions_so_the_comparison_can_fail():
    rendered = {name: version["rendered"] for name, version in PUBLISHED["versions"].items()}
    assert rendered["april"]["system parts"] != rendered["may"]["system parts"] != rendered["may"]["system string"]
    assert rendered["july"]["after a tool response, thinking on"] != rendered["may"]["after a tool response, thinking on"]
    for name, version in PUBLISHED["versions"].items():  # helpers.chat sends a string where the raw parts break
        assert version["helpers.chat renders"]["system parts"] == version["rendered"]["system string"], name


@pytest.mark.skipif(not os.environ.get("GEMMA_PUBLISHED_TEMPLATES"),
                    reason="set GEMMA_PUBLISHED_TEMPLATES to a git directory of ollama/ollama to render the published files")
@pytest.mark.parametrize("version", sorted(PUBLISHED["versions"]))
def test_helpers_chat_renders_each_published_version_as_recorded(tiny_tokenizer, version):
    from tools.record_published_templates import published_template

    record = PUBLISHED["versions"][version]
    template = published_template(os.environ["GEMMA_PUBLISHED_TEMPLATES"], record["source"]["commit"])
    for case in CASES:
        assert render_case(tiny_tokenizer, case, template) == record["helpers.chat renders"][case], case


def test_chat_with_a_string_system_prompt_renders_it_as_the_string_not_as_python_text(tiny_model, tiny_tokenizer):
    prompt = chat.Chat(tiny_model, tiny_tokenizer, system="Be brief.").prompt("Hi")
    assert "<|turn>system\nBe brief.<turn|>" in prompt.text and "[{" not in prompt.text


def test_describe_template_tells_the_course_template_from_the_turns_only_one(tiny_tokenizer):
    course = chat.describe_template(tiny_tokenizer)
    older = chat.describe_template(tiny_tokenizer, synthetic.TURNS_ONLY_TEMPLATE)
    assert course["tools declared"] and not older["tools declared"]
    assert course["same, thinking on"] == "<|channel>thought\n" != older["same, thinking on"]
    assert course["system prompt as parts"] == "BRIEF"


REPLY = '<|channel>thought\nNeed it.<channel|>Checking.<|tool_call>call:get_weather{city:<|"|>Paris, FR<|"|>,days:2}<tool_call|>'
CALLED = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris, FR", "days": 2}}}]


def test_a_tool_call_is_parsed_by_transformers_own_parse_response_on_this_release(tiny_tokenizer):
    parsed = chat.parse_reply(tiny_tokenizer, REPLY, "<|turn>model\n")
    assert parsed["tool_calls"] == CALLED and parsed["thinking"] == "Need it." and parsed["content"] == "Checking."
    assert parsed["parsed by"].startswith("transformers parse_response")
    assert "tool_calls" not in chat.parse_reply(tiny_tokenizer, "Checking.", "<|turn>model\n")  # the control


def test_without_parse_response_the_courses_regex_parses_the_same_call(tiny_tokenizer, monkeypatch):
    for klass in type(tiny_tokenizer).__mro__:
        if "parse_response" in vars(klass):
            monkeypatch.delattr(klass, "parse_response")
    parsed = chat.parse_reply(tiny_tokenizer, REPLY)
    assert parsed["parsed by"].startswith("the course's regex")
    assert parsed["tool_calls"] == CALLED and parsed["thinking"] == "Need it." and parsed["content"] == "Checking."


@pytest.mark.parametrize("shape", list(synthetic.SHAPES))
def test_every_shape_carries_gemma4s_protocol_tokens_at_the_published_ids_and_stops_at_all_three(shape):
    config = synthetic.gemma4_config(shape)
    specials = synthetic.vocabulary(config)[1]
    assert {token: specials[token] for token in synthetic.PROTOCOL_TOKENS} == synthetic.PROTOCOL_TOKENS
    stops = [synthetic.PROTOCOL_TOKENS[token] for token in synthetic.STOP_TOKENS]
    assert synthetic.stop_token_ids(config) == stops and synthetic.generation_config(config).eos_token_id == stops


def test_tinys_tokenizer_reads_a_tool_call_marker_as_one_token_and_still_spells_any_text(tiny_tokenizer):
    ids = tiny_tokenizer("<|tool_call>call:f{}<tool_call|>", add_special_tokens=False)["input_ids"]
    assert ids[0] == synthetic.PROTOCOL_TOKENS["<|tool_call>"] and ids[-1] == synthetic.PROTOCOL_TOKENS["<tool_call|>"]
    text = "Grüße, 世界! <tool_call> is plain text"
    assert tiny_tokenizer.decode(tiny_tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    assert len(tiny_tokenizer("<tool_call>", add_special_tokens=False)["input_ids"]) > 1  # the control: not a marker


class ForceAt(LogitsProcessor):
    """Makes ``token`` the only choice at new-token ``step``: a reply that must end there if ``token`` stops it."""

    def __init__(self, token, step, prompt_length):
        self.token, self.step, self.prompt_length = token, step, prompt_length

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] - self.prompt_length == self.step:
            scores[:] = -float("inf")
            scores[:, self.token] = 0
        return scores


def test_a_reply_ends_at_every_stop_id_the_generation_config_lists(tiny_model, processor, monkeypatch):
    stops = chat.stop_token_ids(tiny_model)
    assert stops == synthetic.stop_token_ids(synthetic.gemma4_config("tiny"))
    prompt_length = len(chat.render(processor, [{"role": "user", "content": QUESTION}]).ids)
    for token in [*stops, synthetic.vocabulary(synthetic.gemma4_config("tiny"))[1]["<|think|>"]]:  # the last: a control
        monkeypatch.setattr(chat.Sampling, "generate_kwargs", lambda self, token=token: {
            "do_sample": False, "logits_processor": LogitsProcessorList([ForceAt(token, 3, prompt_length)])})
        reply = chat.Chat(tiny_model, processor, max_new_tokens=8).ask(QUESTION, display=False).wait()
        if token in stops:
            assert reply.stopped_by == "stop token" and len(reply.new_ids) == 4 and reply.new_ids[-1] == token
        else:
            assert reply.stopped_by == "max_new_tokens" and reply.new_ids[3] == token


def test_the_synthetic_protocol_tokens_and_stop_ids_agree_with_the_published_record():
    published = json.loads((CHAT_DIR / "published-protocol.json").read_text())
    assert synthetic.PROTOCOL_TOKENS == published["markers"]
    assert [published["markers"][token] for token in synthetic.STOP_TOKENS] == published["stop_ids"]
    for shape in synthetic.SHAPES:
        assert synthetic.generation_config(synthetic.gemma4_config(shape)).eos_token_id == published["stop_ids"]
    e4b = synthetic.gemma4_config("e4b-shape")
    assert e4b.eos_token_id == published["config_eos_token_id"]
    moved = {**synthetic.PROTOCOL_TOKENS, "<|tool_response>": 53}  # the control: one id off is caught
    assert moved != published["markers"]


def test_the_model_itself_emitting_each_published_stop_id_ends_the_reply_and_without_it_the_reply_goes_on(
        tiny_path, processor):
    # a tiny copy whose tied output row for the stop id is a boosted copy of a token greedy picks, so the model
    # chooses the stop id there by itself; the same weights with that id left out of the stop list are the control
    model = loading.load_model(tiny_path, quant="bf16", ple="cpu", device="cpu")
    head, stops = model.get_output_embeddings().weight, chat.stop_token_ids(model)
    assert stops == [synthetic.PROTOCOL_TOKENS[token] for token in synthetic.STOP_TOKENS]
    free = greedy_chat(model, processor, max_new_tokens=12).ask(QUESTION, display=False).wait().new_ids
    step = next(i for i, token in enumerate(free) if 0 < i < 6 and token not in free[:i] and token not in stops)
    for stop in stops:
        saved = head.data[stop].clone()
        with torch.no_grad():
            head.data[stop] = (head.data[free[step]].float() * 1.125).to(head.dtype)
        try:
            model.generation_config.eos_token_id = [token for token in stops if token != stop]
            control = greedy_chat(model, processor, max_new_tokens=12).ask(QUESTION, display=False).wait()
            assert stop in control.new_ids, f"the boosted row did not make the model emit {stop}"
            at = control.new_ids.index(stop)
            assert len(control.new_ids) > at + 1  # not a stop id here: the reply goes on past it
            model.generation_config.eos_token_id = stops
            reply = greedy_chat(model, processor, max_new_tokens=12).ask(QUESTION, display=False).wait()
            assert reply.stopped_by == "stop token" and reply.new_ids == control.new_ids[:at + 1]
        finally:
            with torch.no_grad():
                head.data[stop] = saved
            model.generation_config.eos_token_id = stops


def test_the_protocol_record_names_a_source_with_a_commit_for_every_marker_and_stop_id():
    published = json.loads((CHAT_DIR / "published-protocol.json").read_text())
    stated = {marker for source in published["sources"] for marker in source["markers"]}
    assert stated == set(published["markers"])
    assert all(len(source["commit"]) == 40 and int(source["commit"], 16) >= 0 for source in published["sources"])
    assert any(str(published["stop_ids"]).replace(" ", "") in source["what"].replace(" ", "")
               for source in published["sources"])


def test_the_protocol_recorder_reads_each_sources_form_and_refuses_sources_that_disagree_or_leave_a_gap():
    from tools import record_published_protocol as recorder

    constants = ("class _Gemma3SpecialTokens(enum.IntEnum):\n  EOS = 7\n\n"  # another model's: not read
                 "class _Gemma4SpecialTokens(SpecialTokens, enum.IntEnum):\n  PAD = 0\n  EOS = 1\n"
                 "  START_OF_TURN = 105  # <|turn>\n  BEGIN_OF_TOOL_RESPONSE = 50\n\n\n@dataclasses.dataclass\nclass X:\n  Y = 9\n")
    assert recorder.gemma_constants(constants) == {"<eos>": 1, "<|turn>": 105, "<|tool_response>": 50}
    assert recorder.quoted_vocabulary('V = {"<eos>": 1, \'<|"|>\': 52, "hello": 7}') == {"<eos>": 1, '<|"|>': 52}
    assert recorder.id_table('[(98, "<|think|>"), (52, "<|\\"|>"), (255_999, "<|image>")]') == {"<|think|>": 98, '<|"|>': 52}
    assert recorder.stop_ids('`{"eos_token_id":[1,106,50]}`') == [1, 106, 50]
    every = {marker: number for number, marker in enumerate(recorder.MARKERS)}
    assert recorder.agreed([{"repo": "a", "found": every}, {"repo": "b", "found": {"<eos>": 0}}]) == every
    with pytest.raises(recorder.SourceError, match="b gives <eos> the id 5, another source 0"):
        recorder.agreed([{"repo": "a", "found": every}, {"repo": "b", "found": {"<eos>": 5}}])
    with pytest.raises(recorder.SourceError, match=r"no source states the id of <\|think\|>"):
        recorder.agreed([{"repo": "a", "found": {k: v for k, v in every.items() if k != "<|think|>"}}])
