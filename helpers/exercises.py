"""The exercises that end each notebook, and the checker that tells a learner whether an answer is right.

    from helpers import exercises
    exercises.check("04.1", answer, source=MODEL_NAME)     # Correct / Not yet (with a hint) / Not answered yet

Each checker computes the right answer from the course's own code (the planner, the meta model, the
mirror's settings), never from a stored value, so it stays right when a model or a record changes.
Worked solutions are in ``solutions/`` (one file per notebook); ``tests/test_exercises.py`` runs every
checker on them and on a wrong answer.
"""

from __future__ import annotations

import html
import inspect
import math
import numbers
from dataclasses import dataclass

import torch

from . import download, environment, gguf_route, mirror, models, paths, placement, planner, weights
from .chat import check_messages
from .errors import ChatMessageError, CourseError, InvalidChoiceError, require_number


@dataclass(frozen=True)
class Verdict:
    exercise: str
    correct: bool | None  # None: not answered yet
    message: str

    def __bool__(self) -> bool:
        return bool(self.correct)

    def __str__(self) -> str:
        label = {True: "Correct", False: "Not yet", None: "Not answered yet"}[self.correct]
        return f"{self.exercise}: {label}. {self.message}"

    def _repr_html_(self) -> str:
        colour = {True: "#1a7f37", False: "#cf222e", None: "#57606a"}[self.correct]
        label = {True: "Correct", False: "Not yet", None: "Not answered yet"}[self.correct]
        return (f"<p><b style='color:{colour}'>{self.exercise}: {label}.</b> {html.escape(self.message)}</p>")

    def __repr__(self) -> str:
        return str(self)


@dataclass(frozen=True)
class Exercise:
    key: str
    question: str
    hint: str  # shown with a wrong answer
    checker: object  # (answer, **context) -> (bool, what to say)


EXERCISES: dict = {}


def exercise(key: str, question: str, hint: str):
    def register(checker):
        EXERCISES[key] = Exercise(key, question, hint, checker)
        return checker
    return register


CONTEXT = ("source",)  # what a notebook may pass every checker; a checker that needs none ignores it


def check(key: str, answer, **context) -> Verdict:
    """Whether ``answer`` is right for exercise ``key`` (e.g. "04.1"); ``None`` means not answered yet."""
    if not isinstance(key, str) or key not in EXERCISES:
        raise InvalidChoiceError(f"exercise={key!r} does not exist; choose one of {', '.join(sorted(EXERCISES))}.")
    item = EXERCISES[key]
    taken = inspect.signature(item.checker).parameters
    unknown = sorted(set(context) - set(CONTEXT) - set(taken))
    if unknown:
        raise InvalidChoiceError(f"exercises.check got {', '.join(map(repr, unknown))}, which no exercise reads; pass "
                                 f"only the answer and source=MODEL_NAME.")
    context = {name: value for name, value in context.items() if name in taken}
    if answer is None:
        return Verdict(key, None, f"{item.question} Replace None with your answer and run the cell again.")
    try:
        right, said = item.checker(answer, **context)
    except (CourseError, TypeError, ValueError, KeyError, AttributeError) as err:
        sentence = err.sentence if isinstance(err, CourseError) else f"{type(err).__name__}: {err}"
        return Verdict(key, False, f"That answer could not be checked ({sentence}). Hint: {item.hint}")
    # a wrong answer gets the hint only: the explanation would give the answer away
    return Verdict(key, bool(right), said if right else f"Hint: {item.hint}")


def as_number(answer) -> float | None:
    """A numeric answer as a float: an int, a float, a numpy scalar or a one-number tensor (what
    ``.max()`` or ``torch.cuda.max_memory_allocated() / 1e9`` arithmetic gives); ``None`` for anything else."""
    if isinstance(answer, torch.Tensor) and answer.numel() == 1 and answer.dtype != torch.bool and not answer.is_complex():
        answer = answer.item()
    if isinstance(answer, bool) or not isinstance(answer, numbers.Real):
        return None
    value = float(answer)
    return value if math.isfinite(value) else None


def within(answer, expected: float, tolerance: float) -> bool:
    """Is ``answer`` a number within ``tolerance`` (a fraction) of ``expected``?"""
    require_number(expected, "expected", minimum=-math.inf)
    require_number(tolerance, "tolerance")
    value = as_number(answer)
    return value is not None and abs(value - expected) <= tolerance * expected


def meta_of(source):
    return weights.meta_model(models.load_config(source))


# ---------------------------------------------------------------- 00 setup

@exercise("00.1", "Which environment variable moves the course's cache (synthetic checkpoints, downloads) to another disk?",
          "helpers.paths says where the course keeps its files.")
def _cache_variable(answer):
    return answer == paths.CACHE_ENV, f"{paths.CACHE_ENV} moves it, e.g. to a larger disk or to Google Drive."


@exercise("00.2", "Does a Colab T4 (compute capability 7.5) compute bf16 natively? Answer True or False.",
          "bf16 is native from compute capability 8.0 (Ampere) on.")
