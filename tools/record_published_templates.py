"""Record what Google's published Gemma 4 E2B/E4B chat templates render for a fixed set of conversations,
into data/chat/published-templates.json (the rendered strings are facts the tests compare against).

    python tools/record_published_templates.py --ollama /path/to/ollama/.git

The three versions published since April 2026 are read from public copies in ollama's renderer test data
(model/renderers/testdata/gemma4_e2b_chat_template.jinja2 at the commits in VERSIONS) with `git show`;
they are rendered with transformers' own renderer (``render_jinja_template``, what ``apply_chat_template``
runs) and are not stored: only the strings they produce, with the source of each. For each version the
record also says whether ``helpers.chat.render`` (the course's route) gives the same text, and what the
course's own template gives.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: helpers without an install
from helpers import chat  # noqa: E402
from helpers.paths import CHAT_DIR, write_text_atomically  # noqa: E402

ERROR = "error: "  # how a case the template cannot render is recorded
RECORD = CHAT_DIR / "published-templates.json"
SOURCE_REPO = "ollama/ollama"
SOURCE_PATH = "model/renderers/testdata/gemma4_e2b_chat_template.jinja2"
VERSIONS = {
    "april": "bf2a4217271f7b679a42060f620403aa712d46b0",  # 2026-04-13, the E2B/E4B template as first split out
    "may": "c7c2837c96cd6fcc0d0424e0a096ed24516d3d59",  # 2026-04-29, list-of-parts system content handled
    "july": "8a0016f826305b0672daaf02c6c55a34f844bba3",  # 2026-07-14, the template dated "Published: 2026-07-09"
}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city's name."}},
                   "required": ["city"]}}}
CALL = {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
ASK = {"role": "user", "content": "Weather in Paris?"}
CALLED = {"role": "assistant", "tool_calls": [CALL]}
ANSWERED = {"role": "tool", "tool_call_id": "call_0", "name": "get_weather", "content": "sunny, 21 C"}

# name -> (messages, tools, enable_thinking, add_generation_prompt)
CASES = {
    "system string": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], None, False, True),
    "system parts": ([{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                      {"role": "user", "content": "Hi"}], None, False, True),
    "thinking on": ([{"role": "user", "content": "Hi"}], None, True, True),
    "developer role": ([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}], None, False, True),
    "later system message": ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                              {"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Bye"}],
                             None, False, True),
    "tools declared": ([ASK], [WEATHER], False, True),
    "tool call pending": ([ASK, CALLED], [WEATHER], False, False),
    "after a tool response": ([ASK, CALLED, ANSWERED], [WEATHER], False, True),
    "after a tool response, thinking on": ([ASK, CALLED, ANSWERED], [WEATHER], True, True),
    "tool response as a mapping": ([ASK, CALLED, {**ANSWERED, "content": {"sky": "sunny", "celsius": 21}}], [WEATHER],
                                   False, True),
    "answer after the tool, next question": ([ASK, CALLED, ANSWERED, {"role": "assistant", "content": "Sunny, 21 C."},
                                              {"role": "user", "content": "And tomorrow?"}], [WEATHER], False, True),
    "reasoning replay": ([{"role": "user", "content": "Hi"},
                          {"role": "assistant", "reasoning_content": "EARLIER", "content": "Hello."},
                          {"role": "user", "content": "Bye"},
                          {"role": "assistant", "reasoning_content": "CURRENT", "tool_calls": [CALL]}],
                         [WEATHER], False, False),
    "earlier thought in the content": ([{"role": "user", "content": "Hi"},
                                        {"role": "assistant", "content": "<|channel>thought\nSECRET<channel|>Hello."},
                                        {"role": "user", "content": "Bye"}], None, False, True),
}


def published_template(git_dir: str, commit: str) -> str:
    return subprocess.run(["git", "-C", git_dir, "show", f"{commit}:{SOURCE_PATH}"], check=True, capture_output=True,
                          text=True).stdout


def rendered_raw(template: str, messages, tools, thinking: bool, generation: bool) -> str:
    """The template's own rendering of the messages exactly as written, through transformers' renderer."""
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
            prompts, _ = render_jinja_template(conversations=[json.loads(json.dumps(messages))], tools=tools,
                                           chat_template=template, add_generation_prompt=generation,
                                           enable_thinking=thinking, bos_token="<bos>", eos_token="<eos>")
    except Exception as err:  # a version that cannot render a case: the error is the fact recorded
        return f"{ERROR}{type(err).__name__}: {err}"
    return prompts[0]


def through_helpers(tokenizer, template: str, messages, tools, thinking: bool, generation: bool) -> str:
    try:
        return chat.render(tokenizer, messages, tools=tools, enable_thinking=thinking, add_generation_prompt=generation,
                           chat_template=template).text
    except Exception as err:  # as above
        return f"{ERROR}{type(err).__name__}: {err}"


def main(argv=None) -> int:
    import transformers

    from helpers import synthetic

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ollama", required=True, help="a git directory of github.com/ollama/ollama")
    args = parser.parse_args(argv)
    tokenizer = synthetic.build_tokenizer(synthetic.gemma4_config("tiny"))
    versions = {}
    for name, commit in VERSIONS.items():
        template = published_template(args.ollama, commit)
        raw = {case: rendered_raw(template, *spec) for case, spec in CASES.items()}
        through_course = {case: through_helpers(tokenizer, template, *spec) for case, spec in CASES.items()}
        versions[name] = {
            "source": {"repo": SOURCE_REPO, "path": SOURCE_PATH, "commit": commit},
            "template_sha256_12": chat.fingerprint(template),
            "describe_template": {key: value for key, value in chat.describe_template(tokenizer, template).items()
                                  if key not in ("sha256", "characters")},
            "rendered": raw,
            "helpers.chat renders": through_course,
        }
    record = {"command": "python tools/record_published_templates.py --ollama OLLAMA_GIT_DIR",
              "transformers": transformers.__version__,
              "cases": {case: {"messages": spec[0], "tools": spec[1], "enable_thinking": spec[2],
                               "add_generation_prompt": spec[3]} for case, spec in CASES.items()},
              "versions": versions}
    write_text_atomically(RECORD, json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {RECORD.relative_to(ROOT)}: {len(CASES)} cases x {len(VERSIONS)} versions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
