"""Solutions to notebook 06's exercises. On a GPU, measure 06.1 too: load E4B (NF4, PLE on the CPU), prefill
16,384 tokens and read torch.cuda.max_memory_allocated() (notebook 06's profiling cells)."""


def answer_06_1():
    from helpers import planner

    return planner.predict("e4b-shape", "nf4", "cpu", 16384).peak_bytes / 1e9


def answer_06_2():
    from helpers import planner

    return planner.fits("e4b-shape", 8, "nf4", "cpu").safe_context
