"""Solutions to notebook 03's exercises."""


def answer_03_1(source=None):
    from helpers import models, placement, weights

    meta = weights.meta_model(models.load_config(source))
    device_map = {"model.vision_tower": "cpu", "": 0}
    placement.validate_device_map(meta, device_map)  # raises DeviceMapKeyError for a key that matches nothing
    return device_map


def answer_03_2():
    return ""
