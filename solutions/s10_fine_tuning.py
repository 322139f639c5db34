"""Solutions to notebook 10's exercises (measure the training peak on a GPU with tests/gpu/test_fine_tuning_gpu.py)."""


def answer_10_1():
    from helpers import fine_tuning, models, weights

    skeleton = weights.meta_model(models.load_config("e4b-shape"))
    return fine_tuning.adapter_parameters(skeleton, rank=8)


def answer_10_2():
    from helpers import planner

    terms = planner.predict_training("e4b-shape", sequence=512).terms
    return max((term for term in terms if not term.startswith("weights")), key=terms.get)
