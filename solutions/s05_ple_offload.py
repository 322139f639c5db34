"""Solutions to notebook 05's exercises."""


def answer_05_1():
    from helpers import models

    text = models.load_config("e4b-shape").get_text_config()
    return text.vocab_size_per_layer_input * text.num_hidden_layers * text.hidden_size_per_layer_input * 2 / 1e9


def answer_05_2():
    from helpers import models

    text = models.load_config("e4b-shape").get_text_config()
    return text.num_hidden_layers * text.hidden_size_per_layer_input * 2
