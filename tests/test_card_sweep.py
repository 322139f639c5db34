"""The GPU card sweep (tools/card_sweep.py, make test-gpu-sweep): its parts cover every card size a learner brings
and the whole GPU, for both shapes, each exactly once, in parts small enough for one device call."""

import importlib.util

from helpers import cards
from helpers.paths import REPO_ROOT

spec = importlib.util.spec_from_file_location("card_sweep", REPO_ROOT / "tools" / "card_sweep.py")
card_sweep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(card_sweep)


def test_the_sweep_runs_every_card_size_from_4_gb_and_the_whole_gpu_for_both_shapes_once():
    runs = [(shape, card) for shape, part in card_sweep.parts() for card in part]
    wanted = [(shape, card) for shape in ("e4b-shape", "e2b-shape")
              for card in [*(f"{gb:g}" for gb in cards.CARD_SIZES_GB), "uncapped"]]
    assert sorted(runs) == sorted(wanted) and len(runs) == len(set(runs))
    assert min(cards.CARD_SIZES_GB) == 4 and all(len(part) <= card_sweep.CARDS_PER_PART for _, part in card_sweep.parts())


def test_each_part_is_one_make_test_gpu_cards_call_with_its_shape_and_cards():
    shape, part = card_sweep.parts()[0]
    assert card_sweep.command(shape, part)[2:] == ["test-gpu-cards", f"GEMMA_MODEL={shape}", f"GPU_CARDS={' '.join(part)}"]
