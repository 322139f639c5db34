"""Solutions to notebook 09's exercises (measure them on a GPU with make bench PRESET=long-context)."""


def answer_09_1():
    from helpers import planner

    plain, tuned = (planner.predict("e4b-shape", "nf4", "cpu", 131072, prefill_chunk=2048, path=path).peak_bytes
                    for path in ("plain", "tuned"))
    return (plain - tuned) / 1e9


def answer_09_2():
    from helpers import planner

    return planner.decode_bytes_per_token("e4b-shape", "nf4", "cpu") / 1e9