def _t4_bf16(answer):
    native = environment.bf16_is_native(7, 5)
    return answer is native, "A T4 emulates bf16: 4-bit layers compute in fp16 there (bnb_4bit_compute_dtype=torch.float16)."


# ---------------------------------------------------------------- 01 download

@exercise("01.1", "Which three environment variables does a learner set before downloading from a classroom mirror? "
          "Answer a set of names.", "One points at the mirror, one keeps XetHub out of the way, one keeps the token home.")
def _mirror_settings(answer):
    wanted = {"HF_ENDPOINT", *(setting.split("=")[0] for setting in mirror.LEARNER_SETTINGS.split())}
    return set(answer) == wanted, f"{', '.join(sorted(wanted))}: before huggingface_hub is imported."


@exercise("01.2", "What does the course pass as huggingface_hub's token= for a classroom mirror at http://192.168.1.10:8090?",
          "download.hub_token decides; a mirror on a shared network should receive no token at all.")
def _mirror_token(answer):
    expected = download.hub_token("http://192.168.1.10:8090")
    return answer is expected, f"token={expected!r}: no token travels to a mirror (None would send the saved one)."


# ---------------------------------------------------------------- 02 quantization

@exercise("02.1", "How many bytes does bitsandbytes store per weight in NF4 without double quantization (blocks of 64, "
          "one fp32 scale each)?", "Half a byte of code per weight, plus a 4-byte scale shared by 64 weights.")
def _nf4_bytes(answer):
    expected = weights.QUANT_BYTES_PER_WEIGHT["nf4"]
    return within(answer, expected, 1e-6), f"{expected} bytes: 0.5 for the 4-bit code + 4/64 for the block's scale."


@exercise("02.2", "Which torch dtype should 4-bit layers compute in on a Colab T4?", "Look at exercise 00.2's answer.")
def _t4_compute_dtype(answer):
    expected = torch.bfloat16 if environment.bf16_is_native(7, 5) else torch.float16
    return answer == expected, f"{expected}: the T4 has no native bf16."


# ---------------------------------------------------------------- 03 device map

@exercise("03.1", "Build a device map for this model that keeps the vision tower on the CPU and everything else on GPU 0, "
          "and check it with placement.validate_device_map.", "Two keys: the tower's module name, and \"\" for the rest.")
def _vision_on_cpu(answer, source=None):
    meta = meta_of(source)
    placement.validate_device_map(meta, answer)
    towers = placement.modules_named(meta, "vision_tower")
    if not towers:
        return False, "This model has no vision tower."
    language = next(name for name, _ in meta.named_modules() if name.endswith("language_model"))
    keys = placement.key_for_each_name(answer, [towers[0], language])
    device = {name: answer[key] if key is not None else answer.get("", "cpu") for name, key in keys.items()}
    right = device[towers[0]] == "cpu" and device[language] in (0, "cuda", "cuda:0")
    return right, f"{towers[0]} on the CPU, {language} on GPU 0, every key a real module."


@exercise("03.2", "Which device-map key sends every module that no other key names to one device?",
          "It is the shortest key there is: the prefix of every module name.")
def _catch_all_key(answer):
    return answer == "", "\"\": every name starts with it, so {\"\": 0} puts the whole model on GPU 0."


# ---------------------------------------------------------------- 04 named modules

@exercise("04.1", "Which single module (a leaf, with no children) of this model holds the most parameter bytes? Answer its "
          "full name.", "Walk model.named_modules(), keep the leaves, sum p.numel() * p.element_size() of their own parameters.")
def _largest_leaf(answer, source=None):
    meta = meta_of(source)
    sizes = {name: sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
             for name, module in meta.named_modules() if not list(module.children())}
    largest = max(sizes, key=sizes.get)
    tied = {name for name, size in sizes.items() if size == sizes[largest]}  # tied weights: either name is right
    return answer in tied, f"{largest}, {sizes[largest] / 1e6:.1f} MB in bf16."


@exercise("04.2", "What is the full module name of the PLE table? Find it by its suffix.",
          f"Its name ends in {placement.PLE_SUFFIX!r}.")
def _ple_name(answer, source=None):
    names = placement.ple_module_names(meta_of(source))
    return answer in names, f"{names[0]}: the per-layer embedding, the largest single tensor of E2B and E4B."


# ---------------------------------------------------------------- 05 PLE offload

@exercise("05.1", "How many GB (10^9 bytes) does E4B's PLE table take in bf16? Within 1%.",
          "vocab_size_per_layer_input x num_hidden_layers x hidden_size_per_layer_input x 2 bytes.")
def _ple_gb(answer):
    estimate = weights.weight_bytes(meta_of("e4b-shape"), "bf16", "cpu")
    expected = estimate.cpu_bytes / 1e9
    return within(answer, expected, 0.01), f"{expected:.2f} GB, all of it on the CPU with ple='cpu'."


@exercise("05.2", "With the PLE table on the CPU, how many bytes of PLE rows travel to the GPU per generated token in E4B (bf16)?",
          "One row per token: num_hidden_layers x hidden_size_per_layer_input values of 2 bytes.")
