"""Random Hadamard transform (in progress)."""


def random_hadamard_transform(x, axis=-1, block=16, seed=0):
    raise NotImplementedError("the random Hadamard transform is being implemented")
