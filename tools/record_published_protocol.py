"""Record Gemma 4's protocol markers and stop ids from public files, into data/chat/published-protocol.json
(tests/test_chat.py checks the synthetic checkpoints against it).

    python tools/record_published_protocol.py --gemma GEMMA_GIT --vllm-mlx VLLM_MLX_GIT --ollama OLLAMA_GIT \\
        --table CAMELID_FILE

Each source is read, never copied: google-deepmind/gemma's tokenizer constants (Google's own code), the Gemma 4
vocabulary of vllm-mlx's output-router test, a table of special ids checked against Google's tokenizer.json
(timtoole02/Camelid's pair gate; the file itself, as ``--table``, since that repository has no snapshot here)
and ollama's generation_config.json fragment. Every marker must be stated by at least one source, and sources
that state the same marker must agree, or nothing is written.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: helpers without an install
from helpers.paths import CHAT_DIR, write_text_atomically  # noqa: E402

RECORD = CHAT_DIR / "published-protocol.json"
CONFIG = ROOT / "data" / "configs" / "gemma-4-E4B-it.config.json"
# the markers transformers' Gemma 4 conversion names as the tokenizer's special tokens, and <eos>
MARKERS = ("<eos>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>",
           '<|"|>', "<|think|>", "<|channel>", "<channel|>", "<|turn>", "<turn|>")
# Google's constants name two markers only in their identifiers
GEMMA_NAMES = {"EOS": "<eos>", "BEGIN_OF_TOOL_RESPONSE": "<|tool_response>"}
GEMMA_PATH = "gemma/gm/text/_tokenizer.py"
VLLM_MLX_PATH = "tests/test_output_router.py"
OLLAMA_PATH = "x/models/gemma4/gemma4_test.go"
TABLE_SOURCE = ("timtoole02/Camelid", "tests/gemma4_mtp_pair_gate.rs", "b2533e7d25ba9c0dabe87af9fc57cc613a2f87dc")


class SourceError(SystemExit):
    """A source that cannot be read or disagrees: one sentence, nothing written."""


def gemma_constants(text: str) -> dict:
    """marker -> id from the body of ``class _Gemma4SpecialTokens``: ``NAME = id  # <marker>`` lines."""
    start = text.find("class _Gemma4SpecialTokens")
    if start < 0:
        raise SourceError(f"{GEMMA_PATH} has no class _Gemma4SpecialTokens: name a commit of google-deepmind/gemma that does.")
    body = re.split(r"\n(?:class |@)", text[start:].split("\n", 1)[1], maxsplit=1)[0]
    found = {}
    for name, number, comment in re.findall(r"^\s+([A-Z_]+) = (\d+)(?:\s*#\s*(<\S+>))?", body, flags=re.M):
        marker = comment or GEMMA_NAMES.get(name)
        if marker in MARKERS:
            found[marker] = int(number)
    return found


def quoted_vocabulary(text: str) -> dict:
    """marker -> id from a Python mapping's ``"<marker>": id`` or ``'<marker>': id`` entries."""
    pairs = re.findall(r"""(?:"([^"\n]+)"|'([^'\n]+)')\s*:\s*(\d+)""", text)
    return {double or single: int(number) for double, single, number in pairs if (double or single) in MARKERS}


def id_table(text: str) -> dict:
    """marker -> id from a table of ``(id, "<marker>")`` pairs (ids may carry ``_`` separators)."""
    pairs = re.findall(r'\((\d[\d_]*),\s*"((?:[^"\\]|\\.)*)"\)', text)
    return {piece.replace('\\"', '"'): int(number.replace("_", "")) for number, piece in pairs
            if piece.replace('\\"', '"') in MARKERS}


def stop_ids(text: str) -> list:
    """The ``"eos_token_id": [...]`` list of a generation_config.json fragment."""
    match = re.search(r'\\?"eos_token_id\\?"\s*:\s*\[([\d,\s]+)\]', text)
    if not match:
        raise SourceError(f"{OLLAMA_PATH} has no eos_token_id list: name a commit of ollama/ollama that does.")
    return [int(number) for number in match.group(1).split(",")]


