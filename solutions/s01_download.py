"""Solutions to notebook 01's exercises."""


def answer_01_1():
    return {"HF_ENDPOINT", "HF_HUB_DISABLE_XET", "HF_HUB_DISABLE_IMPLICIT_TOKEN"}


def answer_01_2():
    from helpers import download

    return download.hub_token("http://192.168.1.10:8090")  # False: send no token