def _ple_bytes_per_token(answer):
    text = planner.text_config_of(models.load_config("e4b-shape"))
    expected = text.num_hidden_layers * text.hidden_size_per_layer_input * 2
    return answer == expected, f"{expected:,} bytes per token: why the offload barely costs decode speed."


# ---------------------------------------------------------------- 06 memory profiling

@exercise("06.1", "Predict the peak GPU memory, in GB, of a 16,384-token prefill of E4B in NF4 with the PLE on the CPU. "
          "Within 5% of the planner (on a GPU, then measure it).", "planner.predict(\"e4b-shape\", \"nf4\", \"cpu\", 16384).")
def _peak_16k(answer):
    expected = planner.predict("e4b-shape", "nf4", "cpu", 16384).peak_bytes / 1e9
    return within(answer, expected, 0.05), f"about {expected:.2f} GB at the peak."


@exercise("06.2", "What is the largest context the planner calls safe for E4B in NF4, PLE on the CPU, on an 8 GB RTX 4060? "
          "Within 2%.", "planner.fits(\"e4b-shape\", 8, \"nf4\", \"cpu\") and its safe_context.")
def _safe_context_8gb(answer):
    expected = planner.fits("e4b-shape", 8, "nf4", "cpu").safe_context
    return within(answer, expected, 0.02), f"about {expected:,} tokens with the largest margin any measured card needed."


# ---------------------------------------------------------------- 07 chat

@exercise("07.1", "Write the messages for a user who says \"Hello\", in the form every transformers release accepts "
          "(the article's pitfall 4).", "content is a list of parts, each a dict with a type.")
def _message_form(answer):
    try:
        checked = check_messages(answer, plain_strings="refuse")
    except ChatMessageError as err:
        return False, err.sentence
    parts = checked[-1]["content"]
    right = checked[-1]["role"] == "user" and parts == [{"type": "text", "text": "Hello"}]
    return right, '[{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]'


@exercise("07.2", "Which token ends a model turn in Gemma 4's chat template (the one generate stops on besides <eos>)?",
          "The template closes every turn with it.")
def _end_of_turn(answer):
    return answer == "<turn|>", "<turn|>: it closes every turn, and generation_config lists it as a stop token."


# ---------------------------------------------------------------- 08 llama.cpp

@exercise("08.1", "Which llama.cpp quantization type does the course's GGUF route produce?", "The article's file name carries it.")
def _gguf_quant(answer):
    expected = gguf_route.QUANT_TYPES[0]
    return answer == expected, f"{expected}: 4-bit k-quants, medium, about 5 GB for E4B."


@exercise("08.2", "With --jinja on, what text did `--chat-template gemma` make llama.cpp use as the whole template?",
          "llama.cpp did not look the name up: it used the word itself.")
def _forced_template(answer):
    return answer == "gemma", "\"gemma\": the prompt became that one word, and the model continued it (gggggemma...)."


# ---------------------------------------------------------------- 09 long context and speed

@exercise("09.1", "How much less GPU memory does the planner predict for a 131,072-token prefill of E4B in NF4 (PLE on the "
          "CPU, 2,048-token chunks) on the tuned path than on the plain one, in GB? Within 5%.",
          "planner.predict(..., 131072, prefill_chunk=2048, path=\"plain\") and path=\"tuned\": subtract the peaks.")
def _tuned_saving(answer):
    plain, tuned = (planner.predict("e4b-shape", "nf4", "cpu", 131072, prefill_chunk=2048, path=path).peak_bytes
                    for path in ("plain", "tuned"))
    expected = (plain - tuned) / 1e9
    return within(answer, expected, 0.05), f"about {expected:.2f} GB: the copies the plain path hands attention."


@exercise("09.2", "At least how many GB must one decode step of E4B in NF4 with the PLE on the CPU read from GPU memory "
          "(the planner's figure, 32 positions of context)? Within 5%.",
          "planner.decode_bytes_per_token(\"e4b-shape\", \"nf4\", \"cpu\").")
def _bytes_per_token(answer):
    expected = planner.decode_bytes_per_token("e4b-shape", "nf4", "cpu") / 1e9
    return within(answer, expected, 0.05), f"about {expected:.2f} GB; a card's bandwidth over it is its fastest decode."


@exercise("10.1", "How many numbers do rank-8 LoRA adapters on E4B's text decoder train (attention and MLP projections)? "
          "Within 1%.",
          "rank x (in + out) for every wrapped projection; planner.predict_training(\"e4b-shape\") counts them.")
def _adapter_parameters(answer):
    expected = planner.predict_training("e4b-shape").adapter_parameters
    return within(answer, expected, 0.01), f"{expected:,}: rank x (in + out), summed over the wrapped projections."


@exercise("10.2", "Beside the weights, which term of planner.predict_training(\"e4b-shape\", sequence=512) is the largest? "
          "Give its name as the planner prints it.",
          "print the estimate and compare the terms that do not start with 'weights'.")
def _largest_training_term(answer):
    terms = planner.predict_training("e4b-shape", sequence=512).terms
    largest = max((term for term in terms if not term.startswith("weights")), key=terms.get)
    return str(answer).strip() == largest, f"{largest!r}: several values per token for every entry of the vocabulary."
