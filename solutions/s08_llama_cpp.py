"""Solutions to notebook 08's exercises."""


def answer_08_1():
    return "Q4_K_M"


def answer_08_2():
    return "gemma"
