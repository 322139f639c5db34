"""Solutions to notebook 07's exercises."""


def answer_07_1():
    return [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]


def answer_07_2():
    return "<turn|>"
