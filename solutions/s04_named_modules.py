"""Solutions to notebook 04's exercises."""


def answer_04_1(source=None):
    from helpers import models, weights

    model = weights.meta_model(models.load_config(source))  # shapes only: no weights needed
    leaves = [(name, module) for name, module in model.named_modules() if not list(module.children())]
    sizes = {name: sum(p.numel() * p.element_size() for p in module.parameters(recurse=False)) for name, module in leaves}
    return max(sizes, key=sizes.get)


def answer_04_2(source=None):
    from helpers import models, weights

    model = weights.meta_model(models.load_config(source))
    return next(name for name, _ in model.named_modules() if name.endswith("embed_tokens_per_layer"))
