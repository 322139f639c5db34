"""The learners' cards: the GPUs this course is for, in one place."""

# what the planner's card table answers for (GB the allocator may use)
CARDS = {"RTX 4060 (8 GB)": 8, "12 GB": 12, "Colab T4 (15 GB)": 15, "16 GB laptop": 16, "24 GB": 24}
# the cards the benchmark simulates on a big GPU: RTX 4060, Colab T4 (15 GB usable), the seed
# issue's 16 GB laptop card
SIMULATED_CARDS_GB = (8, 15, 16)