def agreed(sources: list) -> dict:
    """One id per marker from every source's findings; refused where a marker is missing or two sources differ."""
    markers = {}
    for source in sources:
        for marker, number in source["found"].items():
            if markers.setdefault(marker, number) != number:
                raise SourceError(f"{source['repo']} gives {marker} the id {number}, another source {markers[marker]}: "
                                  "look at both files before recording either.")
    missing = [marker for marker in MARKERS if marker not in markers]
    if missing:
        raise SourceError(f"no source states the id of {', '.join(missing)}: add a source that does.")
    return {marker: markers[marker] for marker in MARKERS}


def git_file(gitdir: Path, path: str) -> tuple:
    """(commit, text) of ``path`` at HEAD of a repository's git directory."""
    try:
        commit = subprocess.run(["git", "--git-dir", str(gitdir), "rev-parse", "HEAD"], check=True,
                                capture_output=True, text=True).stdout.strip()
        text = subprocess.run(["git", "--git-dir", str(gitdir), "show", f"HEAD:{path}"], check=True,
                              capture_output=True, text=True).stdout
    except subprocess.CalledProcessError as error:
        raise SourceError(f"{gitdir} has no {path} at HEAD ({error.stderr.strip()}): pass that repository's git directory.") from None
    return commit, text


def record(gemma: Path, vllm_mlx: Path, ollama: Path, table: Path) -> dict:
    sources = []
    commit, text = git_file(gemma, GEMMA_PATH)
    sources.append({"repo": "google-deepmind/gemma", "path": GEMMA_PATH, "commit": commit, "found": gemma_constants(text),
                    "what": "Google's own tokenizer constants for Gemma 4 (class _Gemma4SpecialTokens)"})
    commit, text = git_file(vllm_mlx, VLLM_MLX_PATH)
    sources.append({"repo": "raullenchai/vllm-mlx", "path": VLLM_MLX_PATH, "commit": commit,
                    "found": quoted_vocabulary(text), "what": "the Gemma 4 token ids of its output-router test vocabulary"})
    repo, path, commit = TABLE_SOURCE
    sources.append({"repo": repo, "path": path, "commit": commit, "found": id_table(Path(table).read_text()),
                    "what": "its special-id table, which that test checks against Google's tokenizer.json"})
    markers = agreed(sources)
    commit, text = git_file(ollama, OLLAMA_PATH)
    stops = stop_ids(text)
    by_id = {number: marker for marker, number in markers.items()}
    if any(number not in by_id for number in stops):
        raise SourceError(f"the stop ids {stops} name ids no marker has: check {OLLAMA_PATH}.")
    sources.append({"repo": "ollama/ollama", "path": OLLAMA_PATH, "commit": commit, "found": {},
                    "what": f"a Gemma 4 generation_config.json fragment: eos_token_id {stops}"})
    config = json.loads(CONFIG.read_text())
    for source in sources:
        source["markers"] = sorted(source.pop("found"), key=MARKERS.index)
    return {"about": "Gemma 4's protocol markers and stop ids as public files give them (tools/record_published_protocol.py, "
                     "which reads each source named below); tests/test_chat.py checks helpers.synthetic against them.",
            "markers": markers, "stop_tokens": [by_id[number] for number in stops], "stop_ids": stops,
            "config_eos_token_id": config["eos_token_id"], "sources": sources}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gemma", type=Path, required=True, help="google-deepmind/gemma's git directory")
    parser.add_argument("--vllm-mlx", type=Path, required=True, help="raullenchai/vllm-mlx's git directory")
    parser.add_argument("--ollama", type=Path, required=True, help="ollama/ollama's git directory")
    parser.add_argument("--table", type=Path, required=True, help=f"{TABLE_SOURCE[1]} of {TABLE_SOURCE[0]} at {TABLE_SOURCE[2][:8]}")
    args = parser.parse_args(argv)
    written = record(args.gemma, args.vllm_mlx, args.ollama, args.table)
    write_text_atomically(RECORD, json.dumps(written, indent=1, ensure_ascii=False) + "\n")
    print(f"{RECORD.relative_to(ROOT)}: {len(written['markers'])} markers from {len(written['sources'])} sources; "
          f"stop ids {written['stop_ids']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
