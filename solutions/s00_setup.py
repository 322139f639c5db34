"""Solutions to notebook 00's exercises."""


def answer_00_1():
    # helpers/paths.py: cache_dir() reads it
    return "GEMMA_COURSE_CACHE"


def answer_00_2():
    capability = (7, 5)  # torch.cuda.get_device_capability() on a T4
    return capability >= (8, 0)
